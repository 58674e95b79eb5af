"""Moving a block of split samples from one layout to another: an exact all-to-all.

Two blocks of the same whole tensor can hold different elements on each rank: ``x`` of an
(N, C, H, W) map holds this rank's rows of H, while a reshape that reads the map's memory in
another order (smp's MAnet turns attention's (N, H * W, C) into (N, C, H, W) by ``reshape``,
not by a transpose) leaves spatial dimensions in other places or folded with channels. Where
such blocks meet (``x + y``), each element of one must go to the rank that holds it in the
other's layout.

A layout is given by its *factors* (:data:`parallelkit.spatial.token_comm.Factors`): the
whole tensor's dimensions after the batch, as (whole size, spatial dimension or None),
outermost first. Rank r's block is the box of its rows of each spatial factor, all of each
other, in row-major order (:func:`parallelkit.spatial.token_comm.token_orders`), so every rank
knows which whole elements every rank holds, and the plan of one all-to-all follows without a
message. The move is a permutation of the whole tensor's elements: its adjoint (backward) is
the same exchange the other way.

Cost: the plan is made once per pair of layouts (the caller caches it), with a transient
index table of the whole sample's element count (int64) on every rank; the exchange moves
every element that changes rank, each rank sending and receiving about 1/P of a sample per
peer in one ``neighbor_exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Function

from parallelkit.comm import Communicator
from parallelkit.spatial.grid import SpatialGrid
from parallelkit.spatial.token_comm import Factors, token_orders


@dataclass(frozen=True)
class Plan:
    """This rank's part of one all-to-all between two layouts of the same elements.

    ``send[r]``: the positions in this rank's source block (flattened after the batch) of the
    elements rank r holds in the target layout, in r's order; ``recv[r]``: where the elements
    from rank r go in this rank's target block; ``size``: that block's element count."""

    send: tuple[torch.Tensor, ...]
    recv: tuple[torch.Tensor, ...]
    size: int

    def to(self, device: torch.device) -> Plan:
        return Plan(tuple(t.to(device) for t in self.send),
                    tuple(t.to(device) for t in self.recv), self.size)  # fmt: skip


def plan(grid: SpatialGrid, source: Factors, target: Factors, ndim: int) -> Plan:
    """The all-to-all that takes blocks of layout ``source`` to blocks of layout ``target``
    (both over the same whole elements, in samples of ``ndim`` spatial dimensions)."""
    before, after = token_orders(grid, source, ndim), token_orders(grid, target, ndim)
    total = sum(len(o) for o in before)
    if total != sum(len(o) for o in after):
        raise ValueError(f"relayout: {source} and {target} hold different element counts")
    owner = torch.empty(total, dtype=torch.long)
    offset = torch.empty(total, dtype=torch.long)
    for r, order in enumerate(before):
        owner[order] = r
        offset[order] = torch.arange(len(order))
    me = grid.comm.rank
    send = tuple(offset[order[owner[order] == me]] for order in after)
    mine = owner[after[me]]
    recv = tuple(torch.nonzero(mine == r).reshape(-1) for r in range(len(before)))
    return Plan(send, recv, len(after[me]))


def relayout(x: torch.Tensor, comm: Communicator, p: Plan) -> torch.Tensor:
    """``x`` (N, ...) moved by plan ``p``: (N, p.size), the target block flattened after the
    batch (the caller views it to the target's shape)."""
    return _Relayout.apply(x.reshape(x.shape[0], -1), comm, p)


def _move(x: torch.Tensor, comm: Communicator, send: tuple, recv: tuple, size: int
          ) -> torch.Tensor:  # fmt: skip
    """Columns ``send[r]`` of (N, M) ``x`` to rank r; what rank r sends lands in columns
    ``recv[r]`` of the (N, size) result."""
    n = x.shape[0]
    out = x.new_empty(n, size)
    messages = [(r, x.index_select(1, idx)) for r, idx in enumerate(send) if len(idx)]
    buffers = [(r, x.new_empty(n, len(idx))) for r, idx in enumerate(recv) if len(idx)]
    got = comm.neighbor_exchange(messages, buffers)
    for (r, _), values in zip(buffers, got, strict=True):
        out.index_copy_(1, recv[r], values)
    return out


class _Relayout(Function):
    """A permutation of the whole tensor's elements across ranks; backward is the inverse
    permutation, the same exchange with send and receive swapped."""

    @staticmethod
    def forward(ctx, x, comm, p):  # type: ignore[override]
        ctx.comm, ctx.p, ctx.size = comm, p, x.shape[1]
        return _move(x, comm, p.send, p.recv, p.size)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        p = ctx.p
        return _move(grad.contiguous(), ctx.comm, p.recv, p.send, ctx.size), None, None
