"""Window rules: functional convolution, pooling and padding, by the spatial layers' fetches.

Each output block reads a window of input rows and columns that pure geometry names
(:mod:`parallelkit.geometry`); what a rank does not hold it fetches from the ranks that do, and
backward sends the gradients back. Forward code calls these functionally (a Conv2d subclass,
weight standardization, Inception's ``F.max_pool2d``, a ``padding_mode`` other than zeros), so
the rules run the spatial layers' own code with the call's arguments. Geometry the fetches do
not cover (``ceil_mode``, adaptive pooling to a fixed size) runs on the gathered whole images,
exactly, at that memory cost, with a warning.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parallelkit.functional as pkf
from parallelkit.comm import tensor_split_sizes
from parallelkit.geometry import starts
from parallelkit.nn import spatial_parallel as sp
from parallelkit.nn import spatial_pooling as spool
from parallelkit.spatial.grid import gather, scatter
from parallelkit.spatial.rules import compat
from parallelkit.spatial.rules.reductions import extreme, mean_hw
from parallelkit.spatial.rules.registry import Call, Guard, all_, nchw, rule


def on_gathered(g: Guard, call: Call, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``call.func(whole x, *args, **kwargs)`` on the whole images gathered from the blocks,
    cut back into blocks: exact, but every rank holds this layer's whole input and output for
    a moment, so it warns once per operation."""
    nchw(g, call, x)
    g.warn_once(
        call.func,
        f"spatial parallelism: {call.name} with these arguments runs on the whole images, "
        "gathered on every rank (exact, but this layer's activations are not split)",
    )
    y = call.func(gather(x, g.comm, g.grid), *args, **kwargs)
    return g.marked(scatter(y, g.comm, g.grid), size=(y.shape[-2], y.shape[-1]))


@rule(F.conv2d, torch.conv2d,
      params="input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1")  # fmt: skip
def conv2d(g: Guard, call: Call) -> Tensor:
    """The spatial convolution's halo fetch or edge path with the call's weight, which is
    whole (a parameter, or computed from one) and whose gradient is summed; a 1x1 with stride
    1 and no padding is local."""
    x, weight, bias = call["input"], call["weight"], call["bias"]
    if not g.is_split(x) or g.is_split(weight) or g.is_split(bias):
        raise g.refuse(call.name, "its weight is a block of split images")
    nchw(g, call, x)
    stride, padding, dilation = call["stride"], call["padding"], call["dilation"]
    weight, bias = g.summed(weight), g.summed(bias)
    one = tuple(weight.shape[-2:]) == (1, 1) and all_(stride, 1)
    if one and (padding == "valid" or all_(padding, 0)):
        return g.marked(call.func(x, weight, bias, 1, 0, dilation, call["groups"]))
    if padding == "same" and not all_(stride, 1):  # as torch says it
        raise ValueError("padding='same' is not supported for strided convolutions")
    windows = sp.conv_windows(weight.shape[-2:], stride, padding, dilation)
    size = g.size_now or g.grid.global_size(x, call.name)
    out = sp.conv2d_blocks(x, weight, bias, windows, call["groups"], g.grid, size)
    return g.marked(out, size=(windows[0].out_size(size[0]), windows[1].out_size(size[1])))


def _pool(g: Guard, call: Call, layer_class: type, options: dict) -> Tensor:
    x = call["input"]
    nchw(g, call, x)
    if call.get("return_indices"):
        raise g.refuse(call.name, "return_indices has no exact rule")
    if call["ceil_mode"]:  # its last windows' geometry: not covered
        return on_gathered(g, call, x, **{k: v for k, v in call.named.items() if k != "input"})
    key = (layer_class, *sorted((k, str(v)) for k, v in options.items()))
    if key not in g.layers:
        g.layers[key] = layer_class(**options, comm=g.comm, grid=g.grid)
    layer = g.layers[key]
    return g.marked(layer(x), size=layer.out_size(g.size_now) if g.size_now else None)


@rule(F.max_pool2d, torch.max_pool2d,
      params="input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, "
      "return_indices=False")  # fmt: skip
def max_pool2d(g: Guard, call: Call) -> Tensor:
    """The spatial pooling layer's halo fetch (Inception's functional pooling); with
    ``ceil_mode=True`` on the gathered whole images, scattered back (warned)."""
    keys = ("kernel_size", "stride", "padding", "dilation")
    return _pool(g, call, spool.SpatialMaxPool2d, {k: call[k] for k in keys})


@rule(F.avg_pool2d,
      params="input, kernel_size, stride=None, padding=0, ceil_mode=False, "
      "count_include_pad=True, divisor_override=None")  # fmt: skip
def avg_pool2d(g: Guard, call: Call) -> Tensor:
    """As ``F.max_pool2d`` (``count_include_pad`` and ``divisor_override`` kept)."""
    keys = ("kernel_size", "stride", "padding", "count_include_pad", "divisor_override")
    return _pool(g, call, spool.SpatialAvgPool2d, {k: call[k] for k in keys})


@rule(F.adaptive_avg_pool2d, F.adaptive_max_pool2d,
      params="input, output_size, return_indices=False")  # fmt: skip
