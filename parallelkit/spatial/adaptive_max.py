"""Adaptive maximum pooling to any size on blocks, exactly, with nothing gathered.

torch's adaptive pooling of a dimension of ``n`` rows to ``o`` outputs gives output ``i`` the
rows ``[floor(i n / o), ceil((i + 1) n / o))`` (bins overlap where ``o`` does not divide ``n``).
Its kernels (CPU and CUDA, 1-D, 2-D and 3-D) scan a bin's window row-major (depth, rows, cols)
and keep a value where ``val > best || isnan(val)``: the *first* maximum, or, where the window
holds a NaN, the *last* NaN. The gradient goes to that one place, and ``return_indices``
names it as a flat index into the whole sample's plane.

Row-major scan order over a window is the order of the flat index into the whole plane, so
the place torch keeps is the best of its window under one total order on (value, flat index):
a NaN above everything, NaNs by larger index; otherwise the larger value, then the smaller
index (:func:`best`). The best of a set under a total order can be taken in parts, so:

1. Each rank takes, for every bin that meets its block, the best of its own rows of the bin,
   one dimension after another (the bin's rows of the block, padded to the longest bin with a
   place that loses to everything). A bin with no row here gets that losing place.
2. Two all-reduces (max) of the bins' size name each bin's winning place: whether any rank
   holds a NaN there and the largest value, then the largest key among the ranks that can
   win (the flat index where a NaN wins, minus it where the first maximum does).
3. The output is the sum over the group of each rank's winning values, the others -0.0 (so
   the sum is each winner's value exactly, -0.0 and NaN included): one all-reduce
   (``record.summed``), whose backward brings each bin's dense gradient to every rank; the
   winner's ``gather`` from its block routes it to the one place torch routes it to.

The result is whole (the same on every rank), as the gathered path made it. Nothing the size
of a whole sample is made: the largest new tensors are the block's rows of each bin (about
the block; up to twice it where bins overlap, more only where the output is larger than the
input) and the (N, C, *o) per-bin results, whatever the number of ranks.

Legend: ``n`` rows of one dimension of the whole sample, ``o`` its outputs, ``m`` the block's
rows, ``a`` the block's first row; ``q`` a flat index into the block, ``p`` one into the whole
plane; ``K`` the longest bin's rows here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.grid import SpatialGrid

LOSES = torch.iinfo(torch.int64).max  # the flat index of a place that holds nothing
NOBODY = -(2**62)  # the key of a rank whose candidate cannot win a bin


def bins(n: int, o: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling windows along one dimension: ``(first, stop)`` per output."""
    return [((i * n) // o, -(-((i + 1) * n) // o)) for i in range(o)]


def best(v: torch.Tensor, q: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along ``dim``: the value that torch's kernel keeps and its flat index. ``q`` holds
    distinct flat indices, in scan order, of the values ``v`` (``LOSES`` where nothing is:
    its value must be -inf)."""
    nan = v.isnan()
    clean = v.masked_fill(nan, -math.inf)
    top = clean.amax(dim, keepdim=True)
    first = torch.where((clean == top) & ~nan, q, LOSES).amin(dim, keepdim=True)
    last_nan = torch.where(nan, q, -1).amax(dim, keepdim=True)
    kept = torch.where(nan.any(dim, keepdim=True), last_nan, first)
    at = (q == kept).to(torch.uint8).argmax(dim, keepdim=True)
    return v.gather(dim, at).squeeze(dim), kept.squeeze(dim)


def _slots(n: int, o: int, a: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, K) rows of the block (0..m-1) that each bin reads here, and which are real."""
    here = [(max(lo, a) - a, min(hi, a + m) - a) for lo, hi in bins(n, o)]
    k = max([hi - lo for lo, hi in here] + [1])
    rows = torch.tensor([[lo + j for j in range(k)] for lo, _ in here], dtype=torch.int64)
    real = torch.tensor([[lo + j < hi for j in range(k)] for lo, hi in here])
    return rows.clamp(0, max(m - 1, 0)).view(o, k), real.view(o, k)


def local_best(
    x_blk: torch.Tensor, size: Sequence[int], first: Sequence[int], outs: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bin, the best of this block's rows of it: (values (N, C, *o), their flat indices
    into the block, ``LOSES`` where the block holds no row of the bin). No gradient."""
    lead, m = x_blk.shape[:2], x_blk.shape[2:]
    if x_blk.numel() == 0:
        return (x_blk.new_full((*lead, *outs), -math.inf),
                torch.full((*lead, *outs), LOSES, device=x_blk.device))  # fmt: skip
    v = x_blk.detach()
    q = torch.arange(v[0, 0].numel(), device=v.device).view(1, 1, *m).expand_as(v)
    for d, (n, o, a) in enumerate(zip(size, outs, first, strict=True)):
        rows, real = _slots(n, o, a, m[d])
        at = [1] * (2 + d) + [o, rows.shape[1]] + [1] * (len(m) - 1 - d)
        real = real.to(v.device).view(at)
        v = v.index_select(2 + d, rows.flatten().to(v.device)).unflatten(2 + d, rows.shape)
        q = q.index_select(2 + d, rows.flatten().to(v.device)).unflatten(2 + d, rows.shape)
        v, q = best(v.masked_fill(~real, -math.inf), q.masked_fill(~real, LOSES), 3 + d)
    return v, q


def whole_index(
    q: torch.Tensor, m: Sequence[int], size: Sequence[int], first: Sequence[int]
) -> torch.Tensor:
    """Flat indices into the block (``LOSES``: none) turned into flat indices into the whole
    plane (one past its end: none)."""
    plane = math.prod(size)
    if math.prod(m) == 0:
        return torch.full_like(q, plane)
    p, rest = torch.zeros_like(q), q.clamp(max=math.prod(m) - 1)
    for d in reversed(range(len(m))):
        rest, row = rest.div(m[d], rounding_mode="floor"), rest.remainder(m[d])
        p += (row + first[d]) * math.prod(size[d + 1 :])
    return torch.where(q == LOSES, plane, p)


def adaptive_max_pool(
    x_blk: torch.Tensor,
    comm: Communicator,
    grid: SpatialGrid,
    size: Sequence[int],
    outs: Sequence[int],
    return_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.adaptive_max_pool{1,2,3}d`` of the whole samples of spatial ``size`` to ``outs``,
    from this rank's block ``x_blk`` of them (``grid``'s tensor_split layout over ``comm``,
    the spatial group): whole on every rank, with torch's gradient and, if asked, indices."""
    m = x_blk.shape[2:]
    first = [s.start for s in grid.block(*size)]
    with torch.no_grad():
        v, q = local_best(x_blk, size, first, outs)
        mine, p_win = winners(v, whole_index(q, m, size, first), q != LOSES, comm)
    flat = x_blk.flatten(2)
    if x_blk.numel():
        got = flat.gather(2, q.clamp(max=flat.shape[2] - 1).flatten(2)).view(q.shape)
    else:  # no place here, but in the graph: the backward's all-reduce meets on every rank
        got = flat.sum(2).view(*q.shape[:2], *[1] * len(m)).expand(q.shape)
    y = record.summed(torch.where(mine, got, -0.0), comm)
    return (y, p_win) if return_indices else y


def winners(
    v: torch.Tensor, p: torch.Tensor, here: torch.Tensor, comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of this rank's per-bin candidates (values ``v``, flat indices ``p`` into the whole
    plane, ``here`` where it has one) are the group's best (:func:`best`'s order), and the
    best's flat index, in two all-reduces (max) of the bins' size: whether any rank has a NaN
    and the largest value, then the largest key among the ranks whose candidate can win (the
    index where a NaN wins, minus it where the first maximum does)."""
    nan = v.isnan()
    clean = v.masked_fill(nan, -math.inf)
    top = comm.all_reduce(torch.stack([nan.to(v.dtype), clean]), "max")
    any_nan = top[0] > 0
    can = here & torch.where(any_nan, nan, clean == top[1])
    key = torch.where(any_nan, p, -p)
    best_key = comm.all_reduce(torch.where(can, key, NOBODY), "max")
    return can & (key == best_key), best_key.abs()
