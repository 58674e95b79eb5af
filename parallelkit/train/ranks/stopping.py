"""What a rank does on SIGINT or SIGTERM: stop within a bounded time, exit non-zero.

The signal comes from the local launcher (which passes its own on), from torchrun's agent, from
mpiexec or from srun; a job may get it on every rank at once or on one rank only.

- By default a rank exits at once (status 128 + signal number). Every file the run writes is
  renamed into place complete, so what is on disk is the last checkpoint, the metrics logged
  so far and the previous ``model.pt``. A peer waiting for this rank in a collective sees the
  connection close and exits too.
- With ``train.checkpoint_on_signal=true`` the ranks finish the current step, agree to stop at
  the same step (one 1-element all-reduce after each step: the price of agreeing), write a
  checkpoint and then exit with 128 + signal number.
- A second signal always exits at once.

Exits skip the leave-together barrier of the normal end (``os._exit``): a peer may already be
gone or stuck, and waiting for it is what made a stopped job hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch

from parallelkit.comm import Communicator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_now(code: int, message: str = "") -> None:
    """Flush what was printed and leave at once, without atexit handlers or barriers."""
    with contextlib.suppress(Exception):
        if message:
            sys.stderr.write(message + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class StopOnSignal:
    """Installs the handlers for the duration of a run; ``requested()`` asks at step ends."""

    def __init__(self, rank: int, checkpoint: bool) -> None:
        self.rank, self.checkpoint = rank, checkpoint
        self.signum = 0
        self.step = 0  # for messages: the last step finished

    def _handler(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.checkpoint and not self.signum:
            self.signum = signum
            with contextlib.suppress(Exception):
                print(
                    f"parallelkit train: rank {self.rank} got {name}; stopping after this "
                    "step with a checkpoint (train.checkpoint_on_signal)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        exit_now(
            128 + signum,
            f"parallelkit train: rank {self.rank} stopped by {name} after step {self.step}",
        )

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now until :meth:`uninstall` (main thread only:
        Python sets signal handlers there; elsewhere the defaults stay)."""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, comm: Communicator, device: torch.device, step: int) -> int:
        """The signal every rank agrees to stop on after ``step`` (0: go on). Collective when
        checkpointing on signals; otherwise always 0 (the handler exits by itself)."""
        self.step = step
        if not self.checkpoint:
            return 0
        flag = torch.tensor([float(self.signum)], device=device)
        return int(comm.all_reduce(flag, "max").item())
