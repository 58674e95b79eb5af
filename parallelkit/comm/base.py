"""The communicator interface that every backend implements.

A communicator is a group of ranks that move tensors between them. It is named after the MPI
operations it offers and knows nothing of autograd (that lives in ``parallelkit.functional``).

Every public method here checks its arguments the same way on every rank (the checks:
:mod:`parallelkit.comm.checks`), optionally checks in debug mode that all ranks called the same
collective with agreeing shapes, takes the size-1 fast path, and then hands a contiguous
tensor to the backend's underscore method. Backends therefore implement a handful of short
primitives on contiguous tensors along dimension 0:

    _all_reduce, _all_reduce_async, _all_gather, _reduce_scatter, _broadcast, _reduce,
    _exchange, _barrier, _split, _host_all_gather

Two paths, kept apart. *Data* (activations, gradients, statistics) moves through the
collectives above and stays on its device: a communicator that declares a ``device`` (NCCL:
this rank's GPU) refuses tensors anywhere else with a ``ValueError``, instead of the backend's
obscure failure. *Host metadata* (block sizes, split tables, bucket orders, debug signatures:
small lists of Python ints) moves through :meth:`Communicator.all_gather_ints`, which each
backend routes over a path that always works on the host: a gloo companion group beside NCCL,
MPI's host buffers, XLA's host exchange. No layer builds a CPU tensor for a data collective.

Operations are out of place: they return new tensors and leave their inputs alone, unless
the caller passes ``out=`` (a buffer to write the result into, possibly the input itself).
A backend reads its timeout, debug mode and device from :mod:`parallelkit.comm.settings`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from parallelkit.comm.checks import OPS, ArgumentChecks, Op
from parallelkit.comm.debug import check_exchange
from parallelkit.comm.dtypes import DTYPES  # noqa: F401 (importable from here, as before)
from parallelkit.comm.settings import (  # noqa: F401 (importable from here, as before)
    DEFAULT_TIMEOUT_S,
    env_debug,
    env_timeout,
    resolve_device,
)
from parallelkit.geometry import tensor_split_sizes

# A message of a neighbour exchange: (peer rank in this communicator, tensor).
Message = tuple[int, torch.Tensor]


PEER_FAILED_EXIT = 4
"""Exit status of a rank that leaves because a collective failed (usually: a peer died), so
that a launcher can name the rank that failed first rather than one it took along."""


class CommError(RuntimeError):
    """A collective failed or timed out, usually because another rank failed."""


class Work(Protocol):
    """Handle of an asynchronous operation."""

    def wait(self) -> torch.Tensor:
        """Block until the operation is done and return its result."""
        ...


class DoneWork:
    """A handle whose result is already there (size-1 communicators, fast paths)."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


