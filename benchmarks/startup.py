"""What starting the local ranks costs: ``parallelkit train`` with its ranks forked from the
launcher (the default on Linux CPUs) against each rank a new Python (``PARALLELKIT_FORK_RANKS=0``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup.py     # ~3 min

Each run is the whole command on a ResNet-18 of width 4 on 16x16 digits, one training step,
then the run's end as usual (evaluation of the 359 test images, checkpoint, export), so that
start-up is most of it: what a short job, a ``--check`` turned real run or a test pays. Timed
per run: the wall clock, and the CPU seconds of the launcher and every rank (user + system,
from ``RUSAGE_CHILDREN``: the launcher reaps its ranks, so their time is counted). The two ways
alternate, ``--rounds`` times each, and the table gives the median of each. ``--check`` alone
(the launcher's own checks, no rank) is the part that both ways share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import alternating, command_line, environment, save

TINY = [
    "model.width=4",
    "model.stem=cifar",
    "data.image_size=16",
    "data.channels=1",
    "train.batch_size=16",
    "train.max_steps=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
]
WAYS = {"forked": "1", "new processes": "0"}


@dataclasses.dataclass
class Config:
    ranks: tuple[int, ...] = (2, 4)
    rounds: int = 3


def run(args: list[str], fork: str) -> tuple[float, float]:
    """One ``parallelkit train ARGS`` in a fresh run directory: (wall s, CPU s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLELKIT_FORK_RANKS=fork)
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "parallelkit.cli", "train", *args, f"train.run_dir={run_dir}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=Config.rounds)
    p.add_argument("--ranks", type=int, nargs="+", default=list(Config.ranks))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/startup.md"))
    args = p.parse_args()
    cfg = Config(ranks=tuple(args.ranks), rounds=args.rounds)
    rows = []
    checks = [run(["--check", *TINY], "1") for _ in range(cfg.rounds)]
    rows.append(
        {"what": "--check (the launcher alone)", "ranks": 0, "way": "",
         "wall_s": statistics.median(w for w, _ in checks),
         "cpu_s": statistics.median(c for _, c in checks)}
    )  # fmt: skip
    for n in cfg.ranks:
        times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for way in alternating(list(WAYS), cfg.rounds):
            times[way].append(run([*TINY, f"parallel.ranks={n}"], WAYS[way]))
        for way, got in times.items():
            rows.append(
                {"what": f"{n} ranks", "ranks": n, "way": way,
                 "wall_s": statistics.median(w for w, _ in got),
                 "cpu_s": statistics.median(c for _, c in got)}
            )  # fmt: skip
    lines = ["| run | ranks started as | wall s | CPU s |", "|---|---|--:|--:|"]
    lines += [f"| {r['what']} | {r['way']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} |" for r in rows]
    ratios = []
    for n in cfg.ranks:
        fork, new = (next(r for r in rows if r["ranks"] == n and r["way"] == w) for w in WAYS)
        ratios.append(
            f"- {n} ranks, forked / new processes: wall {fork['wall_s'] / new['wall_s']:.2f}, "
            f"CPU {fork['cpu_s'] / new['cpu_s']:.2f}"
        )
    env = environment()
    text = "\n".join(
        [
            "# Starting the local ranks: forked from the launcher, or new processes",
            "",
            f"Command: `{command_line()}`",
            "",
            *[f"- {k}: {v}" for k, v in env.items()],
            f"- median of {cfg.rounds} runs each, the two ways alternating; every run: "
            f"`parallelkit train {' '.join(TINY)} parallel.ranks=N`",
            "",
            *lines,
            "",
            *ratios,
            "",
        ]
    )
    print(text)
    save(args.out, text, env, cfg, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
