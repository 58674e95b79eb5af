"""Run a function on N local ranks and get every rank's result back, with a deadline.

    with Ranks(4) as ranks:                  # 4 processes joined by gloo, started once
        results = ranks.run(fn, x, timeout=60)   # fn(comm, x) on every rank; list by rank

Tests assert in the parent on the returned values. Starting processes and a process group
costs seconds, so a ``Ranks`` pool is reused across calls; it is torn down and started afresh
only after a failure. A rank that raises fails the call at once with that rank's traceback
(the other ranks may be stuck in a collective waiting for it, so they are killed, not awaited);
a rank that dies or a call that overruns ``timeout`` fails it too. Nothing can hang.

Functions and arguments travel by pickle: ``fn`` must be importable (a module-level function).
Tensors in results come back in host memory.

``Ranks(n, device="lazy")`` declares every rank's communicator for torch's lazy-tensor device
(``torch._lazy``, which computes on the CPU): its collectives then refuse host tensors, as NCCL's
do, and stage device tensors through host memory, as gloo does with CUDA tensors. Code that
hands a host tensor to a data collective fails there on a CPU-only machine, before any GPU
run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

GRACE_S = 2.0
"""After one rank fails, how long the others get to report before they are killed."""


class RankError(AssertionError):
    """A rank raised, died, or did not finish in time.

    ``results`` holds what the ranks that did finish returned, by rank.
    """

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now, drawn below Linux's
    ephemeral range (32768-60999): a port the kernel hands out for outgoing connections (each
    gloo pair opens some) could be taken between this check and the store's bind, which
    pools started side by side (pytest-xdist) were seen to hit."""
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(20000, 32768)
        with contextlib.closing(socket.socket()) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, size: int, port: int, backend: str, timeout: float, device, inbox, outbox
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    if device is not None and str(device).startswith("lazy"):
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
    import parallelkit as pk

    comm = pk.init(backend, timeout=timeout, device=device)
    while (job := inbox.get()) is not None:
        try:
            fn, args, kwargs = pickle.loads(job)
            result = on_host(fn(comm, *args, **kwargs))
            outbox.put((rank, True, pickle.dumps(result)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


def on_host(results: Any) -> Any:
    """``results`` with every tensor in it (any nesting) detached and copied to host memory."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, results)


class Ranks:
    """A pool of ``size`` processes on one machine, each holding ``pk.init(backend)``.

    ``comm_timeout`` is the communicators' collective timeout inside the workers; ``device``
    the device their communicators are declared for (see the module docstring).
    """

    def __init__(
        self,
        size: int,
        backend: str = "gloo",
        comm_timeout: float = 60.0,
        device: str | None = None,
    ) -> None:
        self.size, self.backend, self.comm_timeout = size, backend, comm_timeout
        self.device = device
        self._procs: list[Any] = []

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.size,
                    port,
                    self.backend,
                    self.comm_timeout,
                    self.device,
                    self._inboxes[r],
                    self._outbox,
                ),
                daemon=True,
            )
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        """Stop the workers (politely when idle, by force when not)."""
        for inbox, p in zip(getattr(self, "_inboxes", []), self._procs, strict=False):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(None)
        deadline = time.monotonic() + 5
        for p in self._procs:
            if p.pid is None:  # never started: a start before it failed
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list:
        """``fn(comm, *args, **kwargs)`` on every rank; the results in rank order."""
        if not self._procs:
            self._start()
        job = pickle.dumps((fn, args, kwargs))
        for inbox in self._inboxes:
            inbox.put(job)
        results: dict[int, Any] = {}
        raised: set[int] = set()
        failure: str | None = None
        deadline = time.monotonic() + timeout
        while len(results) + len(raised) < self.size:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and failure is None:
                    codes = [self._procs[r].exitcode for r in dead]
                    failure = f"rank(s) {dead} died (exit codes {codes})"
                    deadline = min(deadline, time.monotonic() + GRACE_S)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.size)) - set(results) - raised)
                    failure = failure or f"ranks {missing} did not finish within {timeout:g} s"
                    break
                continue
            if ok:
                results[rank] = pickle.loads(payload)
                continue
            raised.add(rank)
            if failure is None:
                failure = f"rank {rank} raised:\n{payload}"
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if failure is not None:
            # A rank killed by a signal reports nothing; its peers' connection errors would hide it.
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
            if dead and "died" not in failure:
                codes = [self._procs[r].exitcode for r in dead]
                failure = f"rank(s) {dead} died (exit codes {codes}); before that, {failure}"
            self.close()  # the survivors may be stuck in a collective: start afresh next time
            raise RankError(f"{fn.__qualname__} on {self.size} ranks: {failure}", results)
        return [results[r] for r in range(self.size)]
