"""The tables of benchmarks/peers.py: ratios, overheads, exactness and times, from its rows.

Apart from peers.py so that the table logic is tested without ranks, MPI or chainer
(tests/test_bench_report.py); pure functions. Rows:

    time row   {"workload", "framework", "transport", "ranks", "s" (median seconds per
               step), ...}
    exact row  {"workload", "framework", "transport", "ranks", "case", "errors": {quantity:
               relative error or why none}, "note"}

``transport`` is "gloo" (torch.distributed) or the MPI library's name ("MPICH"), which the
tables below select with the spec ``MPI`` (any MPI library). A row without one (a record saved
before the field existed) matches no spec but None.
"""

from __future__ import annotations

from typing import Any

EXACT_TOL = 1e-9  # float64 relative error under which a result counts as the dense one

GLOO, MPI = "gloo", "MPI"  # transport specs: gloo, or whatever MPI library ran

CHAINER_BN, PK_BN = "ChainerMN MultiNodeBatchNormalization", "parallelkit SyncBatchNorm"
CHAINER_LOCAL_BN, TORCH_LOCAL_BN = "chainer local BatchNormalization", "torch local BatchNorm2d"
CHAINER_CONV = "ChainerMN parallel_convolution example"
PK_CONV = "parallelkit ChannelParallelConv2d"
CHAINER_DENSE, TORCH_DENSE = "chainer dense Convolution2D", "torch dense Conv2d"
CHAINER_DP, PK_DP, DDP = "ChainerMN multi-node optimizer", "parallelkit DataParallel", "torch DDP"
CHAINER_BARE, TORCH_BARE = "chainer bare (plain SGD)", "torch bare (plain SGD)"
PK_ROWS = "parallelkit SpatialParallelConv2d rows"
PK_COLUMNS = "parallelkit SpatialParallelConv2d columns"

# (workload, numerator, its ranks, its transport, denominator, its ranks, its transport, what
# it says; "{mpi}" is the MPI library's name). Pairs measured in the same processes,
# alternating, come first: they hold under the machine's load. A framework against its own
# baseline without communication is its parallel overhead (bn, dp) or speedup (conv,
# spatial); across frameworks or transports the two sides ran at different times.
RATIOS = [
    ("bn", CHAINER_BN, 2, MPI, CHAINER_LOCAL_BN, 2, MPI,
     "ChainerMN overhead ({mpi}): MultiNodeBN / local BN, 2 ranks"),
    ("bn", PK_BN, 2, MPI, TORCH_LOCAL_BN, 2, MPI,
     "parallelkit overhead ({mpi}): SyncBatchNorm / local BatchNorm2d, 2 ranks"),
    ("bn", PK_BN, 2, GLOO, TORCH_LOCAL_BN, 2, GLOO,
     "parallelkit overhead (gloo): SyncBatchNorm / local BatchNorm2d, 2 ranks"),
    ("bn", CHAINER_LOCAL_BN, 1, MPI, TORCH_LOCAL_BN, 1, MPI,
     "raw speed: chainer / torch local batch norm, 1 rank"),
    ("bn", CHAINER_BN, 2, MPI, PK_BN, 2, MPI,
     "ChainerMN / parallelkit, 2 ranks, both {mpi} (different times)"),
    ("conv", CHAINER_DENSE, 2, MPI, CHAINER_CONV, 2, MPI,
     "ChainerMN example speedup ({mpi}): dense / example, 2 ranks (the example is grouped: "
     "wrong)"),
    ("conv", TORCH_DENSE, 2, MPI, PK_CONV, 2, MPI,
     "parallelkit speedup ({mpi}): dense / ChannelParallelConv2d, 2 ranks"),
    ("conv", TORCH_DENSE, 2, GLOO, PK_CONV, 2, GLOO,
     "parallelkit speedup (gloo): dense / ChannelParallelConv2d, 2 ranks"),
    ("conv", CHAINER_DENSE, 1, MPI, CHAINER_CONV, 2, MPI,
     "ChainerMN example speedup over 1 rank alone ({mpi}, different times)"),
    ("conv", TORCH_DENSE, 1, MPI, PK_CONV, 2, MPI,
     "parallelkit speedup over 1 rank alone ({mpi}, different times)"),
    ("conv", CHAINER_DENSE, 1, MPI, TORCH_DENSE, 1, MPI,
     "raw speed: chainer / torch dense convolution, 1 rank"),
    ("conv", CHAINER_CONV, 2, MPI, PK_CONV, 2, MPI,
     "ChainerMN / parallelkit, 2 ranks, both {mpi} (different times)"),
    ("dp", CHAINER_DP, 2, MPI, CHAINER_BARE, 2, MPI,
     "ChainerMN overhead ({mpi}): multi-node optimizer / plain SGD, 2 ranks"),
    ("dp", PK_DP, 2, MPI, TORCH_BARE, 2, MPI,
     "parallelkit overhead ({mpi}): DataParallel / plain SGD, 2 ranks"),
    ("dp", PK_DP, 2, GLOO, TORCH_BARE, 2, GLOO,
     "parallelkit overhead (gloo): DataParallel / plain SGD, 2 ranks"),
    ("dp", DDP, 2, GLOO, TORCH_BARE, 2, GLOO, "DDP overhead (gloo): DDP / plain SGD, 2 ranks"),
    ("dp", DDP, 2, GLOO, PK_DP, 2, GLOO, "DDP / parallelkit, 2 ranks (gloo)"),
    ("dp", CHAINER_BARE, 1, MPI, TORCH_BARE, 1, MPI, "raw speed: chainer / torch SGD step, 1 rank"),
    ("dp", CHAINER_DP, 2, MPI, PK_DP, 2, MPI,
     "ChainerMN / parallelkit, 2 ranks, both {mpi} (different times)"),
    ("spatial", TORCH_DENSE, 2, MPI, PK_ROWS, 2, MPI,
     "parallelkit speedup ({mpi}): dense / rows split, 2 ranks"),
    ("spatial", TORCH_DENSE, 2, MPI, PK_COLUMNS, 2, MPI,
     "parallelkit speedup ({mpi}): dense / columns split, 2 ranks"),
    ("spatial", TORCH_DENSE, 2, GLOO, PK_ROWS, 2, GLOO,
     "parallelkit speedup (gloo): dense / rows split, 2 ranks"),
    ("spatial", TORCH_DENSE, 2, GLOO, PK_COLUMNS, 2, GLOO,
     "parallelkit speedup (gloo): dense / columns split, 2 ranks"),
    ("spatial", TORCH_DENSE, 1, MPI, PK_ROWS, 2, MPI,
     "parallelkit rows speedup over 1 rank alone ({mpi}, different times)"),
    ("spatial", "DTensor Shard(2)", 2, GLOO, PK_ROWS, 2, GLOO,
     "DTensor Shard(2) / parallelkit rows, 2 ranks, gloo (DTensor: wrong)"),
    ("spatial", "DTensor Shard(3)", 2, GLOO, PK_COLUMNS, 2, GLOO,
     "DTensor Shard(3) / parallelkit columns, 2 ranks, gloo (DTensor: wrong)"),
]  # fmt: skip

