"""A rank's start-up, seen from both sides: what a rank does between its first instruction and
its first collective, and what the launcher that started it watches.

Why it needs watching. Before its first collective a rank is alone: it imports, repeats the
launcher's checks on its own node (files, the model's constructor), and joins the others. A
collective's timeout (``parallel.timeout``) cannot fire there, so a rank stuck in that phase
(a deadlock in a library, a file system that does not answer) would hang the job for ever, and
a check that fails on a rank other than 0 would leave no word. So:

- each rank started by ``parallelkit train``/``predict`` marks each phase of its start-up in a
  folder the launcher made (``PARALLELKIT_RANKS_DIR``): ``checks-RANK`` when its checks begin,
  ``join-RANK`` when they passed, ``ready-RANK`` once its first collective returned. Each phase
  has ``parallel.timeout``: the launcher names the ranks that stay longer in one, with the
  phase, and stops them as it stops stalled ranks (:class:`Startup`, read by
  :func:`parallelkit.train.ranks.procs.supervise`);
- a rank whose check fails leaves ``error-RANK`` there, one line, and the launcher prints it
  with the rank's exit status; under the user's own launcher (torchrun, srun, mpiexec) every
  rank whose check fails prints its line itself, naming its rank when it is not rank 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from parallelkit.comm import Communicator, detect_backend, launcher

RANKS_DIR = "PARALLELKIT_RANKS_DIR"
"""Set in the ranks that ``parallelkit train``/``predict`` starts: where they leave word."""


PHASES = ("checks", "join", "ready")
"""The marks a rank leaves, in order; before the first it is starting Python and importing."""
_WHERE = ("starting Python and importing", "its checks (files, the data set's setup, the "
          "model's constructor)", "joining the others")  # fmt: skip


class Startup:
    """The launcher's side: the folder its ranks leave word in, and how long a rank may stay in
    one phase of its start-up (``timeout`` seconds: ``parallel.timeout``). :meth:`close`
    removes the folder."""

    def __init__(self, ranks: int, timeout: float) -> None:
        self.ranks, self.timeout = ranks, timeout
        self.dir = Path(tempfile.mkdtemp(prefix="parallelkit-ranks-"))
        self.began = time.time()  # the marks' clock: their files' modification times
        self.printed: set[int] = set()

    @property
    def env(self) -> dict[str, str]:
        return {RANKS_DIR: str(self.dir)}

    def stuck(self) -> tuple[list[int], str] | None:
        """The ranks that have stayed ``timeout`` seconds in one phase, and the line that names
        them; None while every rank progresses. Ranks past their first collective count as
        done, and once all are done nothing is read again."""
        now, late, starting = time.time(), {}, []
        for rank in range(self.ranks):
            since, phase = self.began, -1
            for i, name in enumerate(PHASES):
                with contextlib.suppress(OSError):
                    since, phase = (self.dir / f"{name}-{rank}").stat().st_mtime, i
            if phase < len(PHASES) - 1:
                starting.append(rank)
                if now - since > self.timeout:
                    late[rank] = _WHERE[phase + 1]
        if not late:
            return None
        names = ", ".join(f"rank {r}" for r in late)
        where = "; ".join(sorted(set(late.values())))
        others = [f"rank {r}" for r in starting if r not in late]
        also = f" ({', '.join(others)} still starting too)" if others else ""
        return list(late), (
            f"{names} made no progress in {where} for parallel.timeout={self.timeout:g} s, "
            f"before the first collective{also}; stopping the ranks"
        )

    def done(self) -> bool:
        """Whether every rank is past its first collective."""
        return all((self.dir / f"ready-{r}").exists() for r in range(self.ranks))

    def errors(self) -> dict[int, str]:
        """The failed checks not yet returned by this method: {rank: line}."""
        found = {}
        for rank in range(self.ranks):
            path = self.dir / f"error-{rank}"
            if rank not in self.printed and path.is_file():
                found[rank] = path.read_text(errors="replace").strip()
                self.printed.add(rank)
        return found

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def failed_checks(errors: dict[int, str]) -> list[str]:
    """``errors`` ({rank: line}) as lines, one per distinct message, naming the ranks."""
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(errors.items()):
        by_message.setdefault(message, []).append(rank)
    lines = []
    for message, ranks in by_message.items():
        which = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"error on {which} {', '.join(map(str, ranks))} (exit status 2): {message}")
    return lines


def report(command: str, message: str) -> None:
    """A rank's failed check: left for the launcher that started it, else printed by this rank
    (every rank whose check fails says so; one rank's data path missing is that rank's news)."""
    job = launcher.detect()
    folder = os.environ.get(RANKS_DIR)
    if folder and Path(folder).is_dir():
        _leave(Path(folder), f"error-{job.rank}", message)
        return
    where = "" if job.rank == 0 else f" on rank {job.rank}"
    print(f"parallelkit {command}: error{where}: {message}", file=sys.stderr, flush=True)


def reached(phase: str, rank: int | None = None) -> None:
    """Tell the launcher (if ``parallelkit`` started this rank) that this rank entered
    ``phase`` (one of :data:`PHASES`; ``ready``: the start-up is over)."""
    folder = os.environ.get(RANKS_DIR)
    if folder and Path(folder).is_dir():
        rank = launcher.detect().rank if rank is None else rank
        _leave(Path(folder), f"{phase}-{rank}", "")


def join(cfg) -> Communicator:
    """The world communicator, as the trainer and predict would make it, after one barrier:
    the end of this rank's start-up (:func:`reached` ``ready``)."""
    import parallelkit as pk
    from parallelkit.train.ranks.devices import requested_device

    reached("join")
    comm = pk.init(cfg.parallel.backend, timeout=cfg.parallel.timeout,
                   device=requested_device(cfg.parallel.device))  # fmt: skip
    comm.barrier()
    reached("ready", comm.rank)
    return comm


def check_mpi_world(backend: str, job: launcher.Launcher) -> None:
    """Under an srun step or MPI launcher whose ranks would use MPI: MPI's world must be the
    launcher's, or a ``ValueError`` (MPI started without its launcher's PMI sees each rank
    alone, and each would train alone). Initializes MPI, as ``pk.init`` would next."""
    used = backend if backend != "auto" else detect_backend()
    if job.name not in ("srun", "mpiexec") or used != "mpi":
        return
    try:
        from mpi4py import MPI
    except ImportError:
        return  # pk.init says that mpi4py is missing
    problem = launcher.mpi_mismatch(job, MPI.COMM_WORLD.Get_size())
    if problem:
        raise ValueError(problem)


def _leave(folder: Path, name: str, text: str) -> None:
    part = folder / f".{name}.{os.getpid()}"
    part.write_text(text + "\n")
    part.replace(folder / name)  # whole or absent when the launcher looks
