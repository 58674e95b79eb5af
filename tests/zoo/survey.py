"""Every zoo architecture under every strategy: a table of outcomes, to track progress.

    .venv-zoo/bin/python tests/zoo/survey.py                    # all -> tests/zoo/survey.md
    .venv-zoo/bin/python tests/zoo/survey.py --arch "tv resnet18" --strategy rows
    .venv-zoo/bin/python tests/zoo/survey.py --write-expected   # and refresh EXPECTED

Each case runs on local gloo ranks (2, or 4 for "data x rows") with one thread each, as
``test_zoo.py`` runs it, and is classified by ``zoo_run.classify``. ``--write-expected``
rewrites the EXPECTED table in ``zoo_cases.py`` from this run (all cases must have run), so
that the tests' strict xfail marks follow the library. The markdown lists the reason of every
case that is not exact below the table. Seconds per case are shown to keep the tier's budget
in view; the tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from zoo_cases import ARCHS, EXPECTED, STRATEGIES, cases  # noqa: E402
from zoo_run import Outcome, Pools, run_case  # noqa: E402

MARK = {"exact": "exact", "refused": "refused", "wrong": "**WRONG**", "crash": "**CRASH**"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="architecture (repeatable); default all")
    parser.add_argument("--strategy", action="append", help="strategy (repeatable); default all")
    parser.add_argument("--out", type=Path, default=HERE / "survey.md")
    parser.add_argument("--write-expected", action="store_true")
    args = parser.parse_args()
    archs = args.arch or list(ARCHS)
    strategies = args.strategy or list(STRATEGIES)
    for name in archs:
        if name not in ARCHS:
            parser.error(f"unknown architecture {name!r}; one of {list(ARCHS)}")
    for name in strategies:
        if name not in STRATEGIES:
            parser.error(f"unknown strategy {name!r}; one of {list(STRATEGIES)}")

    # A plain kill still stops the ranks (the finally below), instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("survey.py: terminated"))
    results: dict[tuple[str, str], Outcome] = {}
    seconds: dict[tuple[str, str], float] = {}
    pools = Pools()
    start = time.monotonic()
    try:
        for arch, strategy in cases():  # grouped by pool size: each pool starts once
            if arch in archs and strategy in strategies:
                t0 = time.monotonic()
                outcome = run_case(pools, arch, strategy)
                seconds[arch, strategy] = time.monotonic() - t0
                results[arch, strategy] = outcome
                took = seconds[arch, strategy]
                print(f"{arch:32s} {strategy:12s} {outcome.kind:8s} {took:5.1f}s "
                      f"{outcome.reason[:150]}", flush=True)  # fmt: skip
    finally:
        pools.close()
    total = time.monotonic() - start
    if args.write_expected:
        # Cases not run this time keep their recorded outcome: a partial run refreshes a part.
        merged = {case: results.get(case) or recorded(case) for case in cases()
                  if case in results or case in EXPECTED}  # fmt: skip
        if missing := [case for case in cases() if case not in merged]:
            sys.exit(f"--write-expected: {len(missing)} cases have no outcome yet: {missing}")
        write_expected(merged)
        print(f"wrote EXPECTED in {HERE / 'zoo_cases.py'}")
        results, archs, strategies = merged, list(ARCHS), list(STRATEGIES)
    args.out.write_text(markdown(results, seconds, archs, strategies, total))
    print(f"wrote {args.out} ({total:.0f} s)")


def recorded(case: tuple[str, str]) -> Outcome:
    """The outcome EXPECTED records for ``case`` (its label back to a kind)."""
    label, reason = EXPECTED[case]
    return Outcome(label.split(" ")[0], reason)


def markdown(results, seconds, archs, strategies, total) -> str:
    counts: dict[str, int] = {}
    for o in results.values():
        counts[o.label] = counts.get(o.label, 0) + 1
    import parallelkit

    lines = [
        "# Model zoo survey",
        "",
        "`pk.parallelize(model, grid, strategy)` on real networks against the dense model, 2 "
        "SGD steps in float64 (tests/zoo). exact: outputs, input and parameter gradients and "
        "`pk.to_dense` state match; refused: the same ValueError from parallelkit on every rank; "
        "**WRONG**: ran with different numbers (a silent defect); **CRASH**: any other "
        "failure; ·: not run (the 4-rank strategy runs the FOUR_RANKS subset). Numbers in "
        "brackets point to the reasons below the table.",
        "",
        f"Command: `.venv-zoo/bin/python tests/zoo/survey.py`; torch {torch.__version__}, "
        f"parallelkit {parallelkit.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores, {total:.0f} s in all. "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
        "",
        "| architecture | " + " | ".join(strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    notes: list[str] = []
    for arch in archs:
        cells = []
        for s in strategies:
            o = results.get((arch, s))
            if o is None:
                cells.append("·")  # not part of the tier (FOUR_RANKS) or not run this time
                continue
            cell = MARK[o.kind] + (" (no remedy)" if o.label == "refused (no remedy)" else "")
            if o.reason:
                notes.append(f"{len(notes) + 1}. {arch}, {s}: {o.kind}: {o.reason}")
                cell += f" [{len(notes)}]"
            took = seconds.get((arch, s))
            cells.append(cell if took is None else f"{cell} {took:.0f}s")
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    lines += ["", "## Reasons", "", *notes, ""]
    return "\n".join(lines)


def write_expected(results: dict[tuple[str, str], Outcome]) -> None:
    """Replace the EXPECTED block of zoo_cases.py with this run's outcomes."""
    path = HERE / "zoo_cases.py"
    text = path.read_text()
    head, rest = text.split("# BEGIN EXPECTED\n")
    _, tail = rest.split("# END EXPECTED\n")
    body = ["EXPECTED: dict[tuple[str, str], tuple[str, str]] = {"]
    for (arch, s), o in results.items():
        reason = o.reason if len(o.reason) <= 300 else o.reason[:297] + "..."
        pieces = [reason[i : i + 72] for i in range(0, len(reason), 72)] or [""]
        body.append(f"    ({arch!r}, {s!r}): (")
        body.append(f"        {o.label!r},")
        body += [f"        {p!r}" for p in pieces[:-1]]
        body.append(f"        {pieces[-1]!r},")
        body.append("    ),")
    body.append("}")
    path.write_text(head + "# BEGIN EXPECTED\n" + "\n".join(body) + "\n# END EXPECTED\n" + tail)


if __name__ == "__main__":
    main()