# The parallel overheads per step, each against its framework's own times: (workload, the
# parallel variant, its transport, the framework's baseline without communication).
OVERHEADS = [
    ("bn", CHAINER_BN, MPI, CHAINER_LOCAL_BN),
    ("bn", PK_BN, MPI, TORCH_LOCAL_BN),
    ("bn", PK_BN, GLOO, TORCH_LOCAL_BN),
    ("dp", CHAINER_DP, MPI, CHAINER_BARE),
    ("dp", PK_DP, MPI, TORCH_BARE),
    ("dp", PK_DP, GLOO, TORCH_BARE),
    ("dp", DDP, GLOO, TORCH_BARE),
]
# The goal: parallelkit's absolute overhead per step at or below ChainerMN's, both
# on the same MPI library. (what, workload, ChainerMN's variant, parallelkit's).
GOAL = [("SyncBN", "bn", CHAINER_BN, PK_BN), ("DP", "dp", CHAINER_DP, PK_DP)]


def mpi_transport(version: str) -> str:
    """The transport name of an MPI library from its version line ("MPICH Version: 5.0.2" ->
    "MPICH"; "Open MPI v4.1.5, ..." -> "Open MPI"); an unknown library by its first words."""
    for name in ("MVAPICH", "Intel(R) MPI", "Open MPI", "MPICH"):
        if name in version:
            return name
    return " ".join(version.replace(",", " ").split()[:2]) or MPI


def matches(transport: str | None, spec: str | None) -> bool:
    """Whether a row's transport is what ``spec`` asks for (None: any; MPI: any MPI library)."""
    if spec is None:
        return True
    if spec == MPI:
        return transport not in (None, "", GLOO)
    return transport == spec


def find(
    timed: list[dict], workload: str, framework: str, ranks: int, spec: str | None = None
) -> dict | None:
    """The time row of one framework on ``spec``'s transport, or None if it was not timed."""
    return next(
        (
            r
            for r in timed
            if (r["workload"], r["framework"], r["ranks"]) == (workload, framework, ranks)
            and matches(r.get("transport"), spec)
        ),
        None,
    )


def seconds(
    timed: list[dict], workload: str, framework: str, ranks: int, spec: str | None = None
) -> float | None:
    """The median step time of one framework, or None if it was not timed."""
    r = find(timed, workload, framework, ranks, spec)
    return None if r is None else r["s"]


