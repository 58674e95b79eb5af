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

On a grid over 2 or 3 dimensions the same holds per dimension, the last first: W's ``p`` halo
columns, then H's halo rows of the block with those columns beside it (the corners ride
along), then D's halo planes of the block with both beside it (edges and corners); each adds
its terms, and a slab carries the rows of the dimensions exchanged before it, so torch pads it
only along the others. Signals (1-D), images (2-D) and volumes (3-D) alike.

Conditions (:func:`plan`): along every split dimension stride 1 and equal padding ``p``
(``span = 2p + 1``) with ``p >= 1`` and every block at least ``p`` rows; equal padding along
a dimension that is not split (torch pads it natively).

Legend: ``p`` halo rows per side, ``h`` this rank's rows along the split dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import parallelkit.functional as pkf
from parallelkit.geometry import Window, tensor_split_sizes
from parallelkit.spatial.grid import SpatialGrid

_exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallelkit-halo")


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
"""The torch convolution of a sample with 1, 2 or 3 spatial dimensions."""


def convolve(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    groups: int,
) -> torch.Tensor:
    """``F.conv1d/2d/3d`` of a block (or an edge slab), kept off torch's slow CPU kernel.

    For a float32 3-D convolution of a batch of 1 (groups 1, kernel at most 3 along H or W),
    torch's CPU heuristic takes its im2col kernel (``slow_conv3d``) when C x D x H <= 20480,
    and oneDNN above that line. A block is a fraction of the whole volume, and an edge slab a
    few planes of it: they fall under the line where the whole volume does not, and their
    forward and backward then run 3-7x slower than oneDNN would (measured on this project's
    CPU runners at the U-Net's 64^3 and 32^3 levels split in two), enough to make the split
    step slower than the dense one. Under the line such a block is convolved as a batch of
    two: its output rows along one dimension in two halves, each with the input rows it
    reads, which torch runs on oneDNN forward and backward. The sums are the same; a row
    computed twice (an odd count) is kept once. A single input channel stays as it is: im2col
    is fast there.
    """
    ndim = x.dim() - 2
    stride, padding, dilation = (_per_dim(v, ndim) for v in (stride, padding, dilation))
    if ndim == 3 and _on_slow_conv3d(x, weight, groups):
        kernel = weight.shape[2:]
        for dim in range(3):
            out = (x.shape[2 + dim] + 2 * padding[dim] - dilation[dim] * (kernel[dim] - 1)
                   - 1) // stride[dim] + 1  # fmt: skip
            if out >= 2:
                return _as_batch_of_two(x, weight, bias, stride, padding, dilation, dim, out)
    return CONV[ndim](x, weight, bias, stride, padding, dilation, groups)


