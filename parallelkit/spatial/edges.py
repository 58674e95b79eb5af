"""Spatial convolutions that never copy their block: convolve in place, then fix the edges.

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

A transposed convolution (:func:`conv_transpose`, e.g. a U-Net's stride-2 upsampling) is
linear too, and each input row scatters into output rows at a fixed place, so the same holds
with the roles turned: the block is scattered as it is and cut to the output block (a view),
and the ``lo`` rows before it and ``hi`` after it that the output block also receives from
(:func:`transposed_plan`; often one row, on one side) are scattered from thin slabs and added
where they land. Its condition: every block at least as thick as the rows its neighbours want
from it.

Legend: ``p`` halo rows per side, ``h`` this rank's rows along the split dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import parallelkit.functional as pkf
from parallelkit.geometry import Window, per_dim, starts, tensor_split_sizes, transposed_halo
from parallelkit.spatial.fetch import crop
from parallelkit.spatial.grid import SpatialGrid

_exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallelkit-halo")


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
"""The torch convolution of a sample with 1, 2 or 3 spatial dimensions."""
CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


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
    stride, padding, dilation = (per_dim(v, ndim) for v in (stride, padding, dilation))
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
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
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
            edge = _extended_edges(x_blk, halos, edges[:k], e.dim, e.p, e.p)
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


@dataclass(frozen=True)
class TransposedEdge:
    """A split dimension of a transposed convolution's edge path: the tensor dimension, the
    ``lo`` rows before this rank's block and ``hi`` after it that every rank's output block
    may receive from (the largest over the ranks), this rank's first input row and its output
    block ``(o0, rows)``."""

    dim: int
    lo: int
    hi: int
    rank: int
    parts: int
    first: int
    block: tuple[int, int]


def transposed_plan(
    grid: SpatialGrid,
    size: Sequence[int],
    out_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[TransposedEdge, ...] | None:
    """The edge plan of a transposed convolution from ``size`` to ``out_size``, last split
    dimension first; None where :func:`~parallelkit.geometry.transposed_halo` says a block is
    too thin."""
    axes = grid.axes(len(size))
    plans = []
    for d in reversed(range(len(size))):
        _, parts, rank = axes[d]
        if parts == 1:
            continue
        halo = transposed_halo(size[d], out_size[d], parts, kernel[d], stride[d], padding[d],
                               dilation[d])  # fmt: skip
        if halo is None:
            return None
        first = starts(tensor_split_sizes(size[d], parts))[rank]
        outs = tensor_split_sizes(out_size[d], parts)
        block = (starts(outs)[rank], outs[rank])
        plans.append(TransposedEdge(2 + d, *halo, rank, parts, first, block))
    return tuple(plans) if plans else None


def conv_transpose(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    grid: SpatialGrid,
    edges: tuple[TransposedEdge, ...],
    out_size: Sequence[int],
) -> torch.Tensor:
    """This rank's output block (no bias) of a transposed convolution, its block never copied.

    Transposed convolution is linear and each input row scatters into output rows at a fixed
    place (``i * stride - padding``), so the output block is the block's own scatter plus the
    halo rows' scatters, each added where it lands. The block's own is computed in place and
    cut to the output block (a view); the halo rows come from one exchange per split
    dimension that has any (a 2x2, stride-2 one has none), extended by the halos of the
    dimensions before it as in :func:`conv` (edges and corners), and only those thin slabs are
    scattered again.
    """
    ndim = x_blk.dim() - 2
    axes = grid.axes(ndim)
    by_dim = {e.dim: e for e in edges}
    # Output blocks and the global input row each tensor's local row 0 holds, per dimension.
    blocks = [by_dim[2 + j].block if 2 + j in by_dim else (0, out_size[j]) for j in range(ndim)]
    own = [by_dim[2 + j].first if 2 + j in by_dim else 0 for j in range(ndim)]
    moving = tuple(e for e in edges if e.lo or e.hi)
    halos: list[tuple[torch.Tensor, torch.Tensor]] = []
    exchanged: list[torch.Tensor] = []
    for k, e in enumerate(moving):
        edge = _extended_edges(x_blk, halos, moving[:k], e.dim, e.hi, e.lo)
        out = pkf.halo_exchange(edge, axes[e.dim - 2][0], e.dim, e.lo, e.hi)
        halos.append((out.narrow(e.dim, 0, e.lo), out.narrow(e.dim, 2 * e.lo + e.hi, e.hi)))
        exchanged.append(out)

    def scatter(t: torch.Tensor) -> torch.Tensor:
        return CONV_TRANSPOSE[ndim](t, weight, None, stride, 0, 0, groups, dilation)

    y = _place(scatter(x_blk), [own[j] * stride[j] - padding[j] for j in range(ndim)], blocks)
    for k, e in enumerate(moving):
        # A slab's first row per dimension: its own rows' first, less the halo rows carried
        # along the dimensions exchanged before it; along this one, the halo's first.
        rows = list(own)
        for f in moving[:k]:
            rows[f.dim - 2] -= f.lo
        j, used = e.dim - 2, False
        for slab, first, real in (
            (halos[k][0], own[j] - e.lo, e.rank > 0),  # rank 0's rows before are zeros
            (halos[k][1], own[j] + x_blk.shape[e.dim], e.rank < e.parts - 1),
        ):
            if real and slab.shape[e.dim] > 0:
                rows[j] = first
                origin = [rows[i] * stride[i] - padding[i] for i in range(ndim)]
                used |= _add_overlap(y, scatter(slab), origin, blocks)
        if not used:  # the exchange's backward runs on every rank: it is a collective
            y.add_(0 * exchanged[k].sum())
    return y


def _place(
    t: torch.Tensor, origin: Sequence[int], blocks: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """``t`` (local row 0 at global row ``origin``) as the output block ``blocks``: cut to it
    (a view) where it covers the block, else a zero block with ``t``'s overlap added."""
    spans = zip(blocks, origin, t.shape[2:], strict=True)
    if all(t0 <= o0 and o0 + o <= t0 + n for (o0, o), t0, n in spans):
        return crop(t, origin, blocks)
    y = t.new_zeros(*t.shape[:2], *(o for _, o in blocks))
    _add_overlap(y, t, origin, blocks)
    return y


