"""Resizing rules: ``F.interpolate`` of blocks, and of whole tensors to a block's size.

A ``size=`` in forward code is ambiguous on blocks: U-Nets write ``size=skip.shape[-2:]``
(a block's size, standing for its whole size), but a literal or computed size may be the
whole sample's or the block's. The guard remembers every block shape the forward code read,
with its whole size (``g.read_sizes``); a ``size=`` equal to one of them stands for that whole
size, decided alike on every rank by one host all-gather. Any other ``size=`` is refused.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from parallelkit.nn import spatial_pooling as spool
from parallelkit.nn import spatial_resample
from parallelkit.spatial.grid import scatter
from parallelkit.spatial.rules.registry import Call, Guard, nchw, pair, rule

Size = tuple[int, ...]
INTERPOLATING = {"linear": 1, "bilinear": 2, "trilinear": 3}


def whole_of_read(g: Guard, asked: Size) -> Size | None:
    """The whole samples' size that a size asked on blocks stands for: that of the blocks
    whose shape the forward code read and found to be ``asked``. Every rank must find one,
    and the same; None where no rank found any (a size of the code's own); refused
    otherwise. One host all-gather, so every rank decides alike."""
    wholes = {whole for read, whole in g.read_sizes if read == asked}
    found = 0 if not wholes else 1 if len(wholes) == 1 and None not in wholes else 2
    blank = (0,) * len(asked)
    table = g.comm.all_gather_ints([found, *(next(iter(wholes)) if found == 1 else blank)])
    if not any(row[0] for row in table):
        return None
    if any(row != table[0] for row in table) or table[0][0] != 1:
        raise g.refuse(
            "F.interpolate", f"the size {asked} asked is not the shape of blocks of one whole "
            "size read beside it on every rank (give scale_factor= instead)",
        )  # fmt: skip
    return tuple(table[0][1:])


@rule(F.interpolate,
      params="input, size=None, scale_factor=None, mode='nearest', align_corners=None, "
      "recompute_scale_factor=None, antialias=False", whole=True)  # fmt: skip
def interpolate(g: Guard, call: Call) -> Any:
    """A block by one integer factor, nearest or (bi-, tri-)linear without ``align_corners``,
    given as ``scale_factor=`` or as a ``size=`` read from a block's shape: the spatial
    upsampling layer's fetch. Any other mode, ``align_corners``, factor or ``antialias``: per
    dimension, the weights of torch's own interpolation of the identity, applied to the rows
    each output block reads (nothing gathered). A whole tensor to a ``size=`` read from a
    block (DeepLab's pooled branch, resized to the feature map beside it): interpolated to
    that block's whole size and scattered to blocks. Any other ``size=``: refused."""
    if not call.blocks:
        return _whole_to_block(g, call)
    x, mode = call["input"], call["mode"]
    ndim = nchw(g, call, x)
    whole_out = None
    if call["size"] is not None:
        asked = tuple(int(v) for v in pair(call["size"], ndim))
        if (whole_out := whole_of_read(g, asked)) is None:
            raise g.refuse(
                call.name, f"the size {asked} asked is not the shape of a block read beside "
                "it: a size the forward code wrote or computed may be the whole sample's or "
                "the block's (give scale_factor= instead)",
            )  # fmt: skip
        size = g.size_now or g.grid.global_size(x, call.name)
        factors = tuple(o / max(n, 1) for o, n in zip(whole_out, size, strict=True))
    else:
        factors = pair(call["scale_factor"], ndim)
    covered = (mode == "nearest" or INTERPOLATING.get(mode) == ndim) and not call["align_corners"]
    integer = len(set(factors)) == 1 and int(factors[0]) == factors[0] and factors[0] >= 1
    if not covered or call["antialias"] or not integer:
        return _resampled(g, call, x, whole_out)
    key = (int(factors[0]), mode)
    if key not in g.layers:
        g.layers[key] = spool.SpatialUpsample(*key, comm=g.comm, grid=g.grid)
    layer = g.layers[key]
    return g.marked(layer(x), size=layer.out_size(g.size_now) if g.size_now else None)


def _resampled(g: Guard, call: Call, x: Tensor, whole_out: Size | None) -> Tensor:
    """``F.interpolate`` of the block by per-dimension weights (:mod:`spatial_resample`), to
    ``whole_out`` (the whole size a ``size=`` stands for) or by ``scale_factor``."""
    ndim = x.dim() - 2
    size = g.size_now or g.grid.global_size(x, call.name)
    nothing = (None,) * ndim
    outs = whole_out or nothing
    scales = nothing if whole_out else pair(call["scale_factor"], ndim)
    args = (call["mode"], call["align_corners"], call["recompute_scale_factor"], call["antialias"])
    mats = []
    for n, m, scale in zip(size, outs, scales, strict=True):
        key = ("interpolate", n, m, scale, *args)
        if key not in g.layers:  # the weights, once per shape and arguments
            mode, corners, recompute, antialias = args
            op = spatial_resample.interpolation(mode, m, scale, corners, recompute, antialias)
            g.layers[key] = spatial_resample.matrix(n, op)
        mats.append(g.layers[key])
    y = spatial_resample.resample(x, g.grid, size, mats)
    return g.marked(y, size=tuple(a.shape[0] for a in mats))


def _whole_to_block(g: Guard, call: Call) -> Tensor:
    x, size = call["input"], call["size"]
    if size is None or not isinstance(x, Tensor) or not 3 <= x.dim() <= 5:
        return call.run()
    whole_size = whole_of_read(g, tuple(int(v) for v in pair(size, x.dim() - 2)))
    if whole_size is None:
        return call.run()
    whole = F.interpolate(**{**call.named, "size": whole_size})
    # Cut with scatter, whose backward gives the whole input its gradient in the region's
    # convention (spatial.layout).
    return g.marked(scatter(whole, g.comm, g.grid), size=tuple(whole.shape[2:]))
