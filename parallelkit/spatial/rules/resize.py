"""Resizing rules: ``F.interpolate`` of blocks, and of whole tensors to a block's size;
``F.grid_sample`` of blocks at the coordinates of a block of a sampling grid.

A ``size=`` is the whole samples' size: forward code computes it from ``x.shape``, which a
block reports whole (:mod:`parallelkit.spatial.rules.views`), or writes it out. A whole tensor
interpolated to the whole size of a block whose shape the forward code read (DeepLab's pooled
branch, resized to the feature map beside it) is cut into blocks of that size.

A sampling grid's coordinates are data: which rows of the input a rank's output reads is known
only once the grid is (a registration network's displacement field). Each rank reads the range
its coordinates reach, the ranks exchange the ranges (one host all-gather), and each fetches
those rows from whoever holds them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parallelkit.functional as pkf
from parallelkit.geometry import per_dim, tensor_split_sizes
from parallelkit.spatial import resample
from parallelkit.spatial.fetch import empty_output
from parallelkit.spatial.grid import scatter
from parallelkit.spatial.pool import upsample_blocks, upsample_factor
from parallelkit.spatial.rules.registry import (
    Call,
    Guard,
    Size,
    channels_first,
    rule,
    standard,
    whole_size,
)


@rule(F.interpolate,
      params="input, size=None, scale_factor=None, mode='nearest', align_corners=None, "
      "recompute_scale_factor=None, antialias=False", whole=True)  # fmt: skip
def interpolate(g: Guard, call: Call) -> Any:
    """A block by one integer factor, nearest or (bi-, tri-)linear without ``align_corners``,
    given as ``scale_factor=`` or as a whole ``size=``: the spatial upsampling layer's fetch.
    Any other mode, ``align_corners``, factor, size or ``antialias``: per dimension, the
    weights of torch's own interpolation of the identity, applied to the rows each output
    block reads (nothing gathered). A whole tensor to the whole size of a block whose shape
    the forward code read (DeepLab's pooled branch, resized to the feature map beside it):
    interpolated, then cut into blocks."""
    if not call.blocks:
        return _whole_to_block(g, call)
    x, mode = call["input"], call["mode"]
    ndim = channels_first(g, call, x)
    whole_out, size = None, whole_size(g, x)
    if call["size"] is not None:
        whole_out = tuple(int(v) for v in per_dim(call["size"], ndim))
        factors = tuple(o / max(n, 1) for o, n in zip(whole_out, size, strict=True))
    else:
        factors = per_dim(call["scale_factor"], ndim)
    scale = upsample_factor(factors, mode, call["align_corners"], ndim)
    if scale is None or call["antialias"]:
        return _resampled(g, call, x, size, whole_out)
    return g.marked(upsample_blocks(x, scale, mode, g.grid, size),
                    size=tuple(n * scale for n in size))  # fmt: skip


def _resampled(g: Guard, call: Call, x: Tensor, size: Size, whole_out: Size | None) -> Tensor:
    """``F.interpolate`` of the block by per-dimension weights
    (:mod:`parallelkit.spatial.resample`), to ``whole_out`` (the whole size a ``size=`` stands
    for) or by ``scale_factor``; ``size`` is the block's whole size."""
    ndim = x.dim() - 2
    nothing = (None,) * ndim
    outs = whole_out or nothing
    scales = nothing if whole_out else per_dim(call["scale_factor"], ndim)
    args = (call["mode"], call["align_corners"], call["recompute_scale_factor"], call["antialias"])
    mats = []
    for n, m, scale in zip(size, outs, scales, strict=True):
        key = ("interpolate", n, m, scale, *args)
        if key not in g.weights:  # the weights, once per shape and arguments
            mode, corners, recompute, antialias = args
            op = resample.interpolation(mode, m, scale, corners, recompute, antialias)
            g.weights[key] = resample.matrix(n, op)
        mats.append(g.weights[key])
    y = resample.resample(x, g.grid, size, mats)
    return g.marked(y, size=tuple(a.shape[0] for a in mats))


def _whole_to_block(g: Guard, call: Call) -> Tensor:
    x, size = call["input"], call["size"]
    if size is None or not isinstance(x, Tensor) or not 3 <= x.dim() <= 5:
        return call.run()
    whole_size = tuple(int(v) for v in per_dim(size, x.dim() - 2))
    if whole_size not in g.read_sizes:  # a whole tensor's own resizing
        return call.run()
    whole = F.interpolate(**{**call.named, "size": whole_size})
    # Cut with scatter, whose backward gives the whole input its gradient in the region's
    # convention (spatial.record).
    return g.marked(scatter(whole, g.comm, g.grid), size=tuple(whole.shape[2:]))


@rule(F.grid_sample,
      params="input, grid, mode='bilinear', padding_mode='zeros', align_corners=None")  # fmt: skip
def grid_sample(g: Guard, call: Call) -> Tensor:
    """Sampling at the coordinates of a grid (a spatial transformer, a registration network's
    warp): the grid's block says which output rows this rank makes; the whole input rows its
    coordinates fall between (both neighbours of each) are fetched from whoever holds them
    (the ranges exchanged in one host all-gather; along each split dimension the range of
    every rank of the same block, so that later fetches along other dimensions line up), and
    the coordinates are shifted to them. Bilinear or nearest, with zeros or border padding. A
    whole grid (``F.affine_grid`` of the whole size) is cut to this rank's block first; a
    whole input is sampled as it is."""
    x, grid = call["input"], call["grid"]
    mode, padding, corners = call["mode"], call["padding_mode"], bool(call["align_corners"])
    nd = grid.shape[-1]
    if mode not in ("bilinear", "nearest") or padding not in ("zeros", "border"):
        raise g.refuse(call.name, f"mode={mode!r} with padding_mode={padding!r} reads further "
                       "than the next input row (bicubic, reflection); bilinear or nearest with "
                       "zeros or border padding run on blocks")  # fmt: skip
    if x.dim() != nd + 2:
        return call.run()  # torch's own error
    places = tuple(range(-nd - 1, -1))
    if g.is_split(grid):
        if g.places(grid) != places or g.folds(grid):
            raise g.refuse(call.name, "its grid is a block in another layout than (N, *S, dims)")
        out_size = whole_size(g, grid)
    else:  # whole coordinates: this rank's output block reads its block of them
        out_size = tuple(grid.shape[1:-1])
        grid = scatter(g.summed(grid).movedim(-1, 1), g.comm, g.grid).movedim(1, -1)
    if not g.is_split(x):
        return g.marked(F.grid_sample(g.summed(x), grid, mode, padding, corners), size=out_size)
    if g.places(x) != standard(x) or g.folds(x):
        raise g.refuse(call.name, "its input is a block in another layout than (N, C, *S)")
    size, axes = whole_size(g, x), g.grid.axes(nd)
    split = [k for k in range(nd) if axes[k][1] > 1]
    reach = [_reach(grid[..., nd - 1 - k], size[k], corners) for k in split]
    table = g.comm.all_gather_ints([v for k, r in zip(split, reach, strict=True)
                                    for v in (axes[k][2], *r)])  # fmt: skip
    scale = torch.ones(nd, dtype=grid.dtype, device=grid.device)
    shift = torch.zeros(nd, dtype=grid.dtype, device=grid.device)
    for i, k in enumerate(split):
        comm, parts, coord = axes[k]
        want = [_union([row[3 * i + 1 : 3 * i + 3] for row in table if row[3 * i] == q])
                for q in range(parts)]  # fmt: skip
        x = pkf.gather_rows(x, comm, 2 + k, tensor_split_sizes(size[k], parts), want)
        (lo, hi), n = want[coord], size[k]
        if hi - lo > 1:  # the coordinates of the whole input, of rows [lo, hi) of it
            m = hi - lo
            a, b = ((n - 1) / (m - 1), -2 * lo / (m - 1)) if corners else (n / m, -2 * lo / m)
            scale[nd - 1 - k], shift[nd - 1 - k] = a, a + b - 1
    if x.numel() == 0 or grid.numel() == 0:
        return g.marked(empty_output(x, x.shape[1], grid.shape[1:-1], grid, x), size=out_size)
    y = F.grid_sample(x, grid * scale + shift, mode, padding, call["align_corners"])
    return g.marked(y, size=out_size)


def _reach(c: Tensor, n: int, corners: bool) -> tuple[int, int]:
    """The input rows ``[lo, hi)`` that normalized coordinates ``c`` along a dimension of ``n``
    rows read (bilinear's two neighbours, nearest's one), at least two where ``n`` has them;
    (n, 0) for no coordinates."""
    if c.numel() == 0:
        return n, 0
    with torch.no_grad():  # a NaN or infinite coordinate reads nothing: no rank may stop here
        p = torch.nan_to_num(c, nan=0.0, posinf=2.0, neginf=-2.0)
        p = (p + 1) * (n - 1) / 2 if corners else ((p + 1) * n - 1) / 2
        lo, hi = math.floor(p.min().item()), math.floor(p.max().item()) + 2
    lo, hi = min(max(lo, 0), max(n - 2, 0)), max(min(hi, n), min(2, n))
    return lo, max(hi, lo + min(2, n))


def _union(ranges: list[list[int]]) -> tuple[int, int]:
    """The rows of all ``ranges`` (empty ones left out), as one range; (0, 0) for none."""
    ranges = [r for r in ranges if r[1] > r[0]]
    if not ranges:
        return 0, 0
    return min(r[0] for r in ranges), max(r[1] for r in ranges)
