"""Start the ranks of ``parallelkit train``, or join the job a launcher started.

Under ``torchrun``, ``mpiexec``/``srun`` or ``torch_xla.launch`` every process is already a
rank: it joins the job (``pk.init("auto")`` reads the launcher's variables). Run from a plain
shell, ``parallelkit train`` starts ``parallel.ranks`` local ranks itself with the engine of
its backend, and does not write its own:

    gloo / nccl / auto   python -m torch.distributed.run --standalone --nproc-per-node N
                         (torchrun: a free port, and when one rank fails the agent stops
                         the others and exits non-zero)
    mpi                  mpiexec -n N (the mpiexec next to this Python, else on PATH)
    xla                  torch_xla.launch (one process per local XLA device)

One rank with the default backend runs in this process, without any launcher.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from parallelkit.comm import detect_backend
from parallelkit.train.config import Config

WORKER = [sys.executable, "-m", "parallelkit.cli", "train"]


def under_launcher() -> bool:
    """True when a launcher started this process as one rank of a job."""
    return detect_backend() != "local" or "TORCHELASTIC_RUN_ID" in os.environ


def local_command(cfg: Config, argv: list[str]) -> list[str] | None:
    """The command that starts ``parallel.ranks`` ranks here; None: run in this process."""
    n, backend = cfg.parallel.ranks, cfg.parallel.backend
    if backend == "xla":
        return None  # torch_xla.launch is a function, called by launch_xla
    if n == 1 and backend in ("auto", "local"):
        return None
    if backend == "local":
        raise ValueError(f"parallel.backend=local runs one rank; got parallel.ranks={n}")
    if backend == "mpi":
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
            "mpiexec"
        )
        if mpiexec is None:
            raise ValueError("parallel.backend=mpi: no mpiexec found (pip install mpich)")
        return [mpiexec, "-n", str(n), *WORKER, *argv]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        "parallelkit.cli",
        "train",
        *argv,
    ]


def launch(command: list[str]) -> int:
    """Run :func:`local_command`'s command and wait; the exit status is the job's."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    return subprocess.run(command, env=env).returncode


def _xla_rank(index: int, cfg: Config) -> None:
    from parallelkit.train.trainer import run

    run(cfg)


def launch_xla(cfg: Config) -> None:
    """One rank per local XLA device under torch_xla.launch (multi-host: one call per host)."""
    import torch_xla

    torch_xla.launch(_xla_rank, args=(cfg,))