class Communicator(ArgumentChecks, ABC):
    """A group of ``size`` ranks; this process is ``rank``.

    Subclasses set ``rank``, ``size``, ``backend``, ``timeout`` and ``debug`` and implement the
    underscore primitives. ``debug=True`` (or ``PARALLELKIT_DEBUG=1``) makes every collective
    first compare a small signature (operation, shape, dtype, root) across ranks and raise the
    same ``ValueError`` on every rank when they disagree, instead of hanging or corrupting memory.
    """

    rank: int
    size: int
    backend: str
    timeout: float
    debug: bool
    device: torch.device | None = None
    """Where data tensors must live (NCCL: this rank's GPU); ``None`` accepts any device the
    backend can move (host memory, or device memory staged through it)."""

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(backend={self.backend!r}, rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------------ public operations
    # Every operation returns a new tensor unless ``out`` is given: then the result is written
    # there (it may be the input itself for all_reduce and broadcast, which makes them in place)
    # and ``out`` is returned. Reusing buffers matters for large messages: a fresh allocation of
    # tens of MiB is page-faulted in again on every call, which can cost more than the copy.
    def all_reduce(
        self, t: torch.Tensor, op: Op = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elementwise reduction over all ranks; every rank gets the result."""
        t = self._reduce_input(t, op, "all_reduce")
        out = self._output(out, t.shape, t, "all_reduce")
        if self.size == 1:
            return _copy_into(out, t)
        return self._finish(self._all_reduce(t, _backend_op(op), out), op)

    def all_reduce_async(
        self, t: torch.Tensor, op: Op = "sum", *, out: torch.Tensor | None = None
    ) -> Work:
        """Start :meth:`all_reduce`; ``handle.wait()`` returns the result.

        Neither ``t`` nor ``out`` may be touched before ``wait()`` returns.
        """
        t = self._reduce_input(t, op, "all_reduce")
        out = self._output(out, t.shape, t, "all_reduce")
        if self.size == 1:
            return DoneWork(_copy_into(out, t))
        work = self._all_reduce_async(t, _backend_op(op), out)
        return work if op != "mean" else _ThenWork(work, lambda r: self._finish(r, op))

    def all_gather(
        self,
        t: torch.Tensor,
        dim: int = 0,
        sizes: Sequence[int] | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Concatenation along ``dim`` of every rank's tensor, in rank order.

        Ranks may hold different sizes along ``dim``. ``sizes`` (every rank's size along
        ``dim``), when the caller knows it, saves the small collective that otherwise learns it.
        """
        t = self._contiguous(t, "all_gather")
        dim = _check_dim(dim, t, "all_gather")
        if sizes is not None:
            sizes = self._check_sizes(sizes, t.shape[dim], "all_gather", dim)
        self._debug_check("all_gather", t, masked_dim=dim)
        if sizes is None:
            sizes = self._exchange_sizes(t.shape[dim]) if self.size > 1 else [t.shape[dim]]
        out = self._output(out, _resized(t.shape, dim, sum(sizes)), t, "all_gather")
        if self.size == 1:
            return _copy_into(out, t)
        if dim == 0:
            return self._all_gather(t, sizes, out)
        if sizes.count(sizes[0]) == len(sizes):
            # Equal blocks: gathered as they are, stacked (P, ..., n, ...), then one copy puts
            # each in place (no copy of the input into dim-0 layout first).
            n = t.shape[0]
            stacked = self._all_gather(t, [n] * self.size, t.new_empty(self.size * n, *t.shape[1:]))
            blocks = stacked.view(self.size, *t.shape).movedim(0, dim)
            out.view(blocks.shape).copy_(blocks)
            return out
        # Uneven blocks: gathered in dim-0 layout, then one copy into place.
        moved = t.movedim(dim, 0).contiguous()
        gathered = self._all_gather(moved, sizes, moved.new_empty(sum(sizes), *moved.shape[1:]))
        return out.copy_(gathered.movedim(0, dim))

    def reduce_scatter(
        self,
        t: torch.Tensor,
        dim: int = 0,
        op: Op = "sum",
        sizes: Sequence[int] | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reduce over ranks, then keep this rank's block along ``dim``.

        Blocks follow ``torch.tensor_split`` (the first ones one larger) unless ``sizes`` gives
        each rank's block size; ``sizes`` must add up to ``t.shape[dim]``.
        """
        t = self._reduce_input(t, op, "reduce_scatter", check=False)
        dim = _check_dim(dim, t, "reduce_scatter")
        if sizes is None:
            sizes = list(_even_sizes(t.shape[dim], self.size))
        else:
            sizes = [int(s) for s in sizes]
            if len(sizes) != self.size or sum(sizes) != t.shape[dim] or min(sizes) < 0:
                raise ValueError(
                    f"reduce_scatter: sizes {sizes} must be {self.size} non-negative block "
                    f"sizes adding up to the input's size {t.shape[dim]} along dim {dim}"
                )
        out = self._output(out, _resized(t.shape, dim, sizes[self.rank]), t, "reduce_scatter")
        self._debug_check("reduce_scatter", t, extra=OPS.index(op))
        if self.size == 1:
            return _copy_into(out, t)
        if dim == 0:
            return self._finish(self._reduce_scatter(t, sizes, _backend_op(op), out), op)
        moved = t.movedim(dim, 0).contiguous()
        block = moved.new_empty(sizes[self.rank], *moved.shape[1:])
        block = self._finish(self._reduce_scatter(moved, sizes, _backend_op(op), block), op)
        return out.copy_(block.movedim(0, dim))

    def broadcast(
        self, t: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rank ``src``'s tensor on every rank; the others pass a tensor of the same shape."""
        t = self._contiguous(t, "broadcast")
        self._check_rank(src, "broadcast", "src")
        out = self._output(out, t.shape, t, "broadcast")
        self._debug_check("broadcast", t, extra=src)
        if self.size == 1 or self.rank == src:
            _copy_into(out, t)
        return out if self.size == 1 else self._broadcast(out, src)

    def reduce(
        self, t: torch.Tensor, dst: int = 0, op: Op = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reduction over ranks, returned on ``dst``; the other ranks get zeros.

        Zeros (rather than undefined memory) make this the exact adjoint of :meth:`broadcast`.
        """
        self._check_rank(dst, "reduce", "dst")
        t = self._reduce_input(t, op, "reduce", check=False)
        out = self._output(out, t.shape, t, "reduce")
        self._debug_check("reduce", t, extra=dst * len(OPS) + OPS.index(op))
        if self.size == 1:
            return _copy_into(out, t)
        return self._finish(self._reduce(t, dst, _backend_op(op), out), op)

    def neighbor_exchange(
        self, send: Sequence[Message], recv: Sequence[Message]
    ) -> list[torch.Tensor]:
        """Point-to-point exchange that every rank of the group calls at once.

        ``send`` lists ``(peer, tensor)`` messages to post, ``recv`` lists ``(peer, buffer)``
        buffers to fill; all are posted together and waited on, so no ordering of the calls can
        deadlock (what halo exchange needs). Several messages between the same two ranks are
        matched in the order they are listed. A peer may be this rank itself (periodic chains of
        one rank): the data is copied. Returns the filled receive buffers in ``recv`` order.
        """
        for peer, _ in (*send, *recv):
            self._check_rank(peer, "neighbor_exchange", "peer")
        for _, buf in recv:
            if not buf.is_contiguous():
                raise ValueError("neighbor_exchange: receive buffers must be contiguous")
            self._check_device(buf, "neighbor_exchange")
        send = [(p, self._contiguous(t, "neighbor_exchange")) for p, t in send]
        if self.debug and self.size > 1:
            check_exchange(self, send, recv)
        own = [t for p, t in send if p == self.rank]
        own_bufs = [b for p, b in recv if p == self.rank]
        if len(own) != len(own_bufs):
            raise ValueError(
                f"neighbor_exchange: rank {self.rank} sends {len(own)} messages to itself "
                f"but receives {len(own_bufs)}"
            )
        for t, buf in zip(own, own_bufs, strict=True):
            buf.copy_(t.view(buf.shape))
        remote_send = [(p, t) for p, t in send if p != self.rank]
        remote_recv = [(p, b) for p, b in recv if p != self.rank]
        if remote_send or remote_recv:
            self._exchange(_tagged(remote_send), _tagged(remote_recv))
        return [buf for _, buf in recv]

    def barrier(self) -> None:
        """Wait until every rank has called ``barrier``."""
        if self.size > 1:
            self._barrier()

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order, over the host path (never a data device).

        For small host metadata: sizes, split tables, orders. Every rank passes the same number
        of values (a rank that does not know how many the others send first gathers the count).
        """
        row = [int(v) for v in values]
        return [row] if self.size == 1 else self._host_all_gather(row)

    def split(self, color: int, key: int = 0) -> Communicator:
        """Sub-communicator of the ranks that pass the same ``color`` (``MPI_Comm_split``).

        Ranks are ordered by ``key``, then by their rank here. Every rank must call it.
        """
        if int(color) < 0:
            raise ValueError(f"split: color must be >= 0, got {color}")
        return self._split(int(color), int(key))

    # ------------------------------------------------------------------ backend primitives
    # Inputs are contiguous, outputs are contiguous buffers of the result's shape and dtype that
    # the primitive fills and returns (``out`` may be ``t`` itself for an all-reduce). ``op`` is
    # "sum", "max" or "min": the base class turns "mean" into a sum and a division.
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _all_reduce_async(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> Work: ...

    @abstractmethod
    def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0; ``sizes[r]`` is rank r's size along dim 0."""

    @abstractmethod
    def _reduce_scatter(
        self, t: torch.Tensor, sizes: list[int], op: Op, out: torch.Tensor
    ) -> torch.Tensor:
        """Reduce, then this rank's block of dim 0 (``sizes`` gives every block)."""

    @abstractmethod
    def _broadcast(self, out: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast ``out`` in place: it holds the data on ``src``."""

    @abstractmethod
    def _reduce(self, t: torch.Tensor, dst: int, op: Op, out: torch.Tensor) -> torch.Tensor:
        """The reduction into ``out`` on ``dst``; zeros in ``out`` elsewhere."""

    @abstractmethod
    def _exchange(
        self, send: list[tuple[int, int, torch.Tensor]], recv: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Post ``(peer, tag, tensor)`` sends and receives together, wait for all."""

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _split(self, color: int, key: int) -> Communicator: ...

    @abstractmethod
    def _host_all_gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` of ints (all of one length, int64), on the host path; each
        backend holds them in what its host path moves cheapest."""

    # ------------------------------------------------------------------ shared helpers
    def _finish(self, result: torch.Tensor, op: str) -> torch.Tensor:
        """Turn a sum into a mean where asked."""
        return result.div_(self.size) if op == "mean" else result

    def _exchange_sizes(self, n: int) -> list[int]:
        """Every rank's ``n``, by one small host all-gather."""
        return [row[0] for row in self.all_gather_ints([n])]


class _ThenWork:
    """A backend handle whose result is post-processed on ``wait()``."""

    def __init__(self, work: Work, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._work, self._then = work, then

    def wait(self) -> torch.Tensor:
        return self._then(self._work.wait())


def _copy_into(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out if out is t else out.copy_(t)


def _resized(shape: torch.Size, dim: int, n: int) -> tuple[int, ...]:
    resized = list(shape)  # (slicing a torch.Size builds Size objects: twice the time)
    resized[dim] = n
    return tuple(resized)


@functools.lru_cache(maxsize=256)
def _even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """``tensor_split_sizes``, remembered: a reduce-scatter of one shape repeats every step, and
    the list comprehension costs a fifth of a small message's time."""
    return tuple(tensor_split_sizes(total, parts))


def _backend_op(op: str) -> Op:
    return "sum" if op == "mean" else op  # type: ignore[return-value]


def _check_dim(dim: int, t: torch.Tensor, name: str) -> int:
    ndim = t.dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        shape = tuple(t.shape)
        raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape {shape}")
    return dim if dim >= 0 else dim + ndim


def _tagged(messages: Sequence[Message]) -> list[tuple[int, int, torch.Tensor]]:
    """Number the messages to each peer so that both sides match them in listed order."""
    count: dict[int, int] = {}
    out = []
    for peer, t in messages:
        out.append((peer, count.get(peer, 0), t))
        count[peer] = count.get(peer, 0) + 1
    return out
