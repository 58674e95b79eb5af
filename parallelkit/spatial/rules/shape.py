"""Shape rules: views, permutes, joins, cuts and indexing, local where the spatial dimensions
stay whole.

A block's spatial dimensions (H and W; D, H and W; L) may move (ConvNeXt permutes to channels
last and back: the record follows them, ``g.dims``), but they must stay separate dimensions,
each whole in its place: merging, cutting, indexing or joining along them would need the other
ranks' pixels, so it is refused. Reads of a block's shape are noted (``g.note_sized``): sizes
computed from them are the block's, not the sample's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parallelkit.spatial.rules.registry import PROPERTY, Call, Dims, Guard, ops, prop, rule


def _positions(g: Guard, x: Tensor) -> tuple[int, ...]:
    """Where block ``x``'s spatial dimensions are, counted from the front."""
    return tuple(x.dim() + d for d in g.dims(x))


def _without(dims: Dims, removed: list[int], ndim: int) -> Dims:
    """``dims`` after the dimensions ``removed`` (from the front, none of them spatial) are
    gone: those after a spatial dimension bring it nearer the end."""
    return tuple(d + sum(r > ndim + d for r in removed) for d in dims)


@rule(*ops("view reshape flatten unflatten view_as reshape_as squeeze unsqueeze", torch, Tensor),
      params="input, *_, **__")  # fmt: skip
def reshape(g: Guard, call: Call) -> Any:
    """Local where the dimensions from the first spatial one on come out unchanged (only
    leading ones regrouped)."""
    x, out = call["input"], call.run()
    dims = g.dims(x)
    k = -min(dims)
    if isinstance(out, Tensor) and out.dim() >= k and out.shape[-k:] == x.shape[-k:]:
        return g.marked(out, dims)
    # The spatial sizes by name: a block's differ by rank (uneven splits), and a refusal must
    # read the same on every rank.
    named = list(map(str, x.shape))
    names = {1: "L", 2: "HW", 3: "DHW"}[len(dims)]
    for name, at in zip(names, _positions(g, x), strict=True):
        named[at] = name
    into = f"{out.dim()} dimensions" if isinstance(out, Tensor) else type(out).__name__
    raise g.refuse(
        call.name, f"({', '.join(named)}) -> {into} merges or splits a spatial dimension"
    )


@rule(*ops("permute transpose swapaxes swapdims movedim moveaxis", torch, Tensor),
      params="input, *_, **__")  # fmt: skip
def permute(g: Guard, call: Call) -> Any:
    """Local; the record follows the spatial dimensions to their new places (channels last
    and back)."""
    x, out = call["input"], call.run()
    probe = torch.empty((1,) * x.dim(), device="meta").as_strided(
        x.shape, tuple(range(1, x.dim() + 1))
    )  # strides 1..n tell which input dimension lands where
    moved = call.func(probe, *call.args[1:], **call.kwargs).stride()
    strides = [x.dim() + d + 1 for d in g.dims(x)]  # the strides the spatial dimensions had
    if all(s in moved for s in strides):
        return g.marked(out, tuple(moved.index(s) - out.dim() for s in strides))
    raise g.refuse(call.name, "it loses track of a spatial dimension")


@rule(*ops("repeat", Tensor), params="input, *sizes")
def repeat(g: Guard, call: Call) -> Any:
    """Local where every spatial dimension is repeated once (MONAI's VNet repeats channels
    only); new leading dimensions may be added."""
    x, sizes = call["input"], call["sizes"]
    if len(sizes) == 1 and not isinstance(sizes[0], int):
        sizes = tuple(sizes[0])
    dims = g.dims(x)
    if any(int(sizes[len(sizes) + d]) != 1 for d in dims):
        raise g.refuse(call.name, f"it repeats a spatial dimension (sizes {tuple(sizes)})")
    return g.marked(call.run(), dims)


@rule(*ops("expand_as", Tensor), params="input, other")
def expand_as(g: Guard, call: Call) -> Any:
    """Local: a block expanded along non-spatial dimensions of size 1, or a whole tensor of
    size 1 in the spatial dimensions (timm's ECA gate, (N, C, 1, 1)) expanded to a block,
    whose gradient is then each rank's share of the dense one (summed, as in pointwise)."""
    x, other = call["input"], call["other"]
    dims = g.dims(other) if g.is_split(other) else g.dims(x)
    if g.is_split(x):
        if not g.is_split(other) or g.dims(other) != dims:
            raise g.refuse(call.name, "it expands a block to a tensor of another layout")
        return g.marked(x.expand_as(other), dims)
    if any(x.dim() >= -d and x.shape[d] != 1 for d in dims):
        raise g.refuse(call.name, f"a whole tensor of shape {tuple(x.shape)} varies over a "
                       "spatial dimension")  # fmt: skip
    return g.marked(g.summed(x).expand_as(other), dims)


def _along(g: Guard, call: Call, dim: int) -> int:
    """``dim`` from the front, refused if it is H or W."""
    x = call.blocks[0]
    d = dim % x.dim()
    if d in _positions(g, x):
        raise g.refuse(call.name, "it cuts along a spatial dimension")
    return d


@rule(*ops("split chunk tensor_split split_with_sizes", torch, Tensor),
      params="input, sections=None, dim=0, *_, **__")  # fmt: skip
def split(g: Guard, call: Call) -> Any:
    """Local along channels or the batch (or the channels of a channels-last block)."""
    _along(g, call, call["dim"])
    return g.marked(call.run(), g.dims(call["input"]))


