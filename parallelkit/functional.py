"""Differentiable collectives: autograd pairs written once against any communicator.

Each public function wraps an ``autograd.Function`` whose backward calls its dual's ``apply``,
so gradients of gradients work too. Read each pair as a linear operator F and its adjoint F*
(⟨F x, y⟩ = ⟨x, F* y⟩, the sums running over every rank's local tensors):

    forward                          backward (adjoint)
    all_gather          (concat)     reduce_scatter (sum of each rank's block)
    reduce_scatter      (sum)        all_gather
    all_reduce          (sum)        all_reduce (sum)
    broadcast           (from src)   reduce (sum onto src, zeros elsewhere)
    reduce              (onto dst)   broadcast (from dst)
    copy_to_group       (identity)   all_reduce (sum)   -- input replicated, outputs per rank
    reduce_from_group   (all_reduce) identity           -- output replicated, one loss
    scatter_to_group    (own block)  all_gather         -- input replicated, outputs per rank
    gather_from_group   (all_gather) own block          -- output replicated, one loss
    halo_exchange       (fill ghosts) halo_accumulate (send ghost gradients back, add them)
    gather_rows         (any rows)   scatter_add_rows (send row gradients back, add them)

``copy_to_group`` / ``reduce_from_group`` and ``scatter_to_group`` / ``gather_from_group`` are
for values that every rank holds identically (a replicated input whose per-rank uses must be
summed; a result that every rank then uses identically to compute one replicated loss, so each
rank already holds the whole gradient and keeps only its own block of it). On a size-1
communicator every function is the identity (or, for the halo, plain padding) with no autograd
wrapper.

Shapes (``n_r`` = rank r's size along ``dim``):

    all_gather      x: (.., n_r, ..)            -> (.., sum_r n_r, ..)
    reduce_scatter  x: (.., sum_r n_r, ..)      -> (.., n_rank, ..)
    halo_exchange   x: (.., n, ..)              -> (.., lo + n + hi, ..)
    gather_rows     x: (.., n_rank, ..)         -> (.., stop_rank - start_rank, ..)
"""

from __future__ import annotations

import itertools
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


def gather_rows(
    x: torch.Tensor,
    comm: Communicator,
    dim: int,
    sizes: Sequence[int],
    want: Sequence[tuple[int, int]],
    fill: float = 0.0,
) -> torch.Tensor:
    """Rows ``want[rank]`` of a tensor split over ``comm`` along ``dim``, whoever holds them.

    Rank r holds the global rows ``[sum(sizes[:r]), sum(sizes[:r+1]))``; ``want[r] = (start,
    stop)`` is the range of global rows rank r needs, which may reach past either end of the
    tensor (those rows are ``fill``: zero padding, or -inf for max pooling). Every rank passes
    the same ``sizes`` and ``want``, which pure geometry computes, so no sizes are exchanged.
    Only ranks that hold wanted rows send, to the ranks that want them: the neighbours for a
    halo, further ranks when blocks are thinner than the halo. The backward sends each row's
    gradient back to its owner, which adds it in.
    """
    dim = dim % x.dim()
    if len(sizes) != comm.size or len(want) != comm.size:
        raise ValueError(
            f"gather_rows: need sizes and want for each of {comm.size} ranks, got "
            f"{len(sizes)} and {len(want)}"
        )
    if x.shape[dim] != sizes[comm.rank]:
        raise ValueError(
            f"gather_rows: rank {comm.rank} holds {x.shape[dim]} rows along dim {dim}, "
            f"sizes says {sizes[comm.rank]}"
        )
    if [tuple(w) for w in want] == _blocks(sizes):  # every rank wants its own rows: no copy
        return x
    return _GatherRows.apply(x, comm, dim, tuple(sizes), tuple(map(tuple, want)), fill)


