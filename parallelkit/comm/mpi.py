"""MPI backend through mpi4py, for ``mpiexec`` / ``srun`` launched jobs.

Contiguous CPU tensors travel by their address (``MPI.buffer.fromaddress``: zero-copy, never
pickled, and cheaper than a NumPy view, which matters for small messages). MPI has no 16-bit
float types: float16 and bfloat16 are moved as 16-bit integers (bit-exact) and reduced in
float32, then rounded once. CUDA tensors are passed straight to a CUDA-aware MPI when the
library reports one (or ``PARALLELKIT_MPI_CUDA_AWARE=1``); tensors on any other device (CUDA
without a CUDA-aware MPI, XLA, lazy) are staged through host memory explicitly: copied out,
moved, copied back into the caller's device buffer.

MPI collectives cannot time out, so a watchdog thread aborts the whole job (``MPI_Abort``) when
one has not finished within the communicator's timeout, and an except hook aborts the job when
any rank dies of an uncaught exception (as ChainerMN's global except hook does); without them,
the other ranks would wait forever.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from parallelkit.comm.base import PEER_FAILED_EXIT, Communicator, Op, Work
from parallelkit.comm.settings import env_debug, env_timeout, resolve_device

_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_MPI_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.float16: MPI.INT16_T,  # moved as bits; reduced in float32 (_reduction_buffers)
    torch.bfloat16: MPI.INT16_T,
}
_HALF = (torch.float16, torch.bfloat16)
_TAG_BASE = 1000  # neighbour exchange tags start here


def _cuda_aware() -> bool:
    if os.environ.get("PARALLELKIT_MPI_CUDA_AWARE") is not None:
        return os.environ["PARALLELKIT_MPI_CUDA_AWARE"] == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    return bool(query and query())


def _buf(t: torch.Tensor, count: Any = None) -> list[Any]:
    """mpi4py buffer spec over contiguous ``t``'s memory (no copy). A host tensor is passed by
    its address, which costs a tenth of a NumPy view (``Tensor.numpy()``, about 0.7 us, twice
    per call: most of a small message's time); it does not keep ``t`` alive, so every caller
    holds ``t`` until MPI is done with it (``_MPIWork`` for requests in flight). 16-bit floats
    travel as their bits."""
    if not t.is_contiguous():  # an address alone would read the wrong elements
        raise ValueError(f"mpi: a {tuple(t.shape)} tensor with strides {t.stride()} is not "
                         "contiguous; collectives move contiguous tensors")  # fmt: skip
    if t.is_cuda:
        data = t
    elif nbytes := t.numel() * t.element_size():  # not t.nbytes: torch.compile traces this
        data = MPI.buffer.fromaddress(t.data_ptr(), nbytes)
    else:  # no memory to point at
        data = t.view(torch.int16).numpy() if t.dtype in _HALF else t.numpy()
    if count is None:
        return [data, _MPI_TYPES[t.dtype]]
    return [data, count, _MPI_TYPES[t.dtype]]


class MPICommunicator(Communicator):
    """A communicator over an mpi4py ``Comm`` (``MPI.COMM_WORLD`` by default)."""

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.device = resolve_device(device)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.backend = "mpi"
        self.timeout = env_timeout() if timeout is None else timeout
        self.debug = env_debug() if debug is None else debug
        self.cuda_aware = _cuda_aware()
        _start_watchdog()

    @classmethod
    def init(
        cls,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        device: torch.device | str | None = None,
    ) -> MPICommunicator:
        """The world communicator, with the abort-on-exception hook installed.

        ``PARALLELKIT_MPI_ABORT_ON_EXCEPTION=0`` leaves ``sys.excepthook`` alone.
        """
        if os.environ.get("PARALLELKIT_MPI_ABORT_ON_EXCEPTION", "1") != "0":
            install_abort_hook()
        return cls(timeout=timeout, debug=debug, device=device)

    # Every blocking MPI call runs under the watchdog. Device tensors go through host memory
    # unless the MPI library can read them (CUDA-aware); 16-bit floats are reduced in float32.
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        direct = t.is_cpu or (t.is_cuda and self.cuda_aware)
        return t if direct else t.cpu()

    def _reduction_buffers(
        self, t: torch.Tensor, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) tensors MPI can reduce: host memory, float32 for 16-bit floats."""
        src, dst = self._host(t), self._host(out)
        if t.dtype in _HALF:
            src, dst = src.float(), torch.empty(dst.shape, dtype=torch.float32)
        return src, dst

    def _all_reduce(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> torch.Tensor:
        src, dst = self._reduction_buffers(t, out)
        send = MPI.IN_PLACE if src is dst else _buf(src)
        self._watched("all_reduce", self.comm.Allreduce, send, _buf(dst), _MPI_OPS[op])
        return _copy_back(out, dst)

    def _all_reduce_async(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> Work:
        src, dst = self._reduction_buffers(t, out)
        if src is dst:
            request = self.comm.Iallreduce(MPI.IN_PLACE, _buf(dst), op=_MPI_OPS[op])
        else:
            request = self.comm.Iallreduce(_buf(src), _buf(dst), op=_MPI_OPS[op])
        return _MPIWork(self, request, src, dst, out)

    def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
        src, dst = self._host(t), self._host(out)
        if min(sizes) == max(sizes):
            self._watched("all_gather", self.comm.Allgather, _buf(src), _buf(dst))
        else:
            row = math.prod(src.shape[1:])
            counts = [n * row for n in sizes]
            displs = list(itertools.accumulate([0, *counts[:-1]]))
            recv = _buf(dst, (counts, displs))
            self._watched("all_gather", self.comm.Allgatherv, _buf(src), recv)
        return _copy_back(out, dst)

    def _reduce_scatter(
        self, t: torch.Tensor, sizes: list[int], op: Op, out: torch.Tensor
    ) -> torch.Tensor:
        src, dst = self._reduction_buffers(t, out)
        if min(sizes) == max(sizes):
            scatter = self.comm.Reduce_scatter_block
            self._watched("reduce_scatter", scatter, _buf(src), _buf(dst), _MPI_OPS[op])
        else:
            counts = [n * math.prod(src.shape[1:]) for n in sizes]
            scatter = self.comm.Reduce_scatter
            self._watched("reduce_scatter", scatter, _buf(src), _buf(dst), counts, _MPI_OPS[op])
        return _copy_back(out, dst)

    def _broadcast(self, out: torch.Tensor, src: int) -> torch.Tensor:
        buf = self._host(out)
        self._watched("broadcast", self.comm.Bcast, _buf(buf), src)
        return _copy_back(out, buf)

    def _reduce(self, t: torch.Tensor, dst: int, op: Op, out: torch.Tensor) -> torch.Tensor:
        send, recv = self._reduction_buffers(t, out)
        root = self.rank == dst
        sendbuf = MPI.IN_PLACE if root and send is recv else _buf(send)
        recvbuf = _buf(recv) if root else None
        self._watched("reduce", self.comm.Reduce, sendbuf, recvbuf, _MPI_OPS[op], dst)
        if not root:
            recv.zero_()
        return _copy_back(out, recv)

    def _exchange(
        self, send: list[tuple[int, int, torch.Tensor]], recv: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        host_send = [(p, tag, self._host(t)) for p, tag, t in send]
        host_recv = [(p, tag, self._host(t)) for p, tag, t in recv]
        requests = [self.comm.Isend(_buf(t), p, _TAG_BASE + tag) for p, tag, t in host_send]
        requests += [self.comm.Irecv(_buf(t), p, _TAG_BASE + tag) for p, tag, t in host_recv]
        self._watched("neighbor_exchange", MPI.Request.Waitall, requests)
        for (_, _, buf), (_, _, host) in zip(recv, host_recv, strict=True):
            _copy_back(buf, host)

    def _barrier(self) -> None:
        self._watched("barrier", self.comm.Barrier)

    def _split(self, color: int, key: int) -> MPICommunicator:
        sub = self._watched("split", self.comm.Split, color, key)
        return MPICommunicator(sub, timeout=self.timeout, debug=self.debug, device=self.device)

    def _host_all_gather(self, row: list[int]) -> list[list[int]]:
        # NumPy rows: a third of the time of torch tensors for a handful of ints.
        mine = np.array(row, dtype=np.int64)
        table = np.empty((self.size, len(row)), dtype=np.int64)
        self._watched("all_gather_ints", self.comm.Allgather, mine, table)
        return table.tolist()

    def _watched(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a blocking MPI call, with its deadline registered with the watchdog
        (a dict insert and delete: about 0.2 us, against 0.6 us for a ``with`` block)."""
        token = next(_TOKENS)
        _ACTIVE[token] = (time.monotonic() + self.timeout, self, name)
        try:
            return call(*args)
        finally:
            del _ACTIVE[token]


class _MPIWork:
    """An ``Iallreduce`` in flight; keeps its buffers alive until ``wait()``."""

    def __init__(
        self,
        comm: MPICommunicator,
        request: MPI.Request,
        src: torch.Tensor,
        dst: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self._comm, self._request = comm, request
        self._src, self._dst, self._out = src, dst, out

    def wait(self) -> torch.Tensor:
        self._comm._watched("all_reduce (async)", self._request.Wait)
        return _copy_back(self._out, self._dst)


def _copy_back(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``buf``'s data (a no-op unless ``buf`` was a host or float32 stand-in)."""
    return out if buf is out else out.copy_(buf)


_ACTIVE: dict[int, tuple[float, MPICommunicator, str]] = {}
"""The blocking calls in progress on any thread of this process: (deadline, comm, name)."""
_TOKENS = itertools.count()


def _start_watchdog() -> None:
    """One daemon thread per process that aborts the MPI job when a call overruns its
    deadline; the message is only built then."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:
        if _WATCHDOG is None:
            _WATCHDOG = threading.Thread(target=_watch, name="parallelkit-mpi-watchdog")
            _WATCHDOG.daemon = True
            _WATCHDOG.start()


def _watch() -> None:
    while True:
        time.sleep(0.2)
        now = time.monotonic()
        for deadline, comm, name in list(_ACTIVE.values()):
            if now > deadline:
                sys.stderr.write(
                    f"\nparallelkit: mpi {name} on rank {comm.rank} of {comm.size} did not "
                    f"finish within {comm.timeout:g} s; another rank has probably failed or "
                    "called a different collective. Aborting the MPI job (set the limit with "
                    "pk.init(timeout=...) or PARALLELKIT_TIMEOUT).\n"
                )
                _abort(PEER_FAILED_EXIT)  # not the cause: parallelkit's launcher names another


def _abort(status: int = 1) -> None:
    """Flush, give the launcher a moment to forward what this rank printed, abort the job
    with exit ``status``. MPI_Abort returns where the process manager leaves the ending to
    the ranks (parallelkit's own launcher: :mod:`parallelkit.train.ranks.pmi`); this rank then
    exits, and the launcher stops the others."""
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(status)
    os._exit(status)


_WATCHDOG: threading.Thread | None = None
_WATCHDOG_LOCK = threading.Lock()
_original_hook = None


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank abort the whole MPI job instead of hanging it."""
    global _original_hook
    if _original_hook is not None:
        return
    _original_hook = sys.excepthook

    def hook(exc_type, value, tb):  # type: ignore[no-untyped-def]
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\nparallelkit: uncaught exception on rank {rank}; MPI_Abort.\n")
        try:
            _original_hook(exc_type, value, tb)
        finally:
            _abort()

    sys.excepthook = hook
