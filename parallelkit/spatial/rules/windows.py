"""Window rules: functional convolution, pooling and padding, by the spatial layers' fetches.

Each output block reads a window of input rows (along each spatial dimension: signals,
images and volumes alike) that pure geometry names
(:mod:`parallelkit.geometry`); what a rank does not hold it fetches from the ranks that do, and
backward sends the gradients back. Forward code calls these functionally (a Conv2d subclass,
weight standardization, Inception's ``F.max_pool2d``, a ``padding_mode`` other than zeros), so
the rules run the spatial layers' own code with the call's arguments, ``ceil_mode`` included.
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

import parallelkit.functional as pkf
from parallelkit.geometry import per_dim, starts, tensor_split_sizes
from parallelkit.spatial import adaptive_max, resample
from parallelkit.spatial.conv import conv_blocks, conv_transpose_blocks, conv_windows
from parallelkit.spatial.fetch import empty_output, fetch
from parallelkit.spatial.grid import gather
from parallelkit.spatial.pool import (
    avg_pool_blocks,
    avg_pool_tokens,
    max_pool_blocks,
    max_pool_indices_blocks,
    max_unpool_blocks,
    pool_windows,
)
from parallelkit.spatial.rules.forms import gathered_whole
from parallelkit.spatial.rules.reductions import mean_spatial
from parallelkit.spatial.rules.registry import (
    Call,
    Guard,
    all_,
    channels_first,
    ops,
    rule,
    whole_size,
)
from parallelkit.spatial.rules.tokens import token_dim
from parallelkit.spatial.token_comm import prefix_of, with_prefix

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


def _token_pad(g: Guard, x: Tensor, pads: list[int], mode: str, value: float) -> Tensor | None:
    """Block ``x`` padded by a constant before its token dimension only: on the first rank,
    which holds the prefix, the pad itself; the others keep their tokens (a new tensor).
    None for any other pad."""
    d = token_dim(g, x)
    at = 2 * (-d - 1) if d is not None else len(pads)  # F.pad's order: the last dimension first
    if mode != "constant" or at >= len(pads) or pads[at] <= 0 or any(pads[:at] + pads[at + 1 :]):
        return None
    fold = g.folds(x)[0]
    y = F.pad(x, pads, value=value) if g.grid.at_origin else x.view_as(x)
    return g.marked(y, g.places(x), folds=(with_prefix(fold, prefix_of(fold) + pads[at]),))


@rule(F.pad, params="input, pad, mode='constant', value=None", prefix=True)
def pad(g: Guard, call: Call) -> Tensor:
    """The padded samples' blocks in tensor_split layout: with a constant (negative pads
    crop), each rank fetches its new block's rows (``gather_rows``, the constant outside the
    sample); reflect, replicate and circular read mirrored or wrapped rows in three fetches of
    contiguous rows per dimension. The pads are the whole samples' (a pad computed from
    ``x.shape`` is computed from the whole size: timm's "same" padding, a pad to a multiple
    of a patch size, MONAI's pad to a skip connection's size). Pads of other dimensions only
    are local, on any block (EfficientViT pads its tokens' value vectors with a 1). A
    constant pad before a token dimension only (CoaT's zero row in the class token's place)
    is a prefix of that constant, as a class token (``indexing._class_tokens``). Any other pad
    of a dimension holding folded spatial ones (BotNet's and HaloNet's relative logits,
    skewed to absolute positions by a pad, a flatten and a reshape across rows) runs on the
    whole tensor, all-gathered (``forms.gathered_whole``): what follows is whole, and is cut
    to the blocks where it meets them (the attention scores)."""
    x, pads = call["input"], list(call["pad"])
    mode, value = call["mode"], call["value"] or 0.0
    padded = {x.dim() - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]}
    if not padded & {x.dim() + d for d in g.places(x)}:
        return g.marked(call.run(), g.places(x))
    if g.folds(x):
        if (y := _token_pad(g, x, pads, mode, value)) is not None:
            return y
        if (whole := gathered_whole(g, x)) is None:
            raise g.refuse(call.name, "it pads a dimension that holds folded spatial ones")
        return F.pad(whole, pads, mode, call["value"])  # a relative-to-absolute skew: whole
    last = tuple(range(-len(g.places(x)), 0))
    if g.places(x) != last:  # channels last (Swin's pads): the same on (N, C, *spatial)
        return _pad_moved(g, x, pads, mode, call["value"])
    ndim = channels_first(g, call, x)
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise g.refuse(call.name, f"mode={mode!r} has no rule")
    size = whole_size(g, x)
    spatial = [*pads, *[0] * (2 * ndim)][: 2 * ndim]  # F.pad's order: the last dimension first
    rest = pads[2 * ndim :]
    if mode != "constant" and (rest or min(spatial) < 0):
        raise g.refuse(call.name, f"mode={mode!r} with pads {pads} (only the spatial "
                       "dimensions, >= 0)")  # fmt: skip
    y, axes, new_size = x, g.grid.axes(ndim), []
    for d in range(ndim):
        n, (comm, parts, _) = size[d], axes[d]
        lo, hi = spatial[2 * (ndim - 1 - d)], spatial[2 * (ndim - 1 - d) + 1]
        if mode == "constant":
            new = tensor_split_sizes(n + lo + hi, parts)
            want = [(a - lo, a - lo + m) for a, m in zip(starts(new), new, strict=True)]
            y = pkf.gather_rows(y, comm, 2 + d, tensor_split_sizes(n, parts), want, value)
        elif lo or hi:
            y = _wrap_pad(g, y, 2 + d, n, lo, hi, mode)
        new_size.append(n + lo + hi)
    if rest:  # leading dimensions: local
        y = F.pad(y, [0, 0] * ndim + rest, value=value)
    return g.marked(y, size=tuple(new_size))


def _pad_moved(g: Guard, x: Tensor, pads: list[int], mode: str, value: Any) -> Tensor:
    """``F.pad`` of a block whose spatial dimensions are not last: moved last (the others
    keep their order), padded with the pads moved alike, and moved back."""
    at = tuple(x.dim() + d for d in g.places(x))
    order = [d for d in range(x.dim()) if d not in at] + list(at)
    per = {x.dim() - 1 - i: pads[2 * i : 2 * i + 2] for i in range(len(pads) // 2)}
    moved_pads = [v for d in reversed(order) for v in per.get(d, (0, 0))]
    last = tuple(range(x.dim() - len(at), x.dim()))
    with g.rules():
        y = F.pad(x.movedim(at, last), moved_pads, mode, value)
        return y.movedim(last, at)


def _source_row(i: int, n: int, mode: str) -> int:
    """The sample's row that padded row ``i`` (of ``n`` rows, counted from the first row)
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
            f"rows than the sample's {n}"
        )
    comm, parts, rank = g.grid.axes(x.dim() - 2)[dim - 2]
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