def mpi_name(timed: list[dict]) -> str:
    """The MPI library's name that the rows carry ("MPICH"), or "MPI" where none ran."""
    return next((r["transport"] for r in timed if matches(r.get("transport"), MPI)), MPI)


def key_ratios(timed: list[dict]) -> list[dict[str, Any]]:
    """Every ratio of RATIOS whose two times were measured."""
    out, mpi = [], mpi_name(timed)
    for workload, a, na, ta, b, nb, tb, label in RATIOS:
        sa, sb = seconds(timed, workload, a, na, ta), seconds(timed, workload, b, nb, tb)
        if sa is not None and sb is not None:
            out.append({"workload": workload, "measure": label.format(mpi=mpi), "ratio": sa / sb})
    return out


def overheads(timed: list[dict]) -> list[dict[str, Any]]:
    """The parallel overhead per step of every OVERHEADS variant that was timed at the most
    ranks, two ways (None where a time is missing):

    - ``ratio`` / ``added_ms``: its step at the most ranks against its own step at the fewest
      (ranks keep their batch, so the step should not grow; the two ran at different times);
    - ``base_ratio`` / ``base_added_ms``: against its framework's baseline without
      communication at the most ranks, timed alternating in the same processes.
    """
    if not timed:
        return []
    lo, hi = min(r["ranks"] for r in timed), max(r["ranks"] for r in timed)
    out = []
    for workload, framework, spec, baseline in OVERHEADS:
        top = find(timed, workload, framework, hi, spec)
        if top is None:
            continue
        s_lo = seconds(timed, workload, framework, lo, spec)
        base = seconds(timed, workload, baseline, hi, spec)
        s_hi = top["s"]
        out.append(
            {
                "workload": workload,
                "framework": framework,
                "transport": top.get("transport", ""),
                "ranks": [lo, hi],
                "s": [s_lo, s_hi],
                "ratio": None if s_lo is None else s_hi / s_lo,
                "added_ms": None if s_lo is None else (s_hi - s_lo) * 1e3,
                "baseline": baseline,
                "baseline_s": base,
                "base_ratio": None if base is None else s_hi / base,
                "base_added_ms": None if base is None else (s_hi - base) * 1e3,
            }
        )
    return out


def goal_verdict(over: list[dict]) -> str:
    """One line: is parallelkit's added time per step at or below ChainerMN's, for SyncBN and
    DP, both on the same MPI library? "met" where both measures of ``overheads`` say so,
    "missed" where both say not, "split" where they disagree."""
    parts, states = [], []
    for what, workload, chainer, pk in GOAL:
        c, p = (
            next(
                (
                    o
                    for o in over
                    if (o["workload"], o["framework"]) == (workload, name)
                    and matches(o["transport"], MPI)
                ),
                None,
            )
            for name in (chainer, pk)
        )
        if c is None or p is None:
            states.append("not measured")
            parts.append(f"{what} not measured on MPI")
            continue
        if c["transport"] != p["transport"]:
            states.append("not comparable")
            parts.append(
                f"{what} not comparable (ChainerMN on {c['transport']}, parallelkit on "
                f"{p['transport']})"
            )
            continue
        checks = [
            (key, p[key] <= c[key])
            for key in ("added_ms", "base_added_ms")
            if p[key] is not None and c[key] is not None
        ]
        if not checks:
            state = "not measured"
        elif all(ok for _, ok in checks):
            state = "met"
        elif not any(ok for _, ok in checks):
            state = "missed"
        else:
            state = "split"
        states.append(state)
        parts.append(
            f"{what} {state} (parallelkit {ms(p['added_ms'])} vs ChainerMN {ms(c['added_ms'])} "
            f"over its {p['ranks'][0]}-rank step; {ms(p['base_added_ms'])} vs "
            f"{ms(c['base_added_ms'])} over its local baseline in the same processes)"
        )
    overall = "met" if all(s == "met" for s in states) else "not met"
    transports = sorted({o["transport"] for o in over if matches(o["transport"], MPI)})
    on = " / ".join(transports) or "MPI"
    return (
        f"**Goal, parallelkit's added time per step at or below ChainerMN's, both on {on}: "
        f"{overall}.** " + "; ".join(parts) + "."
    )


def ms(v: float | None) -> str:
    """Milliseconds added per step, signed ("+1.23 ms"), or "-" where not measured."""
    return "-" if v is None else f"{v:+.2f} ms"


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
        "| workload | framework | transport | ranks | case | result | max relative error per "
        "quantity (float64, vs dense) | note |",
        "|---|---|---|--:|---|---|---|---|",
    ]
    for r in exact:
        lines.append(
            f"| {r['workload']} | {r['framework']} | {r.get('transport', '')} | {r['ranks']} "
            f"| {r['case']} "
            f"| {verdict(r)} | {errors_text(r['errors'])} | {r['note']} |"
        )
    return "\n".join(lines)


