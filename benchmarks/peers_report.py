"""The tables of benchmarks/peers.py: ratios, exactness and times, from its rows (pure).

Apart from peers.py so that the table logic is tested without ranks, MPI or chainer
(tests/test_bench_report.py). Rows:

    time row   {"workload", "framework", "ranks", "s" (median seconds per step), ...}
    exact row  {"workload", "framework", "ranks", "case", "errors": {quantity: relative
               error or why none}, "note"}
"""

from __future__ import annotations

from typing import Any

EXACT_TOL = 1e-9  # float64 relative error under which a result counts as the dense one

# (workload, numerator framework, its ranks, denominator framework, its ranks, what it says)
RATIOS = [
    (
        "bn",
        "ChainerMN MultiNodeBatchNormalization",
        2,
        "ChainerMN MultiNodeBatchNormalization",
        1,
        "ChainerMN: 2 ranks / 1 rank (same batch per rank)",
    ),
    (
        "bn",
        "parallelkit SyncBatchNorm",
        2,
        "parallelkit SyncBatchNorm",
        1,
        "parallelkit: 2 ranks / 1 rank (same batch per rank)",
    ),
    (
        "bn",
        "ChainerMN MultiNodeBatchNormalization",
        2,
        "parallelkit SyncBatchNorm",
        2,
        "ChainerMN / parallelkit, 2 ranks",
    ),
    (
        "conv",
        "ChainerMN parallel_convolution example",
        1,
        "ChainerMN parallel_convolution example",
        2,
        "ChainerMN speedup, 1 rank / 2 ranks (same whole input)",
    ),
    (
        "conv",
        "parallelkit ChannelParallelConv2d",
        1,
        "parallelkit ChannelParallelConv2d",
        2,
        "parallelkit speedup, 1 rank / 2 ranks (same whole input)",
    ),
    (
        "conv",
        "ChainerMN parallel_convolution example",
        2,
        "parallelkit ChannelParallelConv2d",
        2,
        "ChainerMN / parallelkit, 2 ranks",
    ),
    (
        "dp",
        "ChainerMN multi-node optimizer",
        2,
        "ChainerMN multi-node optimizer",
        1,
        "ChainerMN: 2 ranks / 1 rank (same batch per rank)",
    ),
    (
        "dp",
        "parallelkit DataParallel",
        2,
        "parallelkit DataParallel",
        1,
        "parallelkit: 2 ranks / 1 rank (same batch per rank)",
    ),
    ("dp", "torch DDP", 2, "torch DDP", 1, "DDP: 2 ranks / 1 rank (same batch per rank)"),
    (
        "dp",
        "ChainerMN multi-node optimizer",
        2,
        "parallelkit DataParallel",
        2,
        "ChainerMN / parallelkit, 2 ranks",
    ),
    ("dp", "torch DDP", 2, "parallelkit DataParallel", 2, "DDP / parallelkit, 2 ranks"),
    (
        "spatial",
        "dense",
        1,
        "parallelkit SpatialParallelConv2d rows",
        2,
        "parallelkit rows speedup, dense 1 rank / 2 ranks",
    ),
    (
        "spatial",
        "DTensor Shard(2)",
        2,
        "parallelkit SpatialParallelConv2d rows",
        2,
        "DTensor Shard(2) / parallelkit rows, 2 ranks",
    ),
    (
        "spatial",
        "DTensor Shard(3)",
        2,
        "parallelkit SpatialParallelConv2d columns",
        2,
        "DTensor Shard(3) / parallelkit columns, 2 ranks",
    ),
]


def seconds(timed: list[dict], workload: str, framework: str, ranks: int) -> float | None:
    """The median step time of one framework, or None if it was not timed."""
    hit = [
        r["s"]
        for r in timed
        if (r["workload"], r["framework"], r["ranks"]) == (workload, framework, ranks)
    ]
    return hit[0] if hit else None


def key_ratios(timed: list[dict]) -> list[dict[str, Any]]:
    """Every ratio of RATIOS whose two times were measured."""
    out = []
    for workload, a, na, b, nb, label in RATIOS:
        ta, tb = seconds(timed, workload, a, na), seconds(timed, workload, b, nb)
        if ta is not None and tb is not None:
            out.append({"workload": workload, "measure": label, "ratio": ta / tb})
    return out


def verdict(r: dict) -> str:
    """ "exact", "WRONG" (an error over EXACT_TOL, or a quantity missing) or "refused"."""
    if not r["errors"]:
        return "refused"
    ok = all(isinstance(e, float) and e <= EXACT_TOL for e in r["errors"].values())
    return "exact" if ok else "WRONG"