@rule(*ops("roll", torch, Tensor), params="input, shifts, dims=None")
def roll(g: Guard, call: Call) -> Tensor:
    """A cyclic shift (Swin's shifted windows): along other dimensions local; along a split
    one, each rank's new rows are the sample's rows ``shift`` before them, wrapped around, in
    at most two contiguous runs that two row fetches bring from whoever holds them."""
    x, shifts, dims = call["input"], call["shifts"], call["dims"]
    if dims is None:
        raise g.refuse(call.name, "it acts on the flattened tensor")
    shifts = shifts if isinstance(shifts, tuple | list) else (shifts,)
    dims = dims if isinstance(dims, tuple | list) else (dims,)
    record = g.places(x)
    size, axes = whole_size(g, x), g.grid.axes(len(record))
    y = x
    for shift, dim in zip(shifts, dims, strict=True):
        d = dim % x.dim() - x.dim()
        if d not in record:
            y = torch.roll(y, shift, d)
            continue
        k = record.index(d)
        n, (comm, parts, _) = size[k], axes[k]
        sizes = tensor_split_sizes(n, parts)
        runs: list[list[tuple[int, int]]] = [[], []]
        for a, m in zip(starts(sizes), sizes, strict=True):
            first = (a - shift) % n
            runs[0].append((first, min(n, first + m)))
            runs[1].append((0, m - (runs[0][-1][1] - first)))
        y = torch.cat([pkf.gather_rows(y, comm, d, sizes, want) for want in runs], d)
    return g.marked(y, record)


@rule(*ops("flip", torch, Tensor), params="input, dims")
def flip(g: Guard, call: Call) -> Tensor:
    """A reversal (a flip written into the forward, as test-time flips are): along other
    dimensions local; along a split one, each rank's new rows are the sample's rows at the
    mirror of its place, ``n - stop`` to ``n - start``, one row fetch from whoever holds them,
    then reversed."""
    x, dims = call["input"], call["dims"]
    dims = [d % x.dim() - x.dim() for d in (dims if isinstance(dims, tuple | list) else (dims,))]
    record = g.places(x)
    if len(set(dims)) < len(dims) or not dims:
        return g.marked(call.run(), record)  # torch's error for a dimension named twice
    size, axes = whole_size(g, x), g.grid.axes(len(record))
    y = x
    for d in dims:
        if d not in record:
            y = y.flip(d)
            continue
        k = record.index(d)
        n, (comm, parts, _) = size[k], axes[k]
        sizes = tensor_split_sizes(n, parts)
        y = pkf.gather_rows(y, comm, d, sizes, _mirrored(sizes, n)).flip(d)
    return g.marked(y, record)


def _mirrored(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Per block of ``sizes`` (of ``n`` rows), the rows at the mirror of its place."""
    return [(n - a - m, n - a) for a, m in zip(starts(sizes), sizes, strict=True)]
