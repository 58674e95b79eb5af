"""A spatial convolution that never copies its block: convolve in place, then fix the edges.

The general path of :class:`~parallelkit.nn.SpatialParallelConv2d` assembles its block with the
halo rows around it (one copy of the block) and convolves that; autograd then keeps the
assembled copy for backward next to the block the previous layer already saved. For the most
common layer, a "same" convolution with stride 1 along the split dimension (every 3x3,
padding 1 convolution of a ResNet or a U-Net), there is a cheaper exact way:

1. start fetching the ``p`` halo rows on each side from the neighbours (one
   :func:`~parallelkit.functional.halo_exchange` of the block's ``2p`` edge rows);
2. convolve the block as it is, letting torch pad it with ``p`` zero rows each side: every
   output row is right except the ``p`` first and ``p`` last, which miss the halo rows' terms;
3. add those terms: the convolution (no bias) of a thin slab holding the halo rows and
   ``2p`` zero rows in place of the block's own rows, whose terms step 2 already has.

By linearity, step 2 plus step 3 is the convolution of the halo-extended block. Backward
follows the same graph: the block's gradient from step 2, the halo rows' gradients from the
slabs, sent back to their owners by the exchange's adjoint. Nothing the
size of the block is copied or saved beyond the block itself. With ``overlap``, step 1 runs on
a helper thread while step 2 computes (the exchange waits in the communicator, not in Python);
whether that pays is measured in ``benchmarks/spatial_resnet.py``.

On a 2-D grid the same holds per dimension: the columns' ``p`` halo columns come first, then
the rows' halo rows of the block with those columns beside it (the corners ride along), and
each adds its terms; the row slabs carry their corner columns, so torch pads them in neither
dimension.

Conditions (:func:`plan`): along every split dimension stride 1 and equal padding ``p``
(``span = 2p + 1``) with ``p >= 1`` and every block at least ``p`` rows; equal padding along
a dimension that is not split (torch pads it natively).

Legend: ``p`` halo rows per side, ``h`` this rank's rows along the split dimension.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import parallelkit.functional as pkf
from parallelkit.geometry import Window, tensor_split_sizes
from parallelkit.spatial.grid import SpatialGrid

_exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallelkit-halo")


@dataclass(frozen=True)
class EdgePlan:
    """Where the halo rows come from: the split dimension (2 or 3), ``p``, and the geometry."""

    dim: int
    p: int
    sizes: tuple[int, ...]
    rank: int
    parts: int


def plan(
    grid: SpatialGrid, windows: tuple[Window, Window], size: tuple[int, int]
) -> tuple[EdgePlan, ...] | None:
    """The edge plan of each split dimension for these windows and whole size, or None where
    the conditions fail."""
    split = [d for d in range(2) if grid.axis(d)[1] > 1]
    if not split or any(w.pad_lo != w.pad_hi for w in windows):
        return None
    plans = []
    for d in split:
        win, p = windows[d], windows[d].pad_lo
        if win.stride != 1 or win.span != 2 * p + 1 or p < 1:
            return None
        _, parts, rank = grid.axis(d)
        sizes = tensor_split_sizes(size[d], parts)
        if min(sizes) < p:
            return None
        plans.append(EdgePlan(2 + d, p, tuple(sizes), rank, parts))
    return tuple(plans)


def conv2d(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: tuple[Window, Window],
    groups: int,
    grid: SpatialGrid,
    edges: tuple[EdgePlan, ...],
    overlap: bool = False,
) -> torch.Tensor:
    """This rank's output block: the block convolved with torch's padding, edges fixed."""

    def fetch() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        # One exchange per split dimension, forward and backward, on every rank alike: the
        # block's p first and p last rows go out, the neighbours' come in (zeros at the
        # image's edges). On a 2-D grid the columns come first, and the rows exchanged are
        # then the edge rows of the block with those columns beside it: the corners.
        halos = {}
        for e in sorted(edges, key=lambda e: -e.dim):
            src = [x_blk]
            if e.dim == 2 and 3 in halos:
                left, right = halos[3]
                src = [left, x_blk, right]
            edge = torch.cat([_edges(t, e.dim, e.p) for t in src], 3)
            out = pkf.halo_exchange(edge, grid.axis(e.dim - 2)[0], e.dim, e.p, e.p)
            halos[e.dim] = (out.narrow(e.dim, 0, e.p), out.narrow(e.dim, 3 * e.p, e.p))
        return halos

    padding = (windows[0].pad_lo, windows[1].pad_lo)
    dilation = (windows[0].dilation, windows[1].dilation)
    if overlap:
        grad_mode = torch.is_grad_enabled()
        pending = _exchanges.submit(_with_grad_mode, grad_mode, fetch)
        y = F.conv2d(x_blk, weight, bias, 1, padding, dilation, groups)
        halos = pending.result()
    else:
        halos = fetch()
        y = F.conv2d(x_blk, weight, bias, 1, padding, dilation, groups)
    return add_halo_terms(y, halos, weight, edges, padding, dilation, groups)


def add_halo_terms(
    y: torch.Tensor,
    halos: dict[int, tuple[torch.Tensor, torch.Tensor]],
    weight: torch.Tensor,
    edges: tuple[EdgePlan, ...],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
) -> torch.Tensor:
    """Add the ``p`` rows above's and below's terms to ``y``'s first and last ``p`` rows, per
    split dimension: the convolution of each with ``2p`` zero rows standing in for the block's
    own rows. Along the other dimension torch pads the slab, except for the rows of a 2-D
    grid, which carry their corner columns."""
    corners = len(edges) == 2
    for e in edges:
        p, dim = e.p, e.dim
        h = y.shape[dim]
        other = 0 if corners and dim == 2 else padding[3 - dim]  # padding[0] is H's
        slab_pad = (0, other) if dim == 2 else (other, 0)
        top, bottom = halos[dim]
        if e.rank > 0:  # rank 0's rows above are padding: nothing to add
            slab = F.pad(top, _pad_after(dim, 2 * p))
            y.narrow(dim, 0, p).add_(F.conv2d(slab, weight, None, 1, slab_pad, dilation, groups))
        if e.rank < e.parts - 1:
            slab = F.pad(bottom, _pad_before(dim, 2 * p))
            term = F.conv2d(slab, weight, None, 1, slab_pad, dilation, groups)
            y.narrow(dim, h - p, p).add_(term)
    return y


def _edges(t: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """The first and the last ``p`` rows of ``t`` along ``dim``, one after the other."""
    n = t.shape[dim]
    return torch.cat([t.narrow(dim, 0, p), t.narrow(dim, n - p, p)], dim)


def _pad_after(dim: int, n: int) -> list[int]:
    """F.pad's (W left, W right, H top, H bottom) adding ``n`` zero rows after, along dim."""
    return [0, n, 0, 0] if dim == 3 else [0, 0, 0, n]


def _pad_before(dim: int, n: int) -> list[int]:
    return [n, 0, 0, 0] if dim == 3 else [0, 0, n, 0]


def _with_grad_mode(enabled: bool, fn):  # type: ignore[no-untyped-def]
    with torch.set_grad_enabled(enabled):
        return fn()