def fmt_err(e: float | str) -> str:
    return f"{e:.1e}" if isinstance(e, float) else e


def errors_text(errors: dict[str, float | str]) -> str:
    """ "y 1.2e-16, gx 3.0e-16, ..." (at most 3 named; the rest as their maximum)."""
    items = list(errors.items())
    if len(items) <= 6:
        return ", ".join(f"{k} {fmt_err(v)}" for k, v in items)
    nums = [v for v in errors.values() if isinstance(v, float)]
    worst = max(nums) if nums else "none"
    return f"{len(items)} parameters, worst {fmt_err(worst)}"


def exact_table(exact: list[dict]) -> str:
    lines = [
        "| workload | framework | ranks | case | result | max relative error per quantity "
        "(float64, vs dense) | note |",
        "|---|---|--:|---|---|---|---|",
    ]
    for r in exact:
        lines.append(
            f"| {r['workload']} | {r['framework']} | {r['ranks']} | {r['case']} "
            f"| {verdict(r)} | {errors_text(r['errors'])} | {r['note']} |"
        )
    return "\n".join(lines)


def time_table(timed: list[dict]) -> str:
    """One line per (workload, framework): ms at each rank count and 2 ranks / 1 rank."""
    ranks = sorted({r["ranks"] for r in timed})
    keys = list(dict.fromkeys((r["workload"], r["framework"]) for r in timed))
    head = " | ".join(f"{n} rank(s) (ms)" for n in ranks)
    lines = [
        f"| workload | framework | {head} | {ranks[-1]} / {ranks[0]} |",
        "|---|---|" + "--:|" * (len(ranks) + 1),
    ]
    for workload, framework in keys:
        ts = [seconds(timed, workload, framework, n) for n in ranks]
        cells = " | ".join("-" if t is None else f"{t * 1e3:.2f}" for t in ts)
        ratio = f"{ts[-1] / ts[0]:.2f}" if ts[0] and ts[-1] else "-"
        lines.append(f"| {workload} | {framework} | {cells} | {ratio} |")
    return "\n".join(lines)


def ratio_table(ratios: list[dict]) -> str:
    lines = ["| workload | ratio of step times | value |", "|---|---|--:|"]
    lines += [f"| {r['workload']} | {r['measure']} | {r['ratio']:.2f} |" for r in ratios]
    return "\n".join(lines)


HOW_TO_READ = """\
Times are float32 forward + backward steps (dp: a whole SGD step), the median over timed
blocks of the slowest rank, one thread per rank. bn and dp keep the per-rank batch fixed
(2 ranks / 1 rank = 1.00 means no parallel overhead); conv and spatial split one fixed
problem (1 rank / 2 ranks is the speedup). ChainerMN computes in numpy and torch in ATen, so
compare each framework's own 2 ranks / 1 rank first; the cross-framework ratios mix raw
speed with overhead. The frameworks ran one after another in this one run on a shared
machine: these are the ratios of this run, not constants.

Exactness is float64, against the dense single-process computation (torch) on the whole
batch or image, max |a - dense| / max |dense| per quantity: y output, gx input gradient,
gweight / gbias parameter gradients (summed over ranks where each rank holds a share),
running statistics after one step (running_var starts at 0, as in ChainerMN), for dp the SGD
update of every parameter. "exact" means every quantity within 1e-9."""


def report(
    exact: list[dict],
    timed: list[dict],
    ratios: list[dict],
    others: dict,
    env: dict[str, str],
    command: str,
) -> str:
    """The whole markdown document."""
    load = ", ".join(f"{v:.2f} during {n} rank(s)" for n, v in others.items())
    header = [f"- {k}: {v}" for k, v in env.items()]
    parts = [
        "# parallelkit next to its peers: ChainerMN, torch DDP, SyncBatchNorm, DTensor",
        "",
        f"Command: `{command}`",
        "",
        *header,
        f"- cores used by processes outside this benchmark meanwhile: {load}",
        "",
        HOW_TO_READ,
        "",
        "## Key ratios",
        "",
        ratio_table(ratios),
        "",
        "## Exactness",
        "",
        exact_table(exact),
        "",
        "## Step times",
        "",
        time_table(timed),
        "",
        "Plots: `peers_time.png` (step times side by side), `peers_exactness.png`.",
    ]
    return "\n".join(parts) + "\n"
