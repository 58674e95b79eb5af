"""Stopping every rank together, with one line: what a problem found on some ranks becomes.

A rank that raises ends the job through the communicator's exit hook: a traceback, and the
launcher names that rank. That is right for a bug or a crash, and wrong for a verdict the ranks
can reach together: no usable checkpoint to resume from, a run directory another run locked a
moment earlier, a disk that filled up during a save. For those the ranks agree first
(:func:`agree`: one all-reduce, the cost of the barrier it replaces), and then every rank
raises :class:`Stop`. The lowest rank that found the problem says it in one line; every rank
leaves with the same exit status (2: a mistake the user can correct, as for a config error),
and the launcher adds nothing (:mod:`parallelkit.train.ranks.procs`).
"""

from __future__ import annotations

import torch

from parallelkit.comm import Communicator

REFUSED = 2
"""Exit status of a job whose ranks refused together (the launcher's own refusals use it too)."""


class Stop(Exception):
    """Raised on every rank alike once the ranks agreed to stop; ``report``: this rank says
    the message (exactly one rank of the job does)."""

    def __init__(self, message: str, report: bool = True, status: int = REFUSED) -> None:
        super().__init__(message)
        self.report, self.status = report, status


def agree(comm: Communicator, problem: str, status: int = REFUSED) -> None:
    """Collective over ``comm``: returns when no rank has a ``problem`` (an empty string);
    otherwise raises :class:`Stop` on every rank, reported by the lowest rank that has one."""
    device = comm.device if comm.device is not None else torch.device("cpu")
    mine = torch.tensor([float(comm.rank if problem else comm.size)], device=device)
    first = int(comm.all_reduce(mine, "min").item())
    if first < comm.size:
        raise Stop(problem or "stopped", report=comm.rank == first, status=status)


def same_everywhere(message: str, comm: Communicator, status: int = REFUSED) -> Stop:
    """A problem every rank finds alike without asking the others (a config mistake read from
    the same files): no collective needed; rank 0 reports it."""
    return Stop(message, report=comm.rank == 0, status=status)
