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

CHAINER_BN, PK_BN = "ChainerMN MultiNodeBatchNormalization", "parallelkit SyncBatchNorm"
CHAINER_CONV = "ChainerMN parallel_convolution example"
PK_CONV = "parallelkit ChannelParallelConv2d"
CHAINER_DP, PK_DP = "ChainerMN multi-node optimizer", "parallelkit DataParallel"
PK_ROWS = "parallelkit SpatialParallelConv2d rows"
PK_COLUMNS = "parallelkit SpatialParallelConv2d columns"

# (workload, numerator, its ranks, denominator, its ranks, what it says). Pairs measured in
# the same processes, alternating, come first: they hold under the machine's load. A
# framework against its own baseline without communication is its parallel overhead (bn,
# dp) or speedup (conv, spatial); across frameworks the two sides ran at different times.
RATIOS = [
    ("bn", CHAINER_BN, 2, "chainer local BatchNormalization", 2,
     "ChainerMN overhead: MultiNodeBN / local BN, 2 ranks"),
    ("bn", PK_BN, 2, "torch local BatchNorm2d", 2,
     "parallelkit overhead: SyncBatchNorm / local BatchNorm2d, 2 ranks"),
    ("bn", "chainer local BatchNormalization", 1, "torch local BatchNorm2d", 1,
     "raw speed: chainer / torch local batch norm, 1 rank"),
    ("bn", CHAINER_BN, 2, PK_BN, 2, "ChainerMN / parallelkit, 2 ranks (different times)"),
    ("conv", "chainer dense Convolution2D", 2, CHAINER_CONV, 2,
     "ChainerMN example speedup: dense / example, 2 ranks (the example is grouped: wrong)"),
    ("conv", "torch dense Conv2d", 2, PK_CONV, 2,
     "parallelkit speedup: dense / ChannelParallelConv2d, 2 ranks"),
    ("conv", "chainer dense Convolution2D", 1, CHAINER_CONV, 2,
     "ChainerMN example speedup over 1 rank alone (different times)"),
    ("conv", "torch dense Conv2d", 1, PK_CONV, 2,
     "parallelkit speedup over 1 rank alone (different times)"),
    ("conv", "chainer dense Convolution2D", 1, "torch dense Conv2d", 1,
     "raw speed: chainer / torch dense convolution, 1 rank"),
    ("conv", CHAINER_CONV, 2, PK_CONV, 2, "ChainerMN / parallelkit, 2 ranks (different times)"),
    ("dp", CHAINER_DP, 2, "chainer bare (plain SGD)", 2,
     "ChainerMN overhead: multi-node optimizer / plain SGD, 2 ranks"),
    ("dp", PK_DP, 2, "torch bare (plain SGD)", 2,
     "parallelkit overhead: DataParallel / plain SGD, 2 ranks"),
    ("dp", "torch DDP", 2, "torch bare (plain SGD)", 2, "DDP overhead: DDP / plain SGD, 2 ranks"),
    ("dp", "torch DDP", 2, PK_DP, 2, "DDP / parallelkit, 2 ranks"),
    ("dp", "chainer bare (plain SGD)", 1, "torch bare (plain SGD)", 1,
     "raw speed: chainer / torch SGD step, 1 rank"),
    ("dp", CHAINER_DP, 2, PK_DP, 2, "ChainerMN / parallelkit, 2 ranks (different times)"),
    ("spatial", "torch dense Conv2d", 2, PK_ROWS, 2,
     "parallelkit speedup: dense / rows split, 2 ranks"),
    ("spatial", "torch dense Conv2d", 2, PK_COLUMNS, 2,
     "parallelkit speedup: dense / columns split, 2 ranks"),
    ("spatial", "torch dense Conv2d", 1, PK_ROWS, 2,
     "parallelkit rows speedup over 1 rank alone (different times)"),
    ("spatial", "DTensor Shard(2)", 2, PK_ROWS, 2,
     "DTensor Shard(2) / parallelkit rows, 2 ranks (DTensor: wrong)"),
    ("spatial", "DTensor Shard(3)", 2, PK_COLUMNS, 2,
     "DTensor Shard(3) / parallelkit columns, 2 ranks (DTensor: wrong)"),
]  # fmt: skip


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
blocks of the slowest rank, one thread per rank. bn and dp keep the per-rank batch fixed;
conv and spatial split one fixed problem. Every parallel variant alternates, block by block,
with its framework's baseline without communication (local batch norm, the dense
convolution on the whole input, a plain SGD step), run at the same time on every rank: their
ratio is the parallel overhead or speedup under the same load, and is the number to read.
ChainerMN computes in numpy and torch in ATen ("raw speed" rows), and the two sides ran one
after the other, so the cross-framework ratios mix raw speed, overhead and the load of the
moment. The machine is shared (the load line above): these are the ratios of this run, not
constants.

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