def adaptive_pool2d(g: Guard, call: Call) -> Tensor:
    """To 1x1: a mean (maximum) over H and W, whole (CBAM's channel attention). To another
    size (VGG's 7x7, PSPNet's pyramid): the whole images gathered (one all-gather of this
    feature map) and pooled; the result is whole."""
    x = call["input"]
    nchw(g, call, x)
    if all_(call["output_size"], 1) and not call["return_indices"]:
        if call.func is F.adaptive_avg_pool2d:
            return mean_hw(g, x)
        return extreme(g, x, [2, 3], largest=True)
    return call.func(gather(x, g.comm, g.grid), *call.args[1:], **call.kwargs)


@rule(F.pad, params="input, pad, mode='constant', value=None")
def pad(g: Guard, call: Call) -> Tensor:
    """The padded images' blocks in tensor_split layout: with a constant (negative pads
    crop), each rank fetches its new block's rows (``gather_rows``, the constant outside the
    image); reflect, replicate and circular read mirrored or wrapped rows in three fetches of
    contiguous rows per dimension. Padding of a block whose H or W the forward code read is
    refused (it may be computed for the block), but for timm's "same" modules, whose padding
    becomes the whole images'."""
    x, pads = call["input"], list(call["pad"])
    mode, value = call["mode"], call["value"] or 0.0
    nchw(g, call, x)
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise g.refuse(call.name, f"mode={mode!r} has no rule")
    size = g.size_now or g.grid.global_size(x, call.name)
    lo_w, hi_w, lo_h, hi_h = [*pads, 0, 0, 0, 0][:4]
    if g.was_sized(x):  # even with zero pads here: other ranks' may not be
        whole = compat.same_pads(g.module(), tuple(x.shape[-2:]), size, [lo_w, hi_w, lo_h, hi_h])
        if whole is None:
            raise g.refuse(
                call.name, "the forward code read this block's height or width before padding "
                "it, so its padding may be computed for the block instead of the whole image "
                "(padding to a multiple of a patch size, to a skip connection's size)",
            )  # fmt: skip
        lo_w, hi_w, lo_h, hi_h = whole
    rest = pads[4:]
    if mode != "constant" and (rest or min(pads[:4]) < 0):
        raise g.refuse(call.name, f"mode={mode!r} with pads {pads} (only H and W, >= 0)")
    y = x
    for dim, (n, lo, hi) in ((2, (size[0], lo_h, hi_h)), (3, (size[1], lo_w, hi_w))):
        if mode == "constant":
            comm, parts, _ = g.grid.axis(dim - 2)
            new = tensor_split_sizes(n + lo + hi, parts)
            want = [(a - lo, a - lo + m) for a, m in zip(starts(new), new, strict=True)]
            y = pkf.gather_rows(y, comm, dim, tensor_split_sizes(n, parts), want, value)
        elif lo or hi:
            y = _wrap_pad(g, y, dim, n, lo, hi, mode)
    if rest:  # leading dimensions: local
        y = F.pad(y, [0, 0, 0, 0, *rest], value=value)
    return g.marked(y, size=(size[0] + lo_h + hi_h, size[1] + lo_w + hi_w))


def _source_row(i: int, n: int, mode: str) -> int:
    """The image row that padded row ``i`` (of ``n`` rows, counted from the first image row)
    repeats in F.pad's ``mode``."""
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i if i >= n else i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


def _wrap_pad(g: Guard, x: Tensor, dim: int, n: int, lo: int, hi: int, mode: str) -> Tensor:
    """This rank's block of the whole images padded along ``dim`` by ``lo`` and ``hi`` rows
    in a non-constant ``mode``. Every rank takes part in all three fetches (an empty range
    where its block has no such rows), and keeps each in its graph, so that the backward's
    exchanges meet on every rank."""
    if (mode == "reflect" and max(lo, hi) >= n) or max(lo, hi) > n:
        raise ValueError(
            f"spatial parallelism: F.pad mode={mode!r} of {max(lo, hi)} rows needs more "
            f"rows than the image's {n}"
        )
    comm, parts, rank = g.grid.axis(dim - 2)
    new = tensor_split_sizes(n + lo + hi, parts)
    pieces = []
    for part in range(3):  # the low pad, the image, the high pad
        want, mine = [], []
        for r, (a, m) in enumerate(zip(starts(new), new, strict=True)):
            first, stop = ((a, min(a + m, lo)), (max(a, lo), min(a + m, lo + n)),
                           (max(a, lo + n), a + m))[part]  # fmt: skip
            rows = [_source_row(i - lo, n, mode) for i in range(first, stop)]
            want.append((min(rows), max(rows) + 1) if rows else (0, 0))
            mine = rows if r == rank else mine
        got = pkf.gather_rows(x, comm, dim, tensor_split_sizes(n, parts), want)
        if mine != list(range(want[rank][0], want[rank][1])):  # mirrored or repeated
            order = torch.tensor([i - want[rank][0] for i in mine], device=x.device)
            got = got.index_select(dim, order.long())
        pieces.append(got)
    return torch.cat(pieces, dim)