@rule(*ops("narrow", torch, Tensor), params="input, dim, start, length")
@rule(*ops("index_select", torch, Tensor), params="input, dim, index, *, out=None")
@rule(*ops("flip", torch, Tensor), params="input, dims")
@rule(*ops("roll", torch, Tensor), params="input, shifts, dims=None")
@rule(*ops("cumsum cumprod", torch, Tensor), params="input, dim, *, dtype=None, out=None")
def along(g: Guard, call: Call) -> Any:
    """Local along any dimension but the spatial ones (``narrow``, ``index_select``,
    ``flip``, ``roll``, ``cumsum`` over channels)."""
    dims = call.get("dim", call.get("dims"))
    if dims is None or call.get("out") is not None:
        raise g.refuse(call.name, "it acts on the flattened tensor")
    for d in dims if isinstance(dims, tuple | list) else (dims,):
        _along(g, call, d)
    return g.marked(call.run(), g.dims(call["input"]))


@rule(*ops("unbind select", torch, Tensor), params="input, dim=0, index=None")
def unbind(g: Guard, call: Call) -> Any:
    """Local along channels or the batch: the dimension goes away."""
    x = call["input"]
    d = _along(g, call, call["dim"])
    return g.marked(call.run(), _without(g.dims(x), [d], x.dim()))


@rule(torch.cat, torch.concat, torch.concatenate, torch.stack,
      params="tensors, dim=0, *, out=None")  # fmt: skip
def cat(g: Guard, call: Call) -> Any:
    """Local when every tensor is a block of one layout, joined along another dimension."""
    tensors, dim = call["tensors"], call["dim"]
    dims = g.dims(call.blocks[0])
    if all(g.is_split(t) and g.dims(t) == dims for t in tensors) and call["out"] is None:
        ndim = tensors[0].dim()
        if call.func is not torch.stack and dim % ndim - ndim not in dims:
            return g.marked(call.run(), dims)
        if call.func is torch.stack:  # a new dimension before or after the spatial ones
            d = dim % (ndim + 1)
            if d <= ndim + min(dims):
                return g.marked(call.run(), dims)
            if d > ndim + max(dims):
                return g.marked(call.run(), tuple(v - 1 for v in dims))
    raise g.refuse(call.name, "it joins blocks with whole tensors, or along a spatial dimension")


def _full(entry: Any) -> bool:
    return (
        isinstance(entry, slice)
        and entry == slice(entry.start, None, entry.step)
        and (entry.start in (None, 0) and entry.step in (None, 1))
    )


@rule(Tensor.__getitem__, params="input, index")
def getitem(g: Guard, call: Call) -> Any:
    """Local when the spatial dimensions are taken whole (``x[:, :16]``, ``x[:, :16, :, :]``,
    ``x[:, idx]`` with a channel index tensor, ``x[..., :16]`` on a channels-last block);
    index tensors only before the spatial dimensions."""
    x, index = call["input"], call["index"]
    entries = list(index) if isinstance(index, tuple) else [index]
    width = [
        0 if e is None else e.dim() if isinstance(e, Tensor) and e.dtype == torch.bool else 1
        for e in entries
    ]  # the input dimensions each entry consumes
    if entries.count(Ellipsis) > 1:
        raise g.refuse("indexing", f"the index {index!r} has two ellipses")
    if Ellipsis in entries:
        width[entries.index(Ellipsis)] = x.dim() - (sum(width) - 1)
    spatial = _positions(g, x)
    lo, hi = min(spatial), max(spatial)
    first, out = 0, []  # the next input dimension; the input dimension of each output one
    for e, n in zip(entries, width, strict=True):
        consumed = range(first, first + n)
        kept = e is Ellipsis or _full(e)
        if not kept and any(d in spatial for d in consumed):
            raise g.refuse("indexing", f"the index {index!r} reaches a spatial dimension")
        if e is None and lo < first <= hi:
            raise g.refuse("indexing", f"the index {index!r} adds a dimension among the spatial")
        if isinstance(e, Tensor) and first > lo:
            raise g.refuse("indexing", f"the index {index!r} has an index tensor after a spatial "
                           "dimension (advanced indices may move dimensions)")  # fmt: skip
        if e is None or isinstance(e, Tensor):
            out.append(None)  # a new dimension, or an index tensor's (before the spatial ones)
        elif not isinstance(e, int):
            out += list(consumed)
        first += n
    out += list(range(first, x.dim()))  # dimensions left unindexed
    return g.marked(call.run(), tuple(out.index(d) - len(out) for d in spatial))


_METADATA = """
size dim ndimension numel nelement element_size is_contiguous is_floating_point is_complex
get_device data_ptr stride storage_offset __len__ __repr__ __format__ __hash__ register_hook
"""


@rule(PROPERTY, *ops(_METADATA, Tensor), prop("shape"))
def metadata(g: Guard, call: Call) -> Any:
    """Answered from the block (its own shape: noted, so that sizes computed from it are
    known to be the block's)."""
    if call.func in (Tensor.size, prop("shape")):
        dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
        g.note_sized(call.blocks[0], dim)
    return call.run()


@rule(prop("data"))
def data(g: Guard, call: Call) -> Any:
    """The same block, without its history."""
    return g.marked(call.run(), g.dims(call.blocks[0]))


@rule(prop("T"), prop("mT"), prop("H"), prop("mH"), exact="refused")
def transposed(g: Guard, call: Call) -> Any:
    """Refused: reverses or swaps the last dimensions."""
    raise g.refuse(call.name, "it moves the spatial dimensions")
