"""Shape rules: views, permutes, joins, cuts and indexing, local where H and W stay whole.

A block's H and W may move (ConvNeXt permutes to channels last and back: the record follows
them, ``g.hw``), but they must stay separate dimensions, each whole in its place: merging,
cutting, indexing or joining along them would need the other ranks' pixels, so it is refused.
Reads of a block's shape are noted (``g.note_sized``): sizes computed from them are the
block's, not the image's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parallelkit.spatial.rules.registry import PROPERTY, Call, Guard, ops, prop, rule

HW = tuple[int, int]


def _positions(g: Guard, x: Tensor) -> tuple[int, int]:
    """Where block ``x``'s H and W are, counted from the front."""
    h, w = g.hw(x)
    return x.dim() + h, x.dim() + w


def _without(hw: HW, removed: list[int], ndim: int) -> HW:
    """``hw`` after the dimensions ``removed`` (from the front, none of them H or W) are gone:
    those after H (after W) bring H (W) nearer the end."""
    h, w = ndim + hw[0], ndim + hw[1]
    return hw[0] + sum(d > h for d in removed), hw[1] + sum(d > w for d in removed)


@rule(*ops("view reshape flatten unflatten view_as reshape_as squeeze unsqueeze", torch, Tensor),
      params="input, *_, **__")  # fmt: skip
def reshape(g: Guard, call: Call) -> Any:
    """Local where the dimensions from H on come out unchanged (only leading ones regrouped)."""
    x, out = call["input"], call.run()
    hw = g.hw(x)
    k = -min(hw)
    if isinstance(out, Tensor) and out.dim() >= k and out.shape[-k:] == x.shape[-k:]:
        return g.marked(out, hw)
    shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
    raise g.refuse(call.name, f"{tuple(x.shape)} -> {shape} merges H or W")


@rule(*ops("permute transpose swapaxes swapdims movedim moveaxis", torch, Tensor),
      params="input, *_, **__")  # fmt: skip
def permute(g: Guard, call: Call) -> Any:
    """Local; the record follows H and W to their new places (channels last and back)."""
    x, out = call["input"], call.run()
    probe = torch.empty((1,) * x.dim(), device="meta").as_strided(
        x.shape, tuple(range(1, x.dim() + 1))
    )  # strides 1..n tell which input dimension lands where
    moved = call.func(probe, *call.args[1:], **call.kwargs).stride()
    h, w = (x.dim() + d + 1 for d in g.hw(x))  # the strides H and W had
    if h in moved and w in moved:
        return g.marked(out, (moved.index(h) - out.dim(), moved.index(w) - out.dim()))
    raise g.refuse(call.name, "it moves H or W out of the last two dimensions")


def _along(g: Guard, call: Call, dim: int) -> int:
    """``dim`` from the front, refused if it is H or W."""
    x = call.blocks[0]
    d = dim % x.dim()
    if d in _positions(g, x):
        raise g.refuse(call.name, "it cuts along H or W")
    return d


@rule(*ops("split chunk tensor_split split_with_sizes", torch, Tensor),
      params="input, sections=None, dim=0, *_, **__")  # fmt: skip
def split(g: Guard, call: Call) -> Any:
    """Local along channels or the batch (or the channels of a channels-last block)."""
    _along(g, call, call["dim"])
    return g.marked(call.run(), g.hw(call["input"]))


@rule(*ops("narrow", torch, Tensor), params="input, dim, start, length")
@rule(*ops("index_select", torch, Tensor), params="input, dim, index, *, out=None")
@rule(*ops("flip", torch, Tensor), params="input, dims")
@rule(*ops("roll", torch, Tensor), params="input, shifts, dims=None")
@rule(*ops("cumsum cumprod", torch, Tensor), params="input, dim, *, dtype=None, out=None")
def along(g: Guard, call: Call) -> Any:
    """Local along any dimension but H and W (``narrow``, ``index_select``, ``flip``,
    ``roll``, ``cumsum`` over channels)."""
    dims = call.get("dim", call.get("dims"))
    if dims is None or call.get("out") is not None:
        raise g.refuse(call.name, "it acts on the flattened tensor")
    for d in dims if isinstance(dims, tuple | list) else (dims,):
        _along(g, call, d)
    return g.marked(call.run(), g.hw(call["input"]))


@rule(*ops("unbind select", torch, Tensor), params="input, dim=0, index=None")
def unbind(g: Guard, call: Call) -> Any:
    """Local along channels or the batch: the dimension goes away."""
    x = call["input"]
    d = _along(g, call, call["dim"])
    return g.marked(call.run(), _without(g.hw(x), [d], x.dim()))


@rule(torch.cat, torch.concat, torch.concatenate, torch.stack,
      params="tensors, dim=0, *, out=None")  # fmt: skip
def cat(g: Guard, call: Call) -> Any:
    """Local when every tensor is a block of one layout, joined along another dimension."""
    tensors, dim = call["tensors"], call["dim"]
    hw = g.hw(call.blocks[0])
    if all(g.is_split(t) and g.hw(t) == hw for t in tensors) and call["out"] is None:
        ndim = tensors[0].dim()
        if call.func is not torch.stack and dim % ndim - ndim not in hw:
            return g.marked(call.run(), hw)
        if call.func is torch.stack:  # a new dimension before H or after W
            d = dim % (ndim + 1)
            if d <= ndim + hw[0]:
                return g.marked(call.run(), hw)
            if d > ndim + hw[1]:
                return g.marked(call.run(), (hw[0] - 1, hw[1] - 1))
    raise g.refuse(call.name, "it joins blocks with whole tensors, or along H or W")


def _full(entry: Any) -> bool:
    return (
        isinstance(entry, slice)
        and entry == slice(entry.start, None, entry.step)
        and (entry.start in (None, 0) and entry.step in (None, 1))
    )


@rule(Tensor.__getitem__, params="input, index")
def getitem(g: Guard, call: Call) -> Any:
    """Local when H and W are taken whole (``x[:, :16]``, ``x[:, :16, :, :]``, ``x[:, idx]``
    with a channel index tensor, ``x[..., :16]`` on a channels-last block); indices tensors
    only before H."""
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
    h, w = _positions(g, x)
    first, after = 0, 0  # the next input dimension, output dimensions after W
    for e, n in zip(entries, width, strict=True):
        dims = range(first, first + n)
        if e is Ellipsis:
            reaching = [d for d in dims if d >= h]
            after += sum(d > w for d in dims)
        else:
            reaching = [d for d in dims if h <= d <= w]
            if first > w:
                after += 0 if isinstance(e, int) else 1
                if isinstance(e, Tensor):
                    reaching = [w]  # advanced indices after W would move dimensions
            elif e is None and first > h:
                reaching = [h]  # a new dimension between or after H and W
        if reaching and not (e is Ellipsis or _full(e)):
            raise g.refuse("indexing", f"the index {index!r} reaches H or W")
        first += n
    after += max(x.dim() - max(first, w + 1), 0)  # dimensions left unindexed after W
    return g.marked(call.run(), (-(after + 1) - (w - h), -(after + 1)))


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
    return g.marked(call.run(), g.hw(call.blocks[0]))


@rule(prop("T"), prop("mT"), prop("H"), prop("mH"), exact="refused")
def transposed(g: Guard, call: Call) -> Any:
    """Refused: reverses or swaps the last dimensions."""
    raise g.refuse(call.name, "it moves H and W")