def time_table(timed: list[dict]) -> str:
    """One line per (workload, framework, transport): ms at each rank count, most ranks /
    fewest, and the ms that the most ranks added per step."""
    ranks = sorted({r["ranks"] for r in timed})
    keys = list(dict.fromkeys((r["workload"], r["framework"], r.get("transport")) for r in timed))
    head = " | ".join(f"{n} rank(s) (ms)" for n in ranks)
    lo, hi = ranks[0], ranks[-1]
    lines = [
        f"| workload | framework | transport | {head} | {hi} / {lo} | {hi} − {lo} (ms) |",
        "|---|---|---|" + "--:|" * (len(ranks) + 2),
    ]
    for workload, framework, transport in keys:
        ts = [seconds(timed, workload, framework, n, transport) for n in ranks]
        cells = " | ".join("-" if t is None else f"{t * 1e3:.2f}" for t in ts)
        both = ts[0] is not None and ts[-1] is not None
        ratio = f"{ts[-1] / ts[0]:.2f}" if both and ts[0] else "-"
        added = f"{(ts[-1] - ts[0]) * 1e3:+.2f}" if both else "-"
        lines.append(
            f"| {workload} | {framework} | {transport or ''} | {cells} | {ratio} | {added} |"
        )
    return "\n".join(lines)


def overhead_table(over: list[dict]) -> str:
    """The overheads of ``overheads``: ratio and ms added per step, both ways."""
    lo, hi = over[0]["ranks"] if over else (1, 2)
    lines = [
        f"| workload | framework | transport | {lo} rank(s) (ms) | {hi} rank(s) (ms) "
        f"| {hi} / {lo} | added per step ({hi} − {lo}) | local baseline at {hi} ranks, same "
        "processes (ms) | parallel / baseline | added per step over the baseline |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for o in over:
        s_lo, s_hi = o["s"]
        lines.append(
            f"| {o['workload']} | {o['framework']} | {o['transport']} | {num(s_lo, 1e3)} "
            f"| {num(s_hi, 1e3)} | {num(o['ratio'])} | {ms(o['added_ms'])} "
            f"| {num(o['baseline_s'], 1e3)} | {num(o['base_ratio'])} "
            f"| {ms(o['base_added_ms'])} |"
        )
    return "\n".join(lines)


def num(v: float | None, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.2f}"


def ratio_table(ratios: list[dict]) -> str:
    lines = ["| workload | ratio of step times | value |", "|---|---|--:|"]
    lines += [f"| {r['workload']} | {r['measure']} | {r['ratio']:.2f} |" for r in ratios]
    return "\n".join(lines)


HOW_TO_READ = """\
Transports. ChainerMN runs its `naive` communicator on MPI (mpi4py, under the chainer venv's
mpiexec). parallelkit runs twice: on MPI with pk.init("mpi") (under the torch venv's mpiexec;
the header names both MPI libraries), which is ChainerMN's transport, and on gloo. torch's
DDP, SyncBatchNorm and DTensor need torch.distributed, so they run on gloo only. Every row
names its transport.

Times are float32 forward + backward steps (dp: a whole SGD step), the median over timed
blocks of the slowest rank, one thread per rank. bn and dp keep the per-rank batch fixed;
conv and spatial split one fixed problem. Every parallel variant alternates, block by block,
with its framework's baseline without communication (local batch norm, the dense
convolution on the whole input, a plain SGD step), run at the same time on every rank: their
ratio is the parallel overhead or speedup under the same load.

Overheads (bn, dp) come two ways, each as a ratio and as the milliseconds added per step,
always against the framework's own times (chainer computes in numpy and torch in ATen, so
only the added milliseconds compare across frameworks): the step at the most ranks against
the same step at the fewest (which ran at another time, so the load of the moment and the
ranks sharing the cores count in), and against the framework's local baseline in the same
processes (the communication and waiting alone). The goal line compares parallelkit with
ChainerMN on the same MPI library: "met" where both measures say parallelkit adds no more
than ChainerMN, "missed" where both say it adds more, "split" where they disagree.

The frameworks and transports ran one after the other, so the cross-framework ratios mix raw
speed, overhead and the load of the moment. The machine is shared (the load line above):
these are the numbers of this run, not constants.

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
    over: list[dict] | None = None,
) -> str:
    """The whole markdown document (``over``: ``overheads(timed)`` unless given)."""
    over = overheads(timed) if over is None else over
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
        goal_verdict(over),
        "",
        "## Parallel overhead per step",
        "",
        overhead_table(over),
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