def _add_overlap(
    y: torch.Tensor, term: torch.Tensor, origin: Sequence[int], blocks: Sequence[tuple[int, int]]
) -> bool:
    """Add to ``y`` (the output block ``blocks``) the part of ``term`` (whose local row 0 is
    global row ``origin``, per dimension) that lands inside it; whether any does."""
    for j, ((o0, o), t0) in enumerate(zip(blocks, origin, strict=True)):
        lo, hi = max(o0, t0), min(o0 + o, t0 + term.shape[2 + j])
        if hi <= lo:
            return False
        y = y.narrow(2 + j, lo - o0, hi - lo)
        term = term.narrow(2 + j, lo - t0, hi - lo)
    y.add_(term)
    return True


def _extended_edges(
    x: torch.Tensor,
    halos: list[tuple[torch.Tensor, torch.Tensor]],
    done: Sequence[EdgePlan | TransposedEdge],
    dim: int,
    first: int,
    last: int,
) -> torch.Tensor:
    """The first ``first`` and last ``last`` rows along ``dim`` of ``x`` extended by the halos
    fetched so far (along the dimensions of ``done``), built from the pieces' edges: the block
    itself is never copied."""
    if not done:
        return _edges(x, dim, first, last)
    lo, hi = halos[len(done) - 1]
    inner = _extended_edges(x, halos, done[:-1], dim, first, last)
    pieces = [_edges(lo, dim, first, last), inner, _edges(hi, dim, first, last)]
    return torch.cat(pieces, done[-1].dim)


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


def _edges(t: torch.Tensor, dim: int, first: int, last: int) -> torch.Tensor:
    """The first ``first`` and the last ``last`` rows of ``t`` along ``dim``, one after the
    other."""
    n = t.shape[dim]
    return torch.cat([t.narrow(dim, 0, first), t.narrow(dim, n - last, last)], dim)


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