def _on_slow_conv3d(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether torch would run this float32 CPU 3-D convolution on ``slow_conv3d`` although
    oneDNN is there (ATen's ``ConvParams::use_mkldnn``), with more than one input channel."""
    n, c, d, h, _ = x.shape
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
        and n == 1
        and groups == 1
        and c > 1
        and not (weight.shape[-1] > 3 and weight.shape[-2] > 3)
        and c * d * h <= 20480
    )


def _as_batch_of_two(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    dim: int,
    out: int,
) -> torch.Tensor:
    """The convolution of a batch of 1 as a batch of 2: the first ceil(out / 2) output rows
    along spatial dimension ``dim`` and the last as many, each from the input rows it reads
    (with the padding along ``dim`` made explicit)."""
    axis = 2 + dim
    x = F.pad(x, _pad(3, axis, padding[dim], padding[dim]))
    half = (out + 1) // 2
    span = (half - 1) * stride[dim] + dilation[dim] * (weight.shape[axis] - 1) + 1
    start = (out - half) * stride[dim]
    pair = torch.cat([x.narrow(axis, 0, span), x.narrow(axis, start, span)])
    padding = [0 if j == dim else padding[j] for j in range(3)]
    y = F.conv3d(pair, weight, bias, stride, padding, dilation)
    second = y[1:].narrow(axis, 2 * half - out, out - half)
    return torch.cat([y[:1], second], axis)


def _per_dim(v: int | Sequence[int], ndim: int) -> list[int]:
    return [v] * ndim if isinstance(v, int) else list(v)


@dataclass(frozen=True)
class EdgePlan:
    """Where the halo rows come from: the split dimension (2, 3 or 4), ``p``, the geometry."""

    dim: int
    p: int
    sizes: tuple[int, ...]
    rank: int
    parts: int


def plan(
    grid: SpatialGrid, windows: Sequence[Window], size: Sequence[int]
) -> tuple[EdgePlan, ...] | None:
    """The edge plan of each split dimension for these windows and whole size, or None where
    the conditions fail. The plans come last dimension first: the order of the exchanges."""
    axes = grid.axes(len(size))
    split = [d for d in reversed(range(len(size))) if axes[d][1] > 1]
    # conv() convolves with stride 1 along every dimension, split or not: a stride anywhere
    # (a (1, 2, 2) video stem split over depth) takes the halo fetch instead.
    if not split or any(w.pad_lo != w.pad_hi or w.stride != 1 for w in windows):
        return None
    plans = []
    for d in split:
        win, p = windows[d], windows[d].pad_lo
        if win.stride != 1 or win.span != 2 * p + 1 or p < 1:
            return None
        _, parts, rank = axes[d]
        sizes = tensor_split_sizes(size[d], parts)
        if min(sizes) < p:
            return None
        plans.append(EdgePlan(2 + d, p, tuple(sizes), rank, parts))
    return tuple(plans)


def conv(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: Sequence[Window],
    groups: int,
    grid: SpatialGrid,
    edges: tuple[EdgePlan, ...],
    overlap: bool = False,
) -> torch.Tensor:
    """This rank's output block: the block convolved with torch's padding, edges fixed."""
    ndim = x_blk.dim() - 2
    axes = grid.axes(ndim)

    def fetch() -> list[tuple[torch.Tensor, torch.Tensor]]:
        # One exchange per split dimension, forward and backward, on every rank alike: the
        # block's p first and p last rows go out, the neighbours' come in (zeros at the
        # sample's edges). The last dimension comes first, and each next exchange sends the
        # edge rows of the block with the halos fetched so far beside it: edges and corners.
        halos: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, e in enumerate(edges):
            edge = _extended_edges(x_blk, halos, edges[:k], e.dim, e.p)
            out = pkf.halo_exchange(edge, axes[e.dim - 2][0], e.dim, e.p, e.p)
            halos.append((out.narrow(e.dim, 0, e.p), out.narrow(e.dim, 3 * e.p, e.p)))
        return halos

    padding = tuple(w.pad_lo for w in windows)
    dilation = tuple(w.dilation for w in windows)
    if overlap:
        grad_mode = torch.is_grad_enabled()
        pending = _exchanges.submit(_with_grad_mode, grad_mode, fetch)
        y = convolve(x_blk, weight, bias, 1, padding, dilation, groups)
        halos = pending.result()
    else:
        halos = fetch()
        y = convolve(x_blk, weight, bias, 1, padding, dilation, groups)
    return add_halo_terms(y, halos, weight, edges, padding, dilation, groups)


def _extended_edges(
    x: torch.Tensor,
    halos: list[tuple[torch.Tensor, torch.Tensor]],
    done: Sequence[EdgePlan],
    dim: int,
    p: int,
) -> torch.Tensor:
    """The first and last ``p`` rows along ``dim`` of ``x`` extended by the halos fetched so
    far (along the dimensions of ``done``), built from the pieces' edges: the block itself is
    never copied."""
    if not done:
        return _edges(x, dim, p)
    lo, hi = halos[len(done) - 1]
    inner = _extended_edges(x, halos, done[:-1], dim, p)
    return torch.cat([_edges(lo, dim, p), inner, _edges(hi, dim, p)], done[-1].dim)


def add_halo_terms(
    y: torch.Tensor,
    halos: list[tuple[torch.Tensor, torch.Tensor]],
    weight: torch.Tensor,
    edges: tuple[EdgePlan, ...],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """Add the ``p`` rows before's and after's terms to ``y``'s first and last ``p`` rows, per
    split dimension: the convolution of each with ``2p`` zero rows standing in for the block's
    own rows. Along the dimensions exchanged before it the slab carries its edge and corner
    rows; along the others torch pads it."""
    ndim = y.dim() - 2
    for k, e in enumerate(edges):
        p, dim = e.p, e.dim
        carried = {f.dim for f in edges[: k + 1]}
        slab_pad = tuple(0 if 2 + j in carried else padding[j] for j in range(ndim))
        before, after = halos[k]
        if e.rank > 0:  # rank 0's rows before are padding: nothing to add
            slab = F.pad(before, _pad(ndim, dim, 0, 2 * p))
            term = convolve(slab, weight, None, 1, slab_pad, dilation, groups)
            y.narrow(dim, 0, p).add_(term)
        if e.rank < e.parts - 1:
            slab = F.pad(after, _pad(ndim, dim, 2 * p, 0))
            term = convolve(slab, weight, None, 1, slab_pad, dilation, groups)
            y.narrow(dim, y.shape[dim] - p, p).add_(term)
    return y


def _edges(t: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """The first and the last ``p`` rows of ``t`` along ``dim``, one after the other."""
    n = t.shape[dim]
    return torch.cat([t.narrow(dim, 0, p), t.narrow(dim, n - p, p)], dim)


def _pad(ndim: int, dim: int, before: int, after: int) -> list[int]:
    """F.pad's list (last dimension first) adding ``before`` and ``after`` zero rows along
    ``dim`` of a tensor with ``ndim`` spatial dimensions."""
    pads = [0] * (2 * ndim)
    i = 2 * (ndim - 1 - (dim - 2))
    pads[i], pads[i + 1] = before, after
    return pads


def _with_grad_mode(enabled: bool, fn):  # type: ignore[no-untyped-def]
    with torch.set_grad_enabled(enabled):
        return fn()