def halo_exchange(
    x: torch.Tensor,
    comm: Communicator,
    dim: int,
    lo: int,
    hi: int,
    periodic: bool = False,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pad ``x`` along ``dim`` with ``lo`` rows from the previous rank and ``hi`` from the next.

    The ranks of ``comm`` form a chain, each holding one consecutive block of a tensor along
    ``dim``. Rank r's result is ``cat(last lo rows of rank r-1, x, first hi rows of rank r+1)``;
    at the ends of a non-periodic chain the missing rows are zeros (zero padding), a periodic
    chain wraps around. The backward sends the ghost rows' gradients back to their owners, who
    add them to the rows they sent. Every block needs at least ``max(lo, hi)`` rows; with
    ``sizes`` (every rank's block size) that is checked on every rank before communicating.
    """
    dim = dim % x.dim()
    if lo < 0 or hi < 0:
        raise ValueError(f"halo_exchange: halo widths must be >= 0, got lo={lo}, hi={hi}")
    need = max(lo, hi)
    too_thin = (
        [r for r, n in enumerate(sizes) if n < need]
        if sizes is not None
        else ([comm.rank] if x.shape[dim] < need else [])
    )
    if too_thin:
        raise ValueError(
            f"halo_exchange: blocks of ranks {too_thin} along dim {dim} are thinner than the halo "
            f"(lo={lo}, hi={hi}); each rank needs at least {need} rows: use fewer ranks along "
            f"this dim or a larger tensor (block sizes: {list(sizes) if sizes else x.shape[dim]})"
        )
    if comm.size == 1:
        n = x.shape[dim]
        if periodic:
            return torch.cat([x.narrow(dim, n - lo, lo), x, x.narrow(dim, 0, hi)], dim)
        return torch.cat([_slab(x, dim, lo), x, _slab(x, dim, hi)], dim)
    return _HaloExchange.apply(x, comm, dim, lo, hi, periodic)


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


# --------------------------------------------------------------------------- any rows
def _blocks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Every rank's global rows ``(start, stop)``."""
    stops = list(itertools.accumulate(sizes))
    return [(stop - n, stop) for n, stop in zip(sizes, stops, strict=True)]


def _row_plan(rank: int, sizes, want):
    """Per peer q: (rows of mine that q wants, rows of q's that I want), as global ranges."""
    starts = [sum(sizes[:q]) for q in range(len(sizes))]
    mine = (starts[rank], starts[rank] + sizes[rank])
    plan = []
    for q in range(len(sizes)):
        theirs = (starts[q], starts[q] + sizes[q])
        give = (max(mine[0], want[q][0]), min(mine[1], want[q][1]))
        take = (max(theirs[0], want[rank][0]), min(theirs[1], want[rank][1]))
        plan.append((give, take))
    return starts[rank], plan


def _swap_rows(
    t: torch.Tensor,
    t_first: int,
    comm: Communicator,
    dim: int,
    outgoing: Sequence[tuple[int, tuple[int, int]]],
    incoming: Sequence[tuple[int, tuple[int, int]]],
) -> list[tuple[int, torch.Tensor]]:
    """Send each peer its global rows ``outgoing`` (cut from ``t``, whose first row is global
    row ``t_first``) and receive ``incoming`` ones: ``(first global row, rows)`` per receive.

    Empty ranges and this rank itself are skipped; every rank calls the exchange, even with
    nothing to move (debug mode checks it).
    """
    send = [
        (q, t.narrow(dim, a - t_first, b - a)) for q, (a, b) in outgoing if q != comm.rank and b > a
    ]
    recv, firsts = [], []
    for q, (a, b) in incoming:
        if q != comm.rank and b > a:
            shape = list(t.shape)
            shape[dim] = b - a
            recv.append((q, t.new_empty(shape)))
            firsts.append(a)
    return list(zip(firsts, comm.neighbor_exchange(send, recv), strict=True))


class _GatherRows(Function):
    """Forward: assemble the wanted rows. Backward: :class:`_ScatterAddRows`.

    Each row of the result is written once: this rank's own rows by a local copy, padding
    rows by a fill, rows of other ranks from their messages (blocks are large, so a second
    pass over them would cost as much as the exchange).
    """

    @staticmethod
    def forward(ctx, x, comm, dim, sizes, want, fill):  # type: ignore[override]
        ctx.args = comm, dim, sizes, want, fill
        start, plan = _row_plan(comm.rank, sizes, want)
        lo, hi = want[comm.rank]
        total = sum(sizes)
        shape = list(x.shape)
        shape[dim] = hi - lo
        out = x.new_empty(shape)
        if lo < 0:
            out.narrow(dim, 0, min(-lo, hi - lo)).fill_(fill)
        if hi > total:
            first = max(total, lo)
            out.narrow(dim, first - lo, hi - first).fill_(fill)
        own = plan[comm.rank][1]
        if own[1] > own[0]:
            rows = x.narrow(dim, own[0] - start, own[1] - own[0])
            out.narrow(dim, own[0] - lo, own[1] - own[0]).copy_(rows)
        outgoing = [(q, give) for q, (give, _) in enumerate(plan)]
        incoming = [(q, take) for q, (_, take) in enumerate(plan)]
        for first, buf in _swap_rows(x, start, comm, dim, outgoing, incoming):
            out.narrow(dim, first - lo, buf.shape[dim]).copy_(buf)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        comm, dim, sizes, want, _ = ctx.args
        return _ScatterAddRows.apply(grad, comm, dim, sizes, want), None, None, None, None, None


class _ScatterAddRows(Function):
    """Adjoint of :class:`_GatherRows`: each wanted row's value goes back to its owner and is
    added to that row; rows past the ends of the tensor were padding and are dropped."""

    @staticmethod
    def forward(ctx, g, comm, dim, sizes, want):  # type: ignore[override]
        ctx.args = comm, dim, sizes, want
        start, plan = _row_plan(comm.rank, sizes, want)
        lo = want[comm.rank][0]
        n = sizes[comm.rank]
        own = plan[comm.rank][1]
        if own == (start, start + n):  # this rank wanted all its rows: start from them
            out = g.narrow(dim, start - lo, n).clone(memory_format=torch.contiguous_format)
        else:
            shape = list(g.shape)
            shape[dim] = n
            out = g.new_zeros(shape)
            if own[1] > own[0]:
                out.narrow(dim, own[0] - start, own[1] - own[0]).copy_(
                    g.narrow(dim, own[0] - lo, own[1] - own[0])
                )
        # The mirror image of the forward: what this rank took goes back, what it gave returns.
        outgoing = [(q, take) for q, (_, take) in enumerate(plan)]
        incoming = [(q, give) for q, (give, _) in enumerate(plan)]
        for first, buf in _swap_rows(g, lo, comm, dim, outgoing, incoming):
            out.narrow(dim, first - start, buf.shape[dim]).add_(buf)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        comm, dim, sizes, want = ctx.args
        return _GatherRows.apply(grad, comm, dim, sizes, want, 0.0), None, None, None, None


# --------------------------------------------------------------------------- halo exchange
def _neighbours(comm: Communicator, periodic: bool) -> tuple[int | None, int | None]:
    """(previous, next) rank in the chain, None past the ends of a non-periodic chain."""
    r, n = comm.rank, comm.size
    if periodic:
        return (r - 1) % n, (r + 1) % n
    return (r - 1 if r > 0 else None), (r + 1 if r < n - 1 else None)


def _slab(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = rows
    return x.new_zeros(shape)


class _HaloExchange(Function):
    """Forward: fill ghost rows from the neighbours. Backward: :class:`_HaloAccumulate`.

    Messages are listed so that the k-th message from rank a to rank b is the k-th receive of b
    from a even when prev == next (periodic chains of two ranks): sends go "down, then up",
    receives are "from next, then from prev".
    """

    @staticmethod
    def forward(ctx, x, comm, dim, lo, hi, periodic):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.lo, ctx.hi, ctx.periodic = comm, dim, lo, hi, periodic
        prev, nxt = _neighbours(comm, periodic)
        n = x.shape[dim]
        ghost_lo, ghost_hi = _slab(x, dim, lo), _slab(x, dim, hi)
        send, recv = [], []
        if prev is not None and hi:
            send.append((prev, x.narrow(dim, 0, hi)))
        if nxt is not None and lo:
            send.append((nxt, x.narrow(dim, n - lo, lo)))
        if nxt is not None and hi:
            recv.append((nxt, ghost_hi))
        if prev is not None and lo:
            recv.append((prev, ghost_lo))
        comm.neighbor_exchange(send, recv)
        return torch.cat([ghost_lo, x, ghost_hi], dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dx = _HaloAccumulate.apply(grad, ctx.comm, ctx.dim, ctx.lo, ctx.hi, ctx.periodic)
        return dx, None, None, None, None, None


class _HaloAccumulate(Function):
    """Adjoint of the halo exchange: ghost rows go back to their owners and are added in.

    Input (.., lo + n + hi, ..) -> output (.., n, ..). Ghost rows at the ends of a non-periodic
    chain were zeros, not data, so their gradient is dropped.
    """

    @staticmethod
    def forward(ctx, g, comm, dim, lo, hi, periodic):  # type: ignore[override]
        ctx.comm, ctx.dim, ctx.lo, ctx.hi, ctx.periodic = comm, dim, lo, hi, periodic
        prev, nxt = _neighbours(comm, periodic)
        n = g.shape[dim] - lo - hi
        out = g.narrow(dim, lo, n).clone()
        first, last = _slab(g, dim, hi), _slab(g, dim, lo)
        send, recv = [], []
        if nxt is not None and hi:
            send.append((nxt, g.narrow(dim, lo + n, hi)))
        if prev is not None and lo:
            send.append((prev, g.narrow(dim, 0, lo)))
        if prev is not None and hi:
            recv.append((prev, first))
        if nxt is not None and lo:
            recv.append((nxt, last))
        comm.neighbor_exchange(send, recv)
        if prev is not None and hi:
            out.narrow(dim, 0, hi).add_(first)
        if nxt is not None and lo:
            out.narrow(dim, n - lo, lo).add_(last)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dg = _HaloExchange.apply(grad, ctx.comm, ctx.dim, ctx.lo, ctx.hi, ctx.periodic)
        return dg, None, None, None, None, None
