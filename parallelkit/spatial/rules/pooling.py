"""Pooling rules: functional max, average, Lp and adaptive pooling, and max unpooling, by
the spatial pooling layers' fetches.

As a convolution's (:mod:`.windows`), each output block reads a window of input rows that
pure geometry names, and what a rank does not hold it fetches from the ranks that do.
Forward code calls these functionally (Inception's ``F.max_pool2d``, SegNet's pooling with
indices before its unpooling), so the rules run the spatial pooling's own code with the
call's arguments, ``ceil_mode`` included.

Adaptive average pooling to a fixed size applies torch's own weights per dimension to the rows
each block reads (:mod:`parallelkit.spatial.resample`); adaptive maximum pooling to any size
takes each bin's first maximum per block and combines the small per-bin results across the
group (:mod:`parallelkit.spatial.adaptive_max`): ties and NaNs pick torch's one place.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelkit.geometry import per_dim, tensor_split_sizes
from parallelkit.spatial import adaptive_max, resample
from parallelkit.spatial.grid import gather
from parallelkit.spatial.pool import (
    avg_pool_blocks,
    avg_pool_tokens,
    max_pool_blocks,
    max_pool_indices_blocks,
    max_unpool_blocks,
    pool_windows,
)
from parallelkit.spatial.rules.reductions import mean_spatial
from parallelkit.spatial.rules.registry import Call, Guard, all_, channels_first, rule, whole_size

MAX_POOLS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, torch.max_pool1d: 1,
             torch.max_pool2d: 2, torch.max_pool3d: 3}  # fmt: skip
AVG_POOLS = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3, torch.avg_pool1d: 1}
ADAPTIVE_AVG = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
ADAPTIVE_MAX = (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)
ADAPTIVE_MAX_INDICES = (
    F.adaptive_max_pool1d_with_indices,
    F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d_with_indices,
)  # return_indices=True calls these


def _pool(g: Guard, call: Call, dims: int, dilation: Any = 1) -> tuple[Tensor, tuple, tuple]:
    """The block, its pooling windows and its whole size (refused as the rule cannot take)."""
    x = call["input"]
    if channels_first(g, call, x) != dims:
        raise g.refuse(call.name, f"a block with {x.dim() - 2} spatial dimensions")
    if call.get("return_indices"):
        raise g.refuse(call.name, "return_indices has no exact rule")
    stride = call["stride"] or None  # torch.max_pool2d takes stride=[] for the kernel
    windows = pool_windows(call["kernel_size"], stride, call["padding"], dilation,
                           call["ceil_mode"], dims, call.name)  # fmt: skip
    return x, windows, whole_size(g, x)


def _marked(g: Guard, y: Tensor, windows: tuple, size: tuple) -> Tensor:
    return g.marked(y, size=tuple(w.out_size(n) for w, n in zip(windows, size, strict=True)))


@rule(*MAX_POOLS,
      params="input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, "
      "return_indices=False")  # fmt: skip
def max_pool(g: Guard, call: Call) -> Tensor:
    """The spatial pooling layer's halo fetch (Inception's functional pooling), ``ceil_mode``
    too (its last windows read rows past the padding, which count for nothing)."""
    x, windows, size = _pool(g, call, MAX_POOLS[call.func], call["dilation"])
    return _marked(g, max_pool_blocks(x, windows, g.grid, size), windows, size)


MAX_POOLS_INDICES = {F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2,
                     F.max_pool3d_with_indices: 3}  # fmt: skip
MAX_UNPOOLS = {F.max_unpool1d: 1, F.max_unpool2d: 2, F.max_unpool3d: 3}


def _whole_windows(g: Guard, windows: tuple, size: tuple) -> bool:
    """Whether every block is whole windows that read no other block (kernel = stride, no
    padding or dilation), and the output's blocks are those windows' (each block but the
    last a multiple of the stride): pooling and unpooling are local there."""
    for w, n, (_, parts, _) in zip(windows, size, g.grid.axes(len(size)), strict=True):
        if (w.kernel, w.pad_lo, w.pad_hi, w.dilation) != (w.stride, 0, 0, 1):
            return False
        ins, outs = tensor_split_sizes(n, parts), tensor_split_sizes(w.out_size(n), parts)
        if any(i != o * w.stride for i, o in zip(ins[:-1], outs[:-1], strict=True)):
            return False
    return True


@rule(*MAX_POOLS_INDICES,
      params="input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, "
      "return_indices=False")  # fmt: skip
def max_pool_indices(g: Guard, call: Call) -> tuple[Tensor, Tensor]:
    """``max_pool(return_indices=True)`` (SegNet's encoder, before ``MaxUnpool``), the
    indices numbered in the whole sample's plane, as the dense pooling numbers them. Where
    every block is whole windows: local. Otherwise the spatial pooling's halo fetch (-inf
    rows), any window: the fetched rows pooled for the indices, the values read at them (the
    gradient goes where torch's goes, and back to its owner); a window of -inf only keeps
    torch's first real position, ties and NaNs torch's own."""
    x, dims = call["input"], MAX_POOLS_INDICES[call.func]
    if channels_first(g, call, x) != dims:
        raise g.refuse(call.name, f"a block with {x.dim() - 2} spatial dimensions")
    windows = pool_windows(call["kernel_size"], call["stride"] or None, call["padding"],
                           call["dilation"], call["ceil_mode"], dims, call.name)  # fmt: skip
    size = whole_size(g, x)
    if not call["ceil_mode"] and _whole_windows(g, windows, size):
        y, whole = _whole_window_indices(g, x, call.func, windows, size)
    else:
        y, whole = max_pool_indices_blocks(x, windows, g.grid, size)
    out = tuple(w.out_size(n) for w, n in zip(windows, size, strict=True))
    return g.marked(y, size=out), g.marked(whole, size=out)


def _whole_window_indices(g: Guard, x: Tensor, func: Any, windows: tuple,
                          size: tuple) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The pooling of a block of whole windows, where it is, and its indices from the
    block's plane to the whole plane."""
    kernel = tuple(w.kernel for w in windows)
    out_local = tuple(n // k for n, k in zip(x.shape[2:], kernel, strict=True))
    if 0 in out_local:  # no window here: empty, x kept in the graph
        y = x.new_zeros(*x.shape[:2], *out_local) + 0 * x.sum()
        index = torch.zeros(y.shape, dtype=torch.long, device=x.device)
    else:
        y, index = func(x, kernel, kernel, 0, 1, False, True)
    first = tuple(b.start for b in g.grid.block(*size))
    return y, _plane(index, tuple(x.shape[2:]), first, size)


def _plane(index: Tensor, local: tuple, starts: tuple, whole: tuple) -> Tensor:
    """Flat indices into a block's plane (``local`` its size, ``starts`` where it starts in
    the whole plane) as flat indices into the whole plane of size ``whole``; with ``local``
    and ``whole`` swapped and ``starts`` negated, the way back."""
    out, rest, scale = torch.zeros_like(index), index, 1
    for n, start, m in zip(reversed(local), reversed(starts), reversed(whole), strict=True):
        out, rest, scale = out + (rest % n + start) * scale, rest // n, scale * m
    return out


@rule(*MAX_UNPOOLS, params="input, indices, kernel_size, stride=None, padding=0, output_size=None")
def max_unpool(g: Guard, call: Call) -> Tensor:
    """``MaxUnpool`` of blocks pooled with their indices (the rule above), each index inside
    its value's window. Where every block is whole windows, each value goes to its place in
    this rank's block of the output, the indices taken back from the whole plane to the
    block's. Otherwise each output block fetches the pooled rows whose windows reach it, with
    their indices (a transposed convolution's halo), and unpools them where they land: the
    value torch writes last wins where windows overlap; the backward reads the gradient at
    each index, on the rank that holds it, and the fetch's backward brings it to the value."""
    x, index, dims = call["input"], call["indices"], MAX_UNPOOLS[call.func]
    if channels_first(g, call, x) != dims or not g.is_split(index) or g.form(index) != g.form(x):
        raise g.refuse(call.name, "its input and indices are not blocks of one layout")
    windows = pool_windows(call["kernel_size"], call["stride"] or None, call["padding"], 1,
                           False, dims, call.name)  # fmt: skip
    size = whole_size(g, x)
    out = _unpool_size(call, windows, size)
    pooled = tuple(w.out_size(n) for w, n in zip(windows, out, strict=True))
    if pooled != tuple(size) or not _whole_windows(g, windows, out):
        return g.marked(max_unpool_blocks(x, index, windows, g.grid, size, out), size=out)
    block = g.grid.block(*out)
    local = tuple(b.stop - b.start for b in block)
    if 0 in x.shape[2:] or 0 in local:
        y = x.new_zeros(*x.shape[:2], *local) + 0 * x.sum()
    else:
        mine = _plane(index, out, tuple(-b.start for b in block), local)
        kernel = tuple(w.kernel for w in windows)
        y = call.func(x, mine, kernel, kernel, 0, local)
    return g.marked(y, size=out)


def _unpool_size(call: Call, windows: tuple, size: tuple) -> tuple[int, ...]:
    """The whole output's spatial size: ``output_size`` (its last dimensions), else the
    default; as torch checks it, within a stride of the default."""
    default = tuple((n - 1) * w.stride - w.pad_lo - w.pad_hi + w.kernel
                    for w, n in zip(windows, size, strict=True))  # fmt: skip
    if call["output_size"] is None:
        return default
    asked = tuple(int(n) for n in call["output_size"])
    if len(asked) == len(size) + 2:
        asked = asked[2:]
    if len(asked) != len(size) or any(
        not d - w.stride < n < d + w.stride for n, d, w in zip(asked, default, windows, strict=True)
    ):
        raise ValueError(f"{call.name}: invalid output_size {asked} for a pooled map of "
                         f"{size} (each within a stride of {default})")  # fmt: skip
    return asked


@rule(*AVG_POOLS,
      params="input, kernel_size, stride=None, padding=0, ceil_mode=False, "
      "count_include_pad=True, divisor_override=None", folds=True)  # fmt: skip
def avg_pool(g: Guard, call: Call) -> Tensor:
    """As ``F.max_pool2d`` (``count_include_pad`` and ``divisor_override`` kept). A 1-D pool
    over a block's flattened tokens, without padding, pools the whole token order and gives
    it whole, as ``nn.AvgPool1d`` does there (:func:`avg_pool_tokens`)."""
    if AVG_POOLS[call.func] == 1 and (tokens := g.tokens(call["input"])) is not None:
        return _avg_pool_tokens(g, call, *tokens)
    if g.folds(call["input"]):
        raise g.refuse(call.name, "it is given a window partition (spatial dimensions folded "
                       "into one) that is not a block's flattened tokens")  # fmt: skip
    x, windows, size = _pool(g, call, AVG_POOLS[call.func])
    y = avg_pool_blocks(x, windows, g.grid, size, call["count_include_pad"],
                        call["divisor_override"])  # fmt: skip
    return _marked(g, y, windows, size)


def _avg_pool_tokens(g: Guard, call: Call, index: Tensor, count: int) -> Tensor:
    (kernel,) = per_dim(call["kernel_size"], 1)
    (stride,) = per_dim(call["stride"] or kernel, 1)
    if per_dim(call["padding"], 1) != (0,) or call["ceil_mode"] or call["divisor_override"]:
        raise g.refuse(call.name, "a pooling over a block's tokens takes windows without "
                       "padding, ceil_mode or divisor_override")  # fmt: skip
    return avg_pool_tokens(call["input"], index, count, kernel, stride, g.grid.comm)


LP_POOLS = {F.lp_pool1d: (1, F.avg_pool1d, F.max_pool1d),
            F.lp_pool2d: (2, F.avg_pool2d, F.max_pool2d),
            F.lp_pool3d: (3, F.avg_pool3d, F.max_pool3d)}  # fmt: skip


@rule(*LP_POOLS, params="input, norm_type, kernel_size, stride=None, ceil_mode=False")
def lp_pool(g: Guard, call: Call) -> Tensor:
    """As torch defines it: the average pooling of ``x ** p`` on the blocks, times the
    window's size, to the power ``1 / p``; max pooling of ``|x|`` for an infinite ``p``. Each
    step goes to its own rule."""
    ndim, avg, most = LP_POOLS[call.func]
    x, p, stride, ceil = call["input"], call["norm_type"], call["stride"], call["ceil_mode"]
    kernel = per_dim(call["kernel_size"], ndim)
    with g.rules():
        if p in (float("inf"), -float("inf")):
            y = most(x.abs() if p > 0 else -x.abs(), kernel, stride, 0, 1, ceil)
            return y if p > 0 else -y
        out = avg(x.pow(p), kernel, stride, 0, ceil)
        return (torch.sign(out) * F.relu(torch.abs(out))).mul(math.prod(kernel)).pow(1.0 / p)


@rule(*ADAPTIVE_AVG, *ADAPTIVE_MAX, *ADAPTIVE_MAX_INDICES,
      params="input, output_size, return_indices=False")  # fmt: skip
def adaptive_pool(g: Guard, call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Average pooling to size 1: a mean over the spatial dimensions, whole (CBAM's channel
    attention). To another size (VGG's 7x7, PSPNet's pyramid): per dimension, torch's own
    pooling weights applied to the rows each output block reads, and the small result
    gathered whole. Maximum pooling to any size, ``return_indices`` too: each rank takes the
    first maximum (the last NaN) of its rows of every bin that meets its block, two
    all-reduces of the output's size name each bin's winning place, and a third of the
    winners' values makes the result whole, its gradient routed to the one place torch
    routes it to (ties and NaNs as torch's kernels break them); nothing gathered."""
    x = call["input"]
    ndim = channels_first(g, call, x)
    if call.func in ADAPTIVE_AVG and all_(call["output_size"], 1):
        return mean_spatial(g, x)
    size = whole_size(g, x)
    asked = per_dim(call["output_size"], ndim)
    outs = [n if m is None else m for m, n in zip(asked, size, strict=True)]
    if call.func not in ADAPTIVE_AVG:
        indices = call["return_indices"] or call.func in ADAPTIVE_MAX_INDICES
        return adaptive_max.adaptive_max_pool(x, g.comm, g.grid, size, outs, indices)
    mats = [resample.matrix(n, resample.adaptive_average(m))
            for n, m in zip(size, outs, strict=True)]  # fmt: skip
    y = resample.resample(x, g.grid, size, mats)
    return gather(y, g.comm, g.grid, size=tuple(outs))
