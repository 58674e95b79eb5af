"""Every zoo architecture under every strategy: a table of outcomes, to track progress.

    .venv-zoo/bin/python tests/zoo/survey.py                    # all -> tests/zoo/survey.md
    .venv-zoo/bin/python tests/zoo/survey.py --arch "tv resnet18" --strategy rows
    .venv-zoo/bin/python tests/zoo/survey.py --fallback gather  # only the gather cases
    .venv-zoo/bin/python tests/zoo/survey.py --write-expected   # and refresh EXPECTED

Each case runs on local gloo ranks (2, or 4 for "data x rows", "depth x cols" and "data x
depth") with one thread each, as ``test_zoo.py`` runs it, and is classified by
``zoo_run.classify``. Two modes, both by default:
``--fallback refuse`` runs every case as ``pk.parallelize`` runs by default; ``--fallback
gather`` runs the cases refused under a spatial strategy (``zoo_cases.gather_cases``: by this
run's refuse outcomes where it has them, else by EXPECTED) again with ``fallback="gather"``.
``--write-expected`` rewrites EXPECTED and EXPECTED_GATHER in ``zoo_expected.py`` from this run,
keeping the recorded outcome of every case not run this time, so that the tests' strict xfail
marks follow the library. The markdown has a column per strategy, then one per spatial
strategy under gather, a count per column, and the reason of every case that is not exact
below the tables. Images and volumes get a table each, with their own strategies
(``zoo_cases.IMAGE_STRATEGIES``, ``VOLUME_STRATEGIES``). Seconds per case are shown to keep
the tier's budget in view; the tests never time anything.

A gather cell counts the modules that ran on gathered whole images ("exact, 2 gathered": one
warning of parallelkit each), and a section below the tables lists them per network and
strategy with the memory per rank each warning states. Without ``--fallback refuse`` (as with
``--fallback gather`` alone) the refuse columns show the outcomes recorded in EXPECTED, without
seconds, so that ``--fallback gather`` refreshes the gather columns and that section of
survey.md in about two minutes instead of the whole table's fourteen.
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

from zoo_cases import (  # noqa: E402
    ARCHS,
    EXPECTED,
    EXPECTED_GATHER,
    IMAGE_STRATEGIES,
    SLOW,
    SPATIAL,
    STRATEGIES,
    VOLUME_STRATEGIES,
    cases,
    gather_cases,
)
from zoo_parity import FALLBACKS  # noqa: E402
from zoo_run import Outcome, Pools, run_case  # noqa: E402

MARK = {"exact": "exact", "refused": "refused", "wrong": "**WRONG**", "crash": "**CRASH**"}
RECORDED = {"refuse": EXPECTED, "gather": EXPECTED_GATHER}
Case = tuple[str, str]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="architecture (repeatable); default all")
    parser.add_argument("--strategy", action="append", help="strategy (repeatable); default all")
    parser.add_argument(
        "--fallback", action="append", choices=FALLBACKS,
        help="pk.parallelize's fallback (repeatable); default both: refuse for every case, "
        "gather for the cases refused under a spatial strategy",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "survey.md")
    parser.add_argument("--write-expected", action="store_true")
    args = parser.parse_args()
    archs = args.arch or [a for a in ARCHS if a not in SLOW]  # the tier's; SLOW by name
    strategies = args.strategy or list(STRATEGIES)
    modes = args.fallback or list(FALLBACKS)
    for name in archs:
        if name not in ARCHS:
            parser.error(f"unknown architecture {name!r}; one of {list(ARCHS)}")
    for name in strategies:
        if name not in STRATEGIES:
            parser.error(f"unknown strategy {name!r}; one of {list(STRATEGIES)}")
    chosen = [c for c in cases(slow=bool(args.arch)) if c[0] in archs and c[1] in strategies]

    # A plain kill still stops the ranks (the finally below), instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("survey.py: terminated"))
    results: dict[str, dict[Case, Outcome]] = {mode: {} for mode in FALLBACKS}
    seconds: dict[str, dict[Case, float]] = {mode: {} for mode in FALLBACKS}
    pools = Pools(least=max((STRATEGIES[s][0] for _, s in chosen), default=2))
    start = time.monotonic()
    try:
        for mode in FALLBACKS:
            if mode not in modes:
                continue
            todo = chosen if mode == "refuse" else [
                c for c in gather_cases(refuse_labels(results["refuse"])) if c in chosen
            ]  # fmt: skip
            for arch, strategy in todo:
                t0 = time.monotonic()
                outcome = run_case(pools, arch, strategy, fallback=mode)
                seconds[mode][arch, strategy] = took = time.monotonic() - t0
                results[mode][arch, strategy] = outcome
                print(f"{arch:32s} {strategy:12s} {mode:6s} {outcome.kind:8s} {took:5.1f}s "
                      f"{outcome.gathers} gathered {outcome.reason[:150]}", flush=True)  # fmt: skip
    finally:
        pools.close()
    total = time.monotonic() - start
    if "refuse" not in modes:  # shown as recorded (the gather cases were chosen by EXPECTED too)
        results["refuse"] = merge({}, chosen, EXPECTED)
    if args.write_expected:
        # Cases not run this time keep their recorded outcome: a partial run refreshes a part.
        merged = {"refuse": merge(results["refuse"], cases(), EXPECTED)}
        missing = [c for c in cases() if c not in merged["refuse"]]
        if missing:
            sys.exit(f"--write-expected: {len(missing)} cases have no outcome yet: {missing}")
        wanted = gather_cases(refuse_labels(merged["refuse"]))
        merged["gather"] = merge(results["gather"], wanted, EXPECTED_GATHER)
        if missing := [c for c in wanted if c not in merged["gather"]]:
            print(f"--write-expected: {len(missing)} gather cases have no outcome yet (run "
                  f"survey.py --fallback gather --write-expected): {missing}")  # fmt: skip
        write_expected(merged)
        print(f"wrote EXPECTED and EXPECTED_GATHER in {HERE / 'zoo_expected.py'}")
        results, strategies = merged, list(STRATEGIES)
        archs = [a for a in ARCHS if a not in SLOW]
    command = " ".join(["tests/zoo/survey.py", *map(_quoted, sys.argv[1:])])
    args.out.write_text(markdown(results, seconds, archs, strategies, total, command))
    print(f"wrote {args.out} ({total:.0f} s)")


def refuse_labels(results: dict[Case, Outcome]) -> dict[Case, str]:
    """Labels under refuse: this run's where it has them, else EXPECTED's."""
    labels = {case: label for case, (label, _) in EXPECTED.items()}
    labels.update({case: o.label for case, o in results.items()})
    return labels


def merge(run: dict[Case, Outcome], wanted: list[Case], recorded: dict) -> dict[Case, Outcome]:
    """``wanted``'s outcomes, from this run or else as ``recorded`` (in ``wanted``'s order)."""
    out = {}
    for case in wanted:
        if case in run:
            out[case] = run[case]
        elif case in recorded:
            label, reason = recorded[case]
            out[case] = Outcome(label.split(" ")[0], reason)
    return out


def _quoted(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


def markdown(results, seconds, archs, strategies, total, command) -> str:
    import parallelkit

    counts = {mode: _counts(results[mode].values()) for mode in FALLBACKS}
    lines = [
        "# Model zoo survey",
        "",
        "`pk.parallelize(model, grid, strategy)` on real networks against the dense model, 2 "
        "SGD steps in float64 (tests/zoo). exact: outputs, input and parameter gradients and "
        "`pk.to_dense` state match; refused: the same ValueError from parallelkit on every rank; "
        "**WRONG**: ran with different numbers (a silent defect); **CRASH**: any other "
        "failure; ·: not run (cols runs the COLS subset, the 4-rank strategies data x rows "
        "and data x depth the FOUR_RANKS and FOUR_RANKS_3D subsets). Numbers in brackets point "
        "to the reasons below the tables.",
        "",
        'The columns marked *gather* run `fallback="gather"` on the cases refused under the '
        'default (`fallback="refuse"`) with a spatial strategy: each must be exact, and says how '
        "many modules ran on gathered whole images (one warning each; listed with their memory "
        'under "Gathered modules"). Elsewhere nothing is refused, so nothing would be gathered '
        "(·); under the default no case gathers anything (test_zoo.py checks the count is 0).",
        "",
        f"Command: `.venv-zoo/bin/python {command}`; torch {torch.__version__}, "
        f"parallelkit {parallelkit.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores, {total:.0f} s in all. "
        + "; ".join(f"{mode}: " + _count_text(c) for mode, c in counts.items() if c)
        + "."
        + ("" if seconds["refuse"] else " The refuse columns were not run this time: they show "
           "the outcomes recorded in EXPECTED (zoo_expected.py), without seconds."),
    ]  # fmt: skip
    notes: list[str] = []
    sections = (
        ("Images (N, C, H, W)", False, IMAGE_STRATEGIES),
        ("Volumes and clips (N, C, D, H, W)", True, VOLUME_STRATEGIES),
    )
    for title, volume, kinds in sections:
        rows = [a for a in archs if ARCHS[a].volume == volume]
        if not rows:
            continue
        mine = [s for s in strategies if s in kinds]
        gathered = any(a in rows for a, _ in results["gather"])
        groups = [("refuse", s) for s in mine]
        groups += [("gather", s) for s in mine if s in SPATIAL and gathered]
        section_seconds = sum(
            took for mode in FALLBACKS for (a, _), took in seconds[mode].items() if a in rows
        )
        lines += [
            "",
            f"## {title}",
            "",
            f"{len(rows)} architectures; "
            + (
                f"{section_seconds:.0f} s of cases run this time."
                if section_seconds
                else "not run this time: the outcomes recorded in EXPECTED, without seconds."
            ),
            "",
            "| architecture | "
            + " | ".join(s if mode == "refuse" else f"{s} *gather*" for mode, s in groups)
            + " |",
            "|---|" + "---|" * len(groups),
        ]
        for arch in rows:
            cells = [_cell(results, seconds, notes, arch, mode, s) for mode, s in groups]
            lines.append(f"| {arch} | " + " | ".join(cells) + " |")
        per_column = []
        for mode, strategy in groups:
            column = [o for (a, s), o in results[mode].items() if s == strategy and a in rows]
            text = _count_text(_counts(column))
            if mode == "gather" and column:
                text += f"; {sum(o.gathers or 0 for o in column)} gathered"
            per_column.append(text)
        lines.append("| *all* | " + " | ".join(per_column) + " |")
    lines += ["", "## Reasons", "", *notes, "", *_gathered_section(results["gather"]), ""]
    return "\n".join(lines)


def _gathered_section(results: dict[Case, Outcome]) -> list[str]:
    """Per network and strategy, the modules run on gathered whole images and the memory per
    rank their warnings state (the zoo's inputs are small: compare, do not budget by them)."""
    lines = [
        "## Gathered modules",
        "",
        'Under `fallback="gather"`, each module that ran on gathered whole images, with the '
        "extra memory per rank its warning states (its whole input and output; its activations "
        "inside are not split either). The zoo's inputs are small (`zoo_cases.BATCH` samples of "
        "each network's `shape`, float64), so the MiB compare modules, not real budgets.",
        "",
        "| architecture | strategy | gathered | MiB per rank, summed "
        "| module (type): MiB per rank |",
        "|---|---|---|---|---|",
    ]
    for (arch, strategy), o in results.items():
        if o.gathers is None:
            continue
        modules = "; ".join(f"`{path}` ({kind}): {mib:.1f}" for path, kind, mib in o.gathered)
        total = sum(mib for _, _, mib in o.gathered)
        lines.append(f"| {arch} | {strategy} | {o.gathers} | {total:.1f} | {modules or '·'} |")
    if not results:
        lines.append("| · | · | · | · | not run this time |")
    return lines


def _cell(results, seconds, notes: list[str], arch: str, mode: str, s: str) -> str:
    """One table cell; a reason is appended to ``notes`` and pointed to by its number."""
    o = results[mode].get((arch, s))
    if o is None:
        return "·"  # not part of the tier (COLS, FOUR_RANKS, gather) or not run
    cell = MARK[o.kind] + (" (no remedy)" if o.label == "refused (no remedy)" else "")
    if mode == "gather" and o.gathers is not None:
        cell += f", {o.gathers} gathered" + ("," if (arch, s) in seconds[mode] else "")
    if o.reason:
        where = s if mode == "refuse" else f"{s}, gather"
        notes.append(f"{len(notes) + 1}. {arch}, {where}: {o.kind}: {o.reason}")
        cell += f" [{len(notes)}]"
    took = seconds[mode].get((arch, s))
    return cell if took is None else f"{cell} {took:.0f}s"


def _counts(outcomes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.label] = counts.get(o.label, 0) + 1
    return counts


def _count_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "·"


def write_expected(results: dict[str, dict[Case, Outcome]]) -> None:
    """Replace the EXPECTED and EXPECTED_GATHER blocks of zoo_expected.py with ``results``."""
    path = HERE / "zoo_expected.py"
    text = path.read_text()
    blocks = (("refuse", "EXPECTED", "# BEGIN EXPECTED\n"),
              ("gather", "EXPECTED_GATHER", "# BEGIN EXPECTED GATHER\n"))  # fmt: skip
    for mode, name, begin in blocks:
        head, rest = text.split(begin)
        _, tail = rest.split(begin.replace("BEGIN", "END"), 1)
        body = [f"{name}: dict[tuple[str, str], tuple[str, str]] = {{"]
        for (arch, s), o in results[mode].items():
            reason = o.reason if len(o.reason) <= 300 else o.reason[:297] + "..."
            pieces = [reason[i : i + 72] for i in range(0, len(reason), 72)] or [""]
            body.append(f"    ({arch!r}, {s!r}): (")
            body.append(f"        {o.label!r},")
            body += [f"        {p!r}" for p in pieces[:-1]]
            body.append(f"        {pieces[-1]!r},")
            body.append("    ),")
        body.append("}")
        text = head + begin + "\n".join(body) + "\n" + begin.replace("BEGIN", "END") + tail
    path.write_text(text)


if __name__ == "__main__":
    main()
