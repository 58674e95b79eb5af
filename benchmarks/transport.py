"""The transport of ``parallelkit train``'s local ranks: the default against gloo and MPI under
``mpiexec``, on the command users run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transport.py     # ~10 min

Two jobs, each on 2 local ranks, one compute thread each:

    data      the main job (ResNet-18 with SyncBatchNorm on the digits, data parallel), a
              small per-rank batch so that the collectives weigh as on a fast device
    spatial   the same network with each image split by rows over the 2 ranks (64x64 images):
              halos, SyncBatchNorm's statistics and the split loss every step

and three ways to run each:

    default   ``parallelkit train`` as it is (``parallel.backend=auto``): MPI where mpi4py and
              MPICH are installed, started by the launcher itself (every socket on loopback)
    gloo      ``parallel.backend=gloo``
    mpiexec   the user's own ``mpiexec -n 2 parallelkit train`` (MPICH's Hydra), which is
              ``parallel.backend=mpi`` as it ran before the launcher served MPI itself

A run's time per step comes from its metrics (``metrics.jsonl``: a record every 10 steps with
its wall clock), from step 10 to the last step, so start-up, the first steps and the
evaluation are left out. The ways alternate, ``--rounds`` times each; the table gives the
median. Goal: the default within 5% of MPI under mpiexec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import alternating, command_line, environment, save

QUIET = ["train.progress=false", "train.tensorboard=false", "train.plot=false", "train.epochs=1"]
JOBS = {
    "data": ["train.batch_size=16", "train.max_steps=60"],
    "spatial": ["parallel.rows=2", "data.image_size=64", "train.batch_size=8",
                "train.max_steps=40"],
}
CLI = [sys.executable, "-m", "parallelkit.cli", "train"]


@dataclasses.dataclass
class Config:
    rounds: int = 2
    jobs: tuple[str, ...] = tuple(JOBS)


def command(way: str, args: list[str]) -> list[str]:
    if way == "mpiexec":
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
        return [mpiexec or "mpiexec", "-n", "2", *CLI, *args]
    backend = ["parallel.backend=gloo"] if way == "gloo" else []
    return [*CLI, "parallel.ranks=2", *backend, *args]


def step_ms(way: str, job: str) -> tuple[float, str]:
    """One run: (ms per step from step 10 to the last, the transport its table names)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as run_dir:
        args = [*JOBS[job], *QUIET, f"train.run_dir={run_dir}"]
        proc = subprocess.run(command(way, args), capture_output=True, text=True, env=env,
                              timeout=900)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{way} {job} failed:\n{proc.stderr[-3000:]}")
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    first, last = train[0], train[-1]
    ranks = next(line for line in proc.stdout.splitlines() if line.startswith("| ranks "))
    ms = 1000 * (last["time"] - first["time"]) / (last["step"] - first["step"])
    return ms, ranks.split("|")[2].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=Config.rounds)
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/transport.md"))
    args = p.parse_args()
    cfg = Config(rounds=args.rounds, jobs=tuple(args.jobs))
    ways = ["default", "gloo", "mpiexec"]
    rows = []
    for job in cfg.jobs:
        times: dict[str, list[float]] = {way: [] for way in ways}
        names = {}
        for way in alternating(ways, cfg.rounds):
            ms, names[way] = step_ms(way, job)
            times[way].append(ms)
            print(f"{job} {way}: {ms:.1f} ms/step ({names[way]})", flush=True)
        for way in ways:
            rows.append({"job": job, "way": way, "ranks": names[way], "runs_ms": times[way],
                         "ms": statistics.median(times[way])})  # fmt: skip
    lines = ["| job | way | ranks (the run's table) | ms per step | x MPI under mpiexec |",
             "|---|---|---|--:|--:|"]  # fmt: skip
    verdicts = []
    for job in cfg.jobs:
        mpi = next(r["ms"] for r in rows if r["job"] == job and r["way"] == "mpiexec")
        for r in (r for r in rows if r["job"] == job):
            lines.append(f"| {job} | {r['way']} | {r['ranks']} | {r['ms']:.1f} | "
                         f"{r['ms'] / mpi:.2f} |")  # fmt: skip
        default = next(r["ms"] for r in rows if r["job"] == job and r["way"] == "default")
        verdicts.append(f"- {job}: the default at {default / mpi:.2f}x MPI under mpiexec's step "
                        f"time (goal <= 1.05)")  # fmt: skip
    env = environment()
    text = "\n".join(
        [
            "# The transport of parallelkit train's local ranks",
            "",
            f"Command: `{command_line()}`",
            "",
            *[f"- {k}: {v}" for k, v in env.items()],
            f"- median of {cfg.rounds} runs each, the ways alternating; 2 ranks, one thread each",
            *[f"- {job}: `parallelkit train {' '.join(JOBS[job] + QUIET)}`" for job in cfg.jobs],
            "",
            *lines,
            "",
            *verdicts,
            "",
        ]
    )
    print(text)
    save(args.out, text, env, cfg, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
