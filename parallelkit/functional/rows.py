"""Rows of a tensor split along one dimension over the ranks, fetched from whoever holds them
(:func:`gather_rows`), and its adjoint, which sends each row's gradient back to its owner and
adds it in.

The spatial kernels and rules fetch with it what a block's windows read, a pad's or a flip's
rows, a resampling's reach: any range of rows, past either end of the tensor too (those are
a fill). Pure geometry says which rows each rank wants, so no sizes are exchanged first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.autograd import Function

from parallelkit.comm import Communicator


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


# --------------------------------------------------------------------------- the autograd pair
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
