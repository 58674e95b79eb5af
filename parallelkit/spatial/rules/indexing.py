"""Indexing and joining rules: ``cat`` and ``stack``, ``split``, ``narrow``, ``select``,
``x[...]`` and ``x[...] = v``, local where the spatial dimensions are taken whole.

Along a spatial dimension: a slice with a step is local where the blocks are whole groups of
it, else each rank fetches its rows; a slice of step 1 is a crop, ``F.pad``'s rule by
negative pads. Whole tensors joined before a token dimension (class tokens) are its prefix,
held by the first rank; whole integer indices into a block's tokens take each token from the
rank that holds it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelkit.geometry import blocks, starts, tensor_split_sizes
from parallelkit.spatial import record
from parallelkit.spatial.rules.forms import cut_whole
from parallelkit.spatial.rules.registry import (
    Call,
    Fold,
    Guard,
    Places,
    fold_place,
    ops,
    rule,
    whole_shape,
    whole_size,
)
from parallelkit.spatial.rules.tokens import count, own_tokens, token_dim
from parallelkit.spatial.rules.views import Move, _positions, _rows_moved, _without
from parallelkit.spatial.token_comm import (
    box,
    fold_count,
    prefix_of,
    prefixed,
    with_prefix,
)


def _along(g: Guard, call: Call, dim: int) -> int:
    """``dim`` from the front, refused if it is H or W."""
    x = call.blocks[0]
    d = dim % x.dim()
    if d in _positions(g, x):
        raise g.refuse(call.name, "it cuts along a spatial dimension")
    return d


@rule(*ops("split chunk tensor_split split_with_sizes", torch, Tensor),
      params="input, sections=None, dim=0, *_, **__", prefix=True)  # fmt: skip
def split(g: Guard, call: Call) -> Any:
    """Local along channels or the batch (or the channels of a channels-last block)."""
    _along(g, call, call["dim"])
    return g.marked(call.run(), g.places(call["input"]))


@rule(*ops("narrow", torch, Tensor), params="input, dim, start, length")
@rule(*ops("index_select", torch, Tensor), params="input, dim, index, *, out=None")
def along(g: Guard, call: Call) -> Any:
    """Local along any dimension but the spatial ones (``narrow`` and ``index_select`` over
    channels)."""
    dims = call.get("dim", call.get("dims"))
    if dims is None or call.get("out") is not None:
        raise g.refuse(call.name, "it acts on the flattened tensor")
    for d in dims if isinstance(dims, tuple | list) else (dims,):
        _along(g, call, d)
    return g.marked(call.run(), g.places(call["input"]))


@rule(*ops("unbind select", torch, Tensor), params="input, dim=0, index=None", prefix=True)
def unbind(g: Guard, call: Call) -> Any:
    """Local along channels or the batch: the dimension goes away."""
    x = call["input"]
    d = _along(g, call, call["dim"])
    return g.marked(call.run(), _without(g.places(x), [d], x.dim()))


@rule(torch.cat, torch.concat, torch.concatenate, torch.stack,
      params="tensors, dim=0, *, out=None", prefix=True)  # fmt: skip
def cat(g: Guard, call: Call) -> Any:
    """Local when every tensor is a block of one layout, joined along another dimension; a
    whole tensor among them of the whole samples' size is cut to the block first
    (CoordConv's coordinate maps). Whole tensors joined before a token dimension (ViT's
    class token, DeiT's distillation token) are its prefix, held by the first rank in front
    of its tokens: an uneven split of the tokens, nothing moved."""
    tensors, dim, first = list(call["tensors"]), call["dim"], call.blocks[0]
    dims = g.places(first)
    if call.func is not torch.stack and (y := _class_tokens(g, call, tensors, dim)) is not None:
        return y
    if call["out"] is None and all(t.dim() == first.dim() for t in tensors):
        size = whole_size(g, first)
        tensors = [t if g.is_split(t) else g.marked(cut_whole(g, t, first, call.name), dims, size)
                   for t in tensors]  # fmt: skip
    if all(g.is_split(t) and g.form(t) == g.form(first) for t in tensors) and call["out"] is None:
        ndim, run = tensors[0].dim(), lambda: call.func(tensors, dim)
        if call.func is not torch.stack and dim % ndim - ndim not in dims:
            return g.marked(run(), dims)
        if call.func is torch.stack:  # a new dimension before or after the spatial ones
            d = dim % (ndim + 1)
            if d <= ndim + min(dims):
                return g.marked(run(), dims)
            if d > ndim + max(dims):
                return g.marked(run(), tuple(v - 1 for v in dims))
    raise g.refuse(call.name, "it joins blocks with whole tensors, or along a spatial dimension")


def _class_tokens(g: Guard, call: Call, tensors: list[Any], dim: int) -> Tensor | None:
    """``torch.cat((cls, x), dim)``: whole tensors (a class token, a distillation token)
    before a block's token dimension. They become its prefix (see ``registry.Fold``), held
    by the group's first rank, in front of its tokens; the others keep theirs, with a new
    tensor (the whole ones taken for none of their tokens, so that every rank's backward
    meets their gradient's collective alike). None where the call is not this pattern."""
    x, ndim = call.blocks[0], call.blocks[0].dim()
    d = dim % ndim - ndim if isinstance(dim, int) else None
    if len(call.blocks) != 1 or call["out"] is not None or token_dim(g, x) != d:
        return None
    at = next(i for i, t in enumerate(tensors) if t is x)
    whole = tensors[:at]
    if not whole or tensors[at + 1 :] or any(t.dim() != ndim for t in whole):
        return None
    fold = g.folds(x)[0] if g.folds(x) else ((whole_size(g, x)[0], 0),)
    added = sum(t.shape[d] for t in whole)
    first = g.grid.at_origin
    parts = [g.summed(t) if first else g.summed(t).narrow(d, 0, 0) for t in whole]
    y = torch.cat([*parts, x], dim)
    return g.marked(y, g.places(x), folds=(with_prefix(fold, prefix_of(fold) + added),))


def _token_folds(fold: Fold) -> tuple[Fold, ...]:
    """The record's folds of a token dimension of factors ``fold``: none for a signal's own
    length (one spatial factor, no prefix), as an unfolded signal is recorded."""
    return () if len(fold) == 1 and fold[0][1] == 0 else (fold,)


def _entry_at(entries: list, ndim: int, t: int) -> int | None:
    """Which of the index ``entries`` (one ellipsis at most, ``None`` for new dimensions,
    one input dimension each otherwise) indexes dimension ``t`` of an ``ndim``-dimensional
    tensor; None where none does."""
    consumed = sum(e is not None and e is not Ellipsis for e in entries)
    pos = 0
    for i, e in enumerate(entries):
        if e is Ellipsis:
            pos += ndim - consumed
        elif e is not None:
            if pos == t:
                return i
            pos += 1
    return None


def _token_entry(x: Tensor, t: int, index: Any, n: int) -> tuple[list, int, range] | None:
    """The entries of basic ``index`` into ``x``, which of them indexes dimension ``t`` (of
    ``n`` whole tokens) and the tokens it keeps (a step of 1); None where none does, or it
    keeps all or none of them, or steps, or the index holds a tensor."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(e, Tensor) for e in entries):
        return None
    at = _entry_at(entries, x.dim(), t)
    if at is None:
        return None
    e = entries[at]
    kept = range(n)[e] if isinstance(e, slice) else range(n)[e : e + 1 or None]
    if kept == range(n) or kept.step != 1 or not kept:
        return None
    return entries, at, kept


def _prefix_index(g: Guard, x: Tensor, index: Any) -> Tensor | None:
    """``x[:, 0]`` or ``x[:, :1]`` (the class token: whole on every rank, from the first
    rank, which holds it) and ``x[:, 1:]`` (the tokens after it: a block) on block ``x``
    whose token dimension has a prefix, with any basic index of the other dimensions; None
    where the index leaves the token dimension whole, or takes tokens past the prefix (the
    general rule then takes it, or refuses)."""
    fold, t = g.folds(x)[0], x.dim() + g.places(x)[0]
    p, n = prefix_of(fold), fold_count(fold)
    found = _token_entry(x, t, index, n)
    if found is None:
        return None
    entries, at, kept = found
    e = entries[at]
    first = g.grid.at_origin
    if kept.stop <= p:  # class tokens: whole, from the first rank
        if first:
            mine = x.narrow(t, kept.start, len(kept))
        else:  # none of its own, but in the graph: its backward meets the collective
            shape = (*x.shape[:t], len(kept), *x.shape[t + 1 :])
            mine = torch.cat([x.narrow(t, 0, 0), x.new_zeros(shape)], t)
        entries[at] = 0 if isinstance(e, int) else slice(None)
        return record.summed(mine, g.comm)[tuple(entries)]
    if kept.start > p or kept.stop != n or isinstance(e, int):
        return None
    y = x.narrow(t, kept.start, x.shape[t] - kept.start) if first else x.view_as(x)
    y = g.marked(y, g.places(x), folds=_token_folds(with_prefix(fold, p - kept.start)))
    entries[at] = slice(None)
    with g.rules():
        return y[tuple(entries)] if isinstance(index, tuple) else y


def _token_take(g: Guard, x: Tensor, index: Any) -> Tensor | None:
    """``x[..., ids, ...]``: whole integer indices into block ``x``'s token dimension (MAE's
    random choice of the tokens to keep, ``x[arange(B)[:, None], ids]``), with whole index
    tensors or basic indices elsewhere. The result is whole: each rank takes the tokens it
    holds and a zero for every other (a zero token after its block, where those point), and
    the group sums them, each token coming from the one rank that holds it. None for any
    other index (a boolean mask, a block as the index, tokens with a prefix)."""
    d = token_dim(g, x)
    if d is None or prefixed(g.folds(x)):
        return None
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(e, Tensor) and (e.dtype == torch.bool or g.is_split(e)) for e in entries):
        return None
    t = x.dim() + d
    at = _entry_at(entries, x.dim(), t)
    ids = entries[at] if at is not None else None
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex():
        return None
    n, have = count(g, x), x.shape[t]
    where = torch.full((n,), have, dtype=torch.long, device=x.device)  # others': the zero
    where[own_tokens(g, x)] = torch.arange(have, device=x.device)
    ids = ids.to(x.device)
    entries[at] = where[torch.where(ids < 0, ids + n, ids)]  # past the whole end: IndexError
    zero = x.new_zeros((*x.shape[:t], 1, *x.shape[t + 1 :]))
    return record.summed(torch.cat([x, zero], t)[tuple(entries)], g.comm)


def _indexed(
    g: Guard, x: Tensor, index: Any, size: tuple[int, ...]
) -> tuple[Places, Any, dict[int, tuple[int, int]], tuple[int, ...], dict[int, tuple]]:
    """Where the spatial dimensions of block ``x`` are after ``x[index]``, the index to apply to
    the block, the rows each spatial dimension keeps, by its place in the record, where a
    slice of step 1 cuts it (``x[:, :, 1:-1]``; a slice to the whole size keeps them all),
    the whole spatial size after the index, and the rows to move before it, by the same
    key: (the dimension of ``x``, have, want). A slice with a step (patch merging's
    ``x[..., 0::2, 0::2, :]``) is local where every rank's rows it keeps are its block of
    the kept rows, else those rows are fetched first (:func:`_strided`). Refused: an
    integer or an index tensor along a spatial dimension, or any index into a fold (a
    window partition's, a token dimension) but one that keeps all of it (``:``, ``0:``).
    ``size``: ``x``'s whole spatial size."""
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
    folded = {x.dim() + fold_place(g, x, fold) for fold in g.folds(x)}
    shape, new_size = whole_shape(g, x, size), list(size)
    lo, hi = min(spatial), max(spatial)
    first, out, local, crops = 0, [], [], {}  # out: the input dimension of each output one
    moves: dict[int, tuple] = {}
    for e, n in zip(entries, width, strict=True):
        consumed = range(first, first + n)
        if first in folded and n == 1 and e is not Ellipsis:
            whole = range(shape[first])
            if not (isinstance(e, slice) and whole[e] == whole):  # all of it: ViT's x[:, 0:]
                raise g.refuse("indexing", f"the index {index!r} reaches into windows folded "
                               "into one dimension")  # fmt: skip
            e = slice(None)
        elif first in spatial and n == 1 and e is not Ellipsis:
            if not isinstance(e, slice):
                raise g.refuse("indexing", f"the index {index!r} reaches a spatial dimension")
            k = spatial.index(first)
            rows = range(shape[first])[e]
            if len(rows) == 0:
                raise g.refuse("indexing", f"the index {index!r} keeps no row of a spatial "
                               "dimension")  # fmt: skip
            if rows.step != 1:
                e, move = _strided(g, x, k, rows)
                if move is not None:
                    moves[k] = (first, *move)
                new_size[k] = len(rows)
            else:
                if len(rows) != shape[first]:
                    crops[k] = (rows.start, rows.stop)
                e = slice(None)
        elif any(d in spatial for d in consumed) and e is not Ellipsis:
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
        local.append(e)
        first += n
    out += list(range(first, x.dim()))  # dimensions left unindexed
    dims = tuple(out.index(d) - len(out) for d in spatial)
    if crops and new_size != list(size):
        raise g.refuse("indexing", f"the index {index!r} both steps over and cuts spatial "
                       "dimensions")  # fmt: skip
    index = tuple(local) if isinstance(index, tuple) else local[0]
    return dims, index, crops, tuple(new_size), moves


def _strided(g: Guard, x: Tensor, k: int, rows: range) -> tuple[slice, Move | None]:
    """This rank's slice of block ``x`` along spatial dimension ``k`` for the whole sample's
    ``rows`` (a step > 1), and the rows to move first, if any. Where the rows every rank keeps
    are its block of them in tensor_split layout (blocks of even sizes for a step of 2 from
    row 0 or 1), none; else each rank first fetches the rows from its first kept row to its
    last (its block of the kept rows, from the neighbours that hold them) and slices those:
    ``(have, want)`` row blocks of the dimension over its ranks."""
    n, axis = whole_size(g, x)[k], g.grid.axes(len(g.places(x)))[k]
    _, parts, mine = axis
    have, want = tensor_split_sizes(n, parts), tensor_split_sizes(len(rows), parts)
    firsts = [max(0, -(-(a - rows.start) // rows.step)) for a in starts(have)]
    kept = [min(len(rows), max(0, -(-(a + m - rows.start) // rows.step))) - j
            for a, m, j in zip(starts(have), have, firsts, strict=True)]  # fmt: skip
    if kept != want:
        fetched = [(rows[a], rows[b - 1] + 1) if b > a else (0, 0)
                   for a, b in blocks(len(rows), parts)]  # fmt: skip
        return (slice(None, None, rows.step) if want[mine] else slice(0, 0)), (
            blocks(n, parts), fetched)
    if not kept[mine]:
        return slice(0, 0), None
    begin = rows.start + firsts[mine] * rows.step - starts(have)[mine]
    return slice(begin, begin + (kept[mine] - 1) * rows.step + 1, rows.step), None


@rule(Tensor.__getitem__, params="input, index", prefix=True)
def getitem(g: Guard, call: Call) -> Any:
    """Local when the spatial dimensions are taken whole (``x[:, :16]``, ``x[:, :16, :, :]``,
    ``x[:, idx]`` with a channel index tensor, ``x[..., :16]`` on a channels-last block);
    index tensors only before the spatial dimensions. A slice with a step is local where the
    blocks are whole groups of it (patch merging's ``x[..., 0::2, 0::2, :]``), else each rank
    fetches the rows from its first kept row to its last first. A slice of
    step 1 along a spatial dimension (Swin's unpad ``x[:, :H, :W, :]``, ``x[..., 1:-1]``) is
    a crop: ``F.pad`` by negative pads, whose rule fetches each rank's new rows. On tokens
    with class tokens before them, ``x[:, 0]`` (``x[:, :2]``) is whole, all-reduced from the
    first rank, and ``x[:, 1:]`` the block of the tokens after them. Whole integer indices
    into a token dimension (MAE's ``x[arange(B)[:, None], ids]``) take whole tokens, summed
    from the ranks that hold them."""
    x = call["input"]
    if prefixed(g.folds(x)) and (y := _prefix_index(g, x, call["index"])) is not None:
        return y
    if (y := _token_take(g, x, call["index"])) is not None:
        return y
    size = whole_size(g, x)
    dims, index, crops, new_size, moves = _indexed(g, x, call["index"], size)
    axes = g.grid.axes(len(size))
    for k, (dim, have, want) in moves.items():
        x = _rows_moved(x, dim, axes[k], have, want)
    y = g.marked(x[index], dims, new_size)
    if not crops:
        return y
    pads = [0] * (2 * -min(dims))
    for k, (start, stop) in crops.items():
        at = 2 * (-dims[k] - 1)  # F.pad's order: the last dimension first
        pads[at : at + 2] = [-start, stop - size[k]]
    with g.rules():
        return F.pad(y, pads)


@rule(Tensor.__setitem__, params="input, index, value", prefix=True)
def setitem(g: Guard, call: Call) -> None:
    """Assignment to a part that takes the spatial dimensions whole (ReXNet's
    ``out[:, :c] += shortcut``; MViTv2's ``attn[:, :, 0:, 0:] = ...`` on its attention map,
    whose query rows are a token dimension): local, a whole value cut to the block as in
    pointwise, a block of the part's layout written as it is."""
    x, index, value = call["input"], call["index"], call["value"]
    if not g.is_split(x):
        raise g.refuse(call.name, "it writes a block into a whole tensor")
    if prefixed(g.folds(x)):
        fold, t = g.folds(x)[0], x.dim() + g.places(x)[0]
        found = _token_entry(x, t, index, fold_count(fold))
        if found is not None:
            _write_after_prefix(g, x, found, value)
            return
    dims, index, crops, _, moves = _indexed(g, x, index, whole_size(g, x))
    if crops or moves:
        raise g.refuse("indexing", "it writes to part of a spatial dimension, or to rows with "
                       "a step that the blocks do not hold in tensor_split layout")  # fmt: skip
    if g.is_split(value) and g.form(value) != (dims, g.folds(x)):
        raise g.refuse(call.name, "it writes a block of another layout")
    if isinstance(value, Tensor) and not g.is_split(value):
        value = cut_whole(g, value, x, call.name)
    x[index] = value


def _write_after_prefix(g: Guard, x: Tensor, found: tuple[list, int, range], value: Any) -> None:
    """``x[:, :, 1:, 1:] = value`` (MViTv2 adds its relative positions to the attention map's
    tokens after the class token): the tokens after the prefix, a block of their layout,
    written into this rank's tokens after it (the first rank's) or into all of them."""
    entries, at, kept = found
    fold = g.folds(x)[0]
    p = prefix_of(fold)
    form = (g.places(x), _token_folds(box(fold)))
    if (kept.start, kept.stop) != (p, fold_count(fold)) or isinstance(entries[at], int) or (
            not g.is_split(value) or g.form(value) != form):  # fmt: skip
        raise g.refuse("indexing", "it writes to the tokens after class tokens other than all "
                       "of them, or writes a whole tensor or a block of another layout there")
    entries[at] = slice(p, None) if g.grid.at_origin else slice(None)
    x[tuple(entries)] = value
