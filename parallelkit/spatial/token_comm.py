"""Moving the tokens of split samples: which tokens each rank holds, and the collectives that
bring keys and values to every rank's queries.

A *token dimension* holds every spatial dimension of a block at once: a flattened H x W (or
D x H x W), ``x.flatten(2)`` of an (N, C, H, W) block, a signal's L, or the grid of a grid
partition (MaxViT). It is the record's fold (:data:`parallelkit.spatial.rules.registry.Fold`):
its factors, outermost first, each a whole size and the spatial dimension it is (or None for
another, whole on every rank). Rank r holds a box of that index space, its rows of each
spatial factor, in row-major order; :func:`token_orders` lists the whole token indices of each
rank's box. Pure geometry, no communication.

The collectives, read as linear operators with their adjoints (the sums run over every rank):

    forward                                   backward (adjoint)
    gather_tokens  every rank's tokens,       reduce-scatter (sum) of the gradient back to
                   put in the whole order     each rank's tokens; or, for a whole consumer
                                              under the "full" convention, own tokens only
    heads_to_tokens (tokens split, heads whole) -> (heads split, tokens whole): all-to-all
    tokens_to_heads the reverse all-to-all,   each the other's adjoint

Shapes (``L`` the whole token count, ``L_r`` rank r's, ``h`` heads, ``h_r`` rank r's share):

    gather_tokens    x: (.., L_rank, ..)          -> (.., L, ..)   (whole order)
    heads_to_tokens  x: (.., h, L_rank, d)        -> (.., h_rank, L, d)
    tokens_to_heads  x: (.., h_rank, L, d)        -> (.., h, L_rank, d)

``heads_to_tokens`` is the head all-to-all of DeepSpeed-Ulysses: after it each rank holds every
token of its share of the heads, so attention runs locally with 1/P of the keys and values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd import Function

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.geometry import BlockLayout, blocks, tensor_split_sizes
from parallelkit.spatial.grid import SpatialGrid

Factors = tuple[tuple[int, int | str | None], ...]
"""A token dimension's factors, outermost first: (whole size, the spatial dimension it is,
or None for another), after an optional prefix factor ``(p, PREFIX)``: ``p`` whole tokens
(a class token) before the product of the others, held by the group's first rank."""
PREFIX = "prefix"


def prefix_of(fold: Factors) -> int:
    """How many whole tokens come before ``fold``'s product (a class token): 0 for none."""
    return fold[0][0] if fold and fold[0][1] == PREFIX else 0


def prefixed(folds: tuple[Factors, ...]) -> bool:
    """Whether one of ``folds`` has a prefix."""
    return any(f and f[0][1] == PREFIX for f in folds)


def box(fold: Factors) -> Factors:
    """``fold``'s factors after its prefix."""
    return fold[1:] if prefix_of(fold) else fold


def with_prefix(fold: Factors, p: int) -> Factors:
    """``fold``'s factors after ``p`` whole tokens (none: its factors after its prefix)."""
    return ((p, PREFIX), *box(fold)) if p else box(fold)


def fold_count(fold: Factors) -> int:
    """The whole size of a folded dimension: its prefix and the product of its factors."""
    return prefix_of(fold) + math.prod(n for n, _ in box(fold))


def box_index(fold: Factors, rows: list[tuple[int, int]], first: bool) -> torch.Tensor:
    """The whole fold's indices of a rank's part of it, in its order: the box of ``rows``
    (a (start, stop) per factor after the prefix), behind the prefix on the group's
    ``first`` rank (which holds it)."""
    flat = torch.zeros((), dtype=torch.long)
    for (n, _), (start, stop) in zip(box(fold), rows, strict=True):
        flat = (flat * n).unsqueeze(-1) + torch.arange(start, stop)
    p = prefix_of(fold)
    flat = flat.reshape(-1) + p
    return torch.cat((torch.arange(p), flat)) if p and first else flat


def rank_layout(grid: SpatialGrid, rank: int, ndim: int) -> BlockLayout:
    """The block layout of ``rank`` (of ``grid.comm``) for samples of ``ndim`` spatial
    dimensions: rank ``(z * rows + i) * cols + j`` holds blocks (z, i, j)."""
    rest, col = divmod(rank, grid.cols)
    layer, row = divmod(rest, grid.rows)
    return BlockLayout.of_grid(grid.shape, (layer, row, col), ndim, grid.first)


