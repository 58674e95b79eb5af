"""Resizing rules: ``F.interpolate`` of blocks, and of whole tensors to a block's size.

A ``size=`` is the whole samples' size: forward code computes it from ``x.shape``, which a
block reports whole (:mod:`parallelkit.spatial.rules.shape`), or writes it out. A whole tensor
interpolated to the whole size of a block whose shape the forward code read (DeepLab's pooled
branch, resized to the feature map beside it) is cut into blocks of that size.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from parallelkit.geometry import per_dim
from parallelkit.spatial import resample
from parallelkit.spatial.grid import scatter
from parallelkit.spatial.pool import upsample_blocks, upsample_factor
from parallelkit.spatial.rules.registry import Call, Guard, channels_first, rule, whole_size

Size = tuple[int, ...]


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
    # convention (spatial.layout).
    return g.marked(scatter(whole, g.comm, g.grid), size=tuple(whole.shape[2:]))
