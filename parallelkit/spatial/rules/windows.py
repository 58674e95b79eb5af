"""Window rules: functional convolution and unfolds (``F.unfold``, its adjoint ``F.fold``,
``Tensor.unfold``), by the spatial layers' fetches.

Each output block reads a window of input rows (along each spatial dimension: signals,
images and volumes alike) that pure geometry names
(:mod:`parallelkit.geometry`); what a rank does not hold it fetches from the ranks that do, and
backward sends the gradients back. Forward code calls these functionally (a Conv2d subclass,
weight standardization, a ``padding_mode`` other than zeros), so the rules run the spatial
layers' own code with the call's arguments. Pooling, which reads its windows the same way, is
a family of its own (:mod:`.pooling`), as are padding, shifts and flips (:mod:`.padding`);
their rules stay importable from here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelkit.geometry import per_dim
from parallelkit.spatial.conv import conv_blocks, conv_transpose_blocks, conv_windows
from parallelkit.spatial.fetch import empty_output, fetch
from parallelkit.spatial.rules.padding import flip, pad, roll
from parallelkit.spatial.rules.pooling import (
    ADAPTIVE_AVG,
    ADAPTIVE_MAX,
    ADAPTIVE_MAX_INDICES,
    AVG_POOLS,
    LP_POOLS,
    MAX_POOLS,
    MAX_POOLS_INDICES,
    MAX_UNPOOLS,
    adaptive_pool,
    avg_pool,
    lp_pool,
    max_pool,
    max_pool_indices,
    max_unpool,
)
from parallelkit.spatial.rules.registry import Call, Guard, all_, channels_first, rule, whole_size

# This family's rules, and those that moved to their own families (importable from here).
__all__ = [
    "ADAPTIVE_AVG", "ADAPTIVE_MAX", "ADAPTIVE_MAX_INDICES", "AVG_POOLS", "LP_POOLS", "MAX_POOLS",
    "MAX_POOLS_INDICES", "MAX_UNPOOLS", "adaptive_pool", "avg_pool", "conv", "flip", "fold",
    "lp_pool", "max_pool", "max_pool_indices", "max_unpool", "pad", "roll", "tensor_unfold",
    "unfold",
]  # fmt: skip


@rule(F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d,
      params="input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1",
      folds=True)  # fmt: skip
def conv(g: Guard, call: Call) -> Tensor:
    """The spatial convolution's halo fetch or edge path with the call's weight, which is
    whole (a parameter, or computed from one) and whose gradient is summed; a 1x1 (1x1x1)
    with stride 1 and no padding is local, on a block of any form whose channels are
    dimension 1 (an attention map's heads, folded patches)."""
    x, weight, bias = call["input"], call["weight"], call["bias"]
    if not g.is_split(x) or g.is_split(weight) or g.is_split(bias):
        raise g.refuse(call.name, "its weight is a block of split samples")
    stride, padding, dilation = call["stride"], call["padding"], call["dilation"]
    kernel = tuple(weight.shape[2:])
    if all_(kernel, 1) and all_(stride, 1) and (padding in ("same", "valid") or all_(padding, 0)):
        if any(x.dim() + d < 2 for d in g.places(x)):
            raise g.refuse(call.name, "its channels (dimension 1) hold a spatial dimension")
        weight, bias = g.summed(weight), g.summed(bias)
        if 0 in x.shape[2:]:  # an empty block (F.conv refuses it): parameters kept in the graph
            y = empty_output(x, weight.shape[0], x.shape[2:], x, weight, bias)
        else:
            y = call.func(x, weight, bias, 1, 0, dilation, call["groups"])
        return g.marked(y, g.places(x))
    if g.folds(x):
        raise g.refuse(call.name, "it is given a window partition (spatial dimensions folded "
                       "into one) and its kernel reaches across positions")  # fmt: skip
    ndim = channels_first(g, call, x)
    weight, bias = g.summed(weight), g.summed(bias)
    if padding == "same" and not all_(stride, 1):  # as torch says it
        raise ValueError("padding='same' is not supported for strided convolutions")
    if len(kernel) != ndim:
        raise g.refuse(call.name, f"a {len(kernel)}-D kernel on a block with {ndim} spatial "
                       "dimensions")  # fmt: skip
    windows = conv_windows(kernel, stride, padding, dilation)
    size = whole_size(g, x)
    out = conv_blocks(x, weight, bias, windows, call["groups"], g.grid, size)
    return g.marked(out, size=tuple(w.out_size(n) for w, n in zip(windows, size, strict=True)))


def _halo(g: Guard, x: Tensor, windows: tuple) -> tuple[Tensor, tuple, tuple, tuple]:
    """The rows the output block of ``windows`` reads (a convolution's halo), the padding left
    to the operation, and the output block's and the whole output's sizes."""
    size = whole_size(g, x)
    x_halo, out_size, pad = fetch(x, g.grid, windows, size, native=True)
    return x_halo, pad, out_size, tuple(w.out_size(n) for w, n in zip(windows, size, strict=True))


@rule(F.unfold, params="input, kernel_size, dilation=1, padding=0, stride=1")
def unfold(g: Guard, call: Call) -> Tensor:
    """``F.unfold`` (im2col: VOLO's outlook attention, patch extraction by hand): the rows this
    rank's output positions read fetched as a convolution's halo, then unfolded; the output's
    positions, flattened, are a token dimension of the whole output's size."""
    x = call["input"]
    if channels_first(g, call, x) != 2:
        raise g.refuse(call.name, "it takes (N, C, H, W) blocks")
    kernel = per_dim(call["kernel_size"], 2)
    windows = conv_windows(kernel, call["stride"], call["padding"], call["dilation"])
    x_halo, pad, out_size, whole = _halo(g, x, windows)
    if min(out_size) == 0:  # no output position here: an empty block, x kept in the graph
        y = x_halo.new_zeros(x.shape[0], x.shape[1] * math.prod(kernel), 0) + 0 * x_halo.sum()
    else:
        y = F.unfold(x_halo, kernel, call["dilation"], pad, call["stride"])
    return g.marked(y, (-1, -1), size=whole, folds=(((whole[0], 0), (whole[1], 1)),))


@rule(F.fold, params="input, output_size, kernel_size, dilation=1, padding=0, stride=1",
      folds=True)  # fmt: skip
def fold(g: Guard, call: Call) -> Tensor:
    """``F.fold`` (col2im: VOLO's outlook attention sums its windows back into the map), the
    adjoint of ``F.unfold``: each channel's k*k columns transposed-convolved with a one-hot
    kernel (groups by channel), so that the rows a block's windows reach beyond it are added
    into their owners' blocks by the spatial transposed convolution's scatter. The columns'
    positions are a token dimension of the whole window grid (rows, then columns), split as
    the map's rows and columns are. A column holding inf or NaN spreads NaN over its k*k
    outputs (the kernel's zeros times it), where torch's fold keeps it to one."""
    cols = call["input"]
    places, folds = g.form(cols)
    if cols.dim() != 3 or places != (-1, -1) or [[k for _, k in f] for f in folds] != [[0, 1]]:
        raise g.refuse(call.name, "its columns' positions are not one token dimension of a "
                       "split map's rows and columns, (N, C * k * k, L)")  # fmt: skip
    windows = tuple(n for n, _ in folds[0])  # the whole window grid
    size = per_dim(call["output_size"], 2)
    kernel, dilation, padding, stride = (
        per_dim(call[name], 2) for name in ("kernel_size", "dilation", "padding", "stride")
    )
    # The transposed convolution's output padding: the rows of output_size past the last
    # window's reach (fewer than a stride, or the window grid is not output_size's).
    reach = zip(windows, kernel, stride, padding, dilation, strict=True)
    extra = tuple(n - ((w - 1) * s - 2 * p + d * (k - 1) + 1)
                  for n, (w, k, s, p, d) in zip(size, reach, strict=True))  # fmt: skip
    area = math.prod(kernel)
    if cols.shape[1] % area or not all(0 <= e < s for e, s in zip(extra, stride, strict=True)):
        raise ValueError(f"fold: input of {cols.shape[1]} channels and {windows} windows "
                         f"does not fit output_size={size}, kernel_size={kernel}, "
                         f"dilation={dilation}, padding={padding}, stride={stride}")  # fmt: skip
    n = cols.shape[0]
    rows = [b.stop - b.start for b in g.grid.block(*windows)]
    channels = cols.shape[1] // area
    one_hot = torch.eye(area, dtype=cols.dtype, device=cols.device).view(area, 1, *kernel)
    y = conv_transpose_blocks(cols.reshape(n, cols.shape[1], *rows),
                              one_hot.repeat(channels, 1, 1, 1), None, stride, padding, extra,
                              dilation, channels, g.grid, windows)  # fmt: skip
    return g.marked(y, size=size, folds=())  # (N, C, H, W) blocks, no fold


@rule(Tensor.unfold, params="input, dimension, size, step")
def tensor_unfold(g: Guard, call: Call) -> Tensor:
    """``Tensor.unfold`` along a spatial dimension (HaloNet's blocked attention with a halo,
    sliding windows by hand): the windows that start in this rank's block, with the rows they
    reach fetched from the neighbours; the window count is the dimension's whole size from
    then on, the window's own positions a new last dimension. Along channels or the batch:
    local."""
    x, dim, k, step = call["input"], call["dimension"], call["size"], call["step"]
    ndim = len(g.places(x))
    if [x.dim() + d for d in g.places(x)] != list(range(2, 2 + ndim)):  # (N, C, *spatial, ...)
        raise g.refuse(call.name, "its spatial dimensions are not the ones after N and C")
    moved = tuple(d - 1 for d in g.places(x))  # a new last dimension
    axis = dim % x.dim() - 2
    if axis < 0:
        return g.marked(call.run(), moved)
    kernel, stride = [1] * ndim, [1] * ndim
    kernel[axis], stride[axis] = k, step
    x_halo, _, out_size, whole = _halo(g, x, conv_windows(kernel, stride, 0, 1))
    if out_size[axis] == 0:  # no window starts here: an empty block, x kept in the graph
        shape = list(x_halo.shape)
        shape[2 + axis] = 0
        y = x_halo.new_zeros(*shape, k) + 0 * x_halo.sum()
    else:
        y = x_halo.unfold(2 + axis, k, step)
    return g.marked(y, moved, size=whole)