def token_orders(grid: SpatialGrid, factors: Factors, ndim: int) -> list[torch.Tensor]:
    """The whole token indices each rank of ``grid.comm`` holds, in its block's order, for a
    token dimension of ``factors`` (samples of ``ndim`` spatial dimensions); a prefix (a
    class token) is rank 0's, before its box."""
    orders = []
    for r in range(grid.comm.size):
        layout = rank_layout(grid, r, ndim)
        rows = [blocks(n, layout.counts[k])[layout.coords[k]] if k is not None else (0, n)
                for n, k in box(factors)]  # fmt: skip
        orders.append(box_index(factors, rows, first=r == 0))
    return orders


def whole_order(orders: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Where each whole token lies in the concatenation of ``orders`` (rank order), or None
    where the concatenation is the whole order already (blocks of the outermost factor)."""
    flat = torch.cat(list(orders))
    if torch.equal(flat, torch.arange(flat.numel())):
        return None
    return torch.argsort(flat)


def gather_tokens(
    x: torch.Tensor,
    comm: Communicator,
    dim: int,
    sizes: Sequence[int],
    where: torch.Tensor | None,
    whole_grad: bool = False,
) -> torch.Tensor:
    """Every rank's tokens of ``x`` along ``dim`` (``sizes`` tokens each), in the whole order
    (``where``: :func:`whole_order`'s). ``whole_grad``: the result feeds a whole tensor whose
    gradient every rank holds in full (the "full" convention), so backward keeps this rank's
    part of it; otherwise backward sums each rank's partial gradient (reduce-scatter)."""
    dim = dim % x.dim()
    if whole_grad:
        y = pkf.gather_from_group(x, comm, dim, tuple(sizes))
    else:
        y = pkf.all_gather(x, comm, dim, tuple(sizes))
    return y if where is None else y.index_select(dim, where.to(y.device))


# --------------------------------------------------------------------------- the head all-to-all
def heads_to_tokens(x: torch.Tensor, comm: Communicator, sizes: Sequence[int]) -> torch.Tensor:
    """(.., h, L_rank, d) -> (.., h_rank, L, d): this rank's share of the heads (tensor_split
    layout) with every rank's tokens, concatenated in rank order (``sizes``: each rank's
    token count)."""
    if comm.size == 1:
        return x
    return _HeadsToTokens.apply(x, comm, tuple(sizes), x.shape[-3])


def tokens_to_heads(
    x: torch.Tensor, comm: Communicator, sizes: Sequence[int], heads: int
) -> torch.Tensor:
    """The reverse of :func:`heads_to_tokens`: (.., h_rank, L, d) -> (.., h, L_rank, d), for
    ``heads`` heads in all."""
    if comm.size == 1:
        return x
    return _TokensToHeads.apply(x, comm, tuple(sizes), heads)


def _all_to_all(
    x: torch.Tensor, comm: Communicator, send_dim: int, recv_dim: int,
    send_sizes: Sequence[int], recv_sizes: Sequence[int],
) -> torch.Tensor:  # fmt: skip
    """Rank r gets part r of ``x`` along ``send_dim`` (``send_sizes``); what each rank
    receives (``recv_sizes[r]`` from rank r along ``recv_dim``) is concatenated in rank
    order."""
    parts = x.split(list(send_sizes), send_dim)
    shape = list(parts[comm.rank].shape)
    recv = []
    for r, n in enumerate(recv_sizes):
        shape[recv_dim] = n
        recv.append((r, x.new_empty(shape)))
    send = [(r, p.contiguous()) for r, p in enumerate(parts)]
    return torch.cat(comm.neighbor_exchange(send, recv), recv_dim)


class _HeadsToTokens(Function):
    @staticmethod
    def forward(ctx, x, comm, sizes, heads):  # type: ignore[override]
        ctx.comm, ctx.sizes, ctx.heads = comm, sizes, heads
        shares = tensor_split_sizes(heads, comm.size)
        return _all_to_all(x, comm, x.dim() - 3, x.dim() - 2, shares, sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _TokensToHeads.apply(grad, ctx.comm, ctx.sizes, ctx.heads), None, None, None


class _TokensToHeads(Function):
    @staticmethod
    def forward(ctx, x, comm, sizes, heads):  # type: ignore[override]
        ctx.comm, ctx.sizes, ctx.heads = comm, sizes, heads
        shares = tensor_split_sizes(heads, comm.size)
        return _all_to_all(x, comm, x.dim() - 2, x.dim() - 3, sizes, shares)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _HeadsToTokens.apply(grad, ctx.comm, ctx.sizes, ctx.heads), None, None, None
