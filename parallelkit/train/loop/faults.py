"""Injected faults, to try the job's failure handling the way real faults happen.

``train.fail_at_step=N`` makes rank ``train.fail_rank`` (-1: the last) fail at step ``N``:

    exit               ``os._exit(3)``: a crash without goodbye (a killed or segfaulted rank)
    raise              a Python exception before the step, where the data is read (a corrupt
                       image): the other ranks are already waiting in the step's collectives
    raise_in_backward  a Python exception inside the backward pass, while the gradient
                       all-reduces of the later layers are in flight

Exceptions take the normal error path (the exit hook of the communicator), so the tests see
what a user sees.
"""

from __future__ import annotations

import os
import sys
import time

from parallelkit.comm import Communicator
from parallelkit.train.schema import TrainConfig


class InjectedFault(RuntimeError):
    """The exception ``train.fail_how=raise`` raises."""


def maybe_fail(t: TrainConfig, comm: Communicator, step: int, nets: dict) -> None:
    """Fail as configured when this is the rank and the step; else nothing."""
    rank = t.fail_rank if t.fail_rank >= 0 else comm.size - 1
    if step != t.fail_at_step or comm.rank != rank:
        return
    where = f"rank {comm.rank} at step {step} (train.fail_at_step)"
    # The wall-clock time of the fault, for the tests that measure how fast the job ends.
    print(f"parallelkit train: injecting {t.fail_how} on {where} at {time.time():.3f}",
          file=sys.stderr, flush=True)  # fmt: skip
    if t.fail_how == "exit":
        os._exit(3)
    if t.fail_how == "raise":
        raise InjectedFault(f"injected fault on {where}")

    def hook(grad):  # the first layer's gradient is computed last in backward
        raise InjectedFault(f"injected fault in backward on {where}")

    first = next(iter(nets.values()))
    next(first.parameters()).register_hook(hook)
