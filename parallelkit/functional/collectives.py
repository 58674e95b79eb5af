"""The collectives over whole tensors, as autograd pairs: all-gather and reduce-scatter,
all-reduce, broadcast and reduce, and the four for values that every rank holds alike
(copy to and reduce from a group, scatter to and gather from it).

Each public function wraps an ``autograd.Function`` whose backward calls its dual's
``apply``, so gradients of gradients work too; the table of pairs and shapes is
:mod:`parallelkit.functional`'s. On a size-1 communicator each is the identity, with no
autograd wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

from parallelkit.comm import Communicator
from parallelkit.geometry import tensor_split_sizes


def all_gather(
    x: torch.Tensor, comm: Communicator, dim: int = 0, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward reduce-scatters the gradient."""
    if comm.size == 1:
        return x
    if sizes is None:
        sizes = [n for (n,) in comm.all_gather_ints([x.shape[dim]])]
    return _AllGather.apply(x, comm, dim, tuple(sizes))


def reduce_scatter(
    x: torch.Tensor, comm: Communicator, dim: int = 0, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Sum over ranks and keep this rank's block along ``dim``; backward all-gathers."""
    if comm.size == 1:
        return x
    if sizes is None:
        sizes = tensor_split_sizes(x.shape[dim], comm.size)
    return _ReduceScatter.apply(x, comm, dim, tuple(sizes))


def all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum over ranks; the backward sums the gradients over ranks too (self-adjoint)."""
    if comm.size == 1:
        return x
    return _AllReduce.apply(x, comm)


def broadcast(x: torch.Tensor, comm: Communicator, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` everywhere; backward sums the gradients onto ``src``."""
    if comm.size == 1:
        return x
    return _Broadcast.apply(x, comm, src)


def reduce(x: torch.Tensor, comm: Communicator, dst: int = 0) -> torch.Tensor:
    """Sum onto ``dst`` (zeros elsewhere); backward broadcasts the gradient from ``dst``."""
    if comm.size == 1:
        return x
    return _Reduce.apply(x, comm, dst)


def copy_to_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity on a replicated ``x``; backward sums the per-rank gradients (all-reduce)."""
    if comm.size == 1:
        return x
    return _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-reduce (sum) whose result feeds one replicated loss; backward is the identity."""
    if comm.size == 1:
        return x
    return _ReduceFromGroup.apply(x, comm)


def scatter_to_group(
    x: torch.Tensor, comm: Communicator, dim: int = 0, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's block along ``dim`` of a replicated ``x``; backward all-gathers the blocks'
    gradients, so every rank gets the whole gradient of the replicated input."""
    if comm.size == 1:
        return x
    dim = dim % x.dim()
    sizes = (
        tuple(sizes) if sizes is not None else tuple(tensor_split_sizes(x.shape[dim], comm.size))
    )
    _check_total(sizes, x.shape[dim], "scatter_to_group", dim)
    return _ScatterToGroup.apply(x, comm, dim, sizes)


def gather_from_group(
    x: torch.Tensor, comm: Communicator, dim: int = 0, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's block along ``dim`` for a consumer that every rank runs
    identically (one replicated loss): backward keeps this rank's block of the gradient."""
    if comm.size == 1:
        return x
    dim = dim % x.dim()
    if sizes is None:
        sizes = [n for (n,) in comm.all_gather_ints([x.shape[dim]])]
    return _GatherFromGroup.apply(x, comm, dim, tuple(sizes))


# --------------------------------------------------------------------------- autograd pairs
class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.all_gather(x, dim, sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _ReduceScatter.apply(grad, ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.reduce_scatter(x, dim, "sum", sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _AllGather.apply(grad, ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, comm):  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _AllReduce.apply(grad, ctx.comm), None


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, x, comm, src):  # type: ignore[override]
        ctx.comm, ctx.src = comm, src
        return comm.broadcast(x, src)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _Reduce.apply(grad, ctx.comm, ctx.src), None, None


class _Reduce(Function):
    @staticmethod
    def forward(ctx, x, comm, dst):  # type: ignore[override]
        ctx.comm, ctx.dst = comm, dst
        return comm.reduce(x, dst, "sum")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _Broadcast.apply(grad, ctx.comm, ctx.dst), None, None


class _CopyToGroup(Function):
    @staticmethod
    def forward(ctx, x, comm):  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _ReduceFromGroup.apply(grad, ctx.comm), None


class _ReduceFromGroup(Function):
    @staticmethod
    def forward(ctx, x, comm):  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _CopyToGroup.apply(grad, ctx.comm), None


class _ScatterToGroup(Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return x.narrow(dim, sum(sizes[: comm.rank]), sizes[comm.rank]).clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _GatherFromGroup.apply(grad, ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _GatherFromGroup(Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.all_gather(x, dim, sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _ScatterToGroup.apply(grad, ctx.comm, ctx.dim, ctx.sizes), None, None, None


def _check_total(sizes: Sequence[int], total: int, name: str, dim: int) -> None:
    if sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"{name}: sizes {list(sizes)} do not split {total} rows along dim {dim}")
