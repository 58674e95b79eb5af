"""Halo exchange along a chain of ranks (:func:`halo_exchange`): each rank's block padded
with the edge rows of its neighbours' blocks, and its adjoint, which sends the ghost rows'
gradients back to their owners and adds them in. The ends of a non-periodic chain are zero
padding; a periodic chain wraps around.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

from parallelkit.comm import Communicator


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


# --------------------------------------------------------------------------- the autograd pair
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
