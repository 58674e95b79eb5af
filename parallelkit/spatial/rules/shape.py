"""Shape rules: views, permutes, joins, cuts and indexing, local where the spatial dimensions
stay whole.

A block's spatial dimensions (H and W; D, H and W; L) may move (ConvNeXt permutes to channels
last and back: the record follows them, ``g.dims``), but they must stay separate dimensions,
each whole in its place: merging, cutting, indexing or joining along them would need the other
ranks' pixels, so it is refused.

A block reports the whole samples' shape, as DTensor reports its global shape: ``x.shape``,
``x.size(d)``, ``x.numel()`` and ``len(x)`` give the sample's spatial sizes (the reads are
noted, ``g.note_sized``). Sizes that forward code computes from them (a pad to a multiple, an
interpolation to a skip connection's size, a mean divided by ``H * W``, the sizes given to
``view``) are then the sample's, and the rules take sizes in arguments as whole sizes: a
``view`` to whole sizes views the block to its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

import parallelkit.functional as pkf
from parallelkit.geometry import blocks, in_whole_groups, starts, tensor_split_sizes
from parallelkit.spatial import layout, relayout
from parallelkit.spatial.grid import Axis
from parallelkit.spatial.rules.registry import (
    PROPERTY,
    Call,
    Fold,
    Guard,
    Places,
    channels_first,
    fold_index,
    fold_place,
    ops,
    prop,
    rule,
    whole_shape,
    whole_size,
)
from parallelkit.spatial.rules.tokens import count, gathered_tokens, own_tokens, token_dim
from parallelkit.spatial.token_comm import (
    box,
    fold_count,
    gather_tokens,
    prefix_of,
    prefixed,
    token_orders,
    whole_order,
    with_prefix,
)


def _positions(g: Guard, x: Tensor) -> tuple[int, ...]:
    """Where block ``x``'s spatial dimensions are, counted from the front."""
    return tuple(x.dim() + d for d in g.places(x))


def _without(dims: Places, removed: list[int], ndim: int) -> Places:
    """``dims`` after the dimensions ``removed`` (from the front, none of them spatial) are
    gone: those after a spatial dimension bring it nearer the end."""
    return tuple(d + sum(r > ndim + d for r in removed) for d in dims)


def _whole_meta(g: Guard, t: Any) -> Any:
    """A meta tensor of the whole shape of block ``t`` (of ``t``'s shape if it is whole)."""
    if not isinstance(t, Tensor):
        return t
    shape = whole_shape(g, t) if g.is_split(t) else t.shape
    return torch.empty(shape, dtype=t.dtype, device="meta")


_VIEWS = (Tensor.view, Tensor.view_as)


@rule(*ops("view reshape flatten unflatten view_as reshape_as squeeze unsqueeze", torch, Tensor),
      params="input, *_, **__", prefix=True)  # fmt: skip
def reshape(g: Guard, call: Call) -> Any:
    """Local where each spatial dimension comes out whole in a place of its own, or split
    into (outer, inner ...) with the blocks' rows in whole groups of the inner size (a
    space-to-depth view), or merged with the dimensions after it (depth-to-space), the blocks
    then in tensor_split layout of the new size; where the blocks are not whole groups, rows
    move between neighbours to whole groups before the split and back after the merge
    (``_Moves``); merged with others (a window partition,
    Swin's (B * nH * nW, ws * ws, C)), it is folded: rules that treat the fold as a batch take
    it, and a reshape unfolds it again. The other dimensions regroup freely. Sizes given are
    the whole samples' (read from ``x.shape``): the call is worked out on the whole shape,
    and the block reshaped to the result with its own spatial sizes. A reshape that regroups
    across a spatial dimension into a shape ending in the whole spatial sizes (MAnet reads
    attention's (N, H * W, C) as (N, C, H, W)) gives a plain block, each element moved to its
    rank by one all-to-all (``_moved``)."""
    x = call["input"]
    dims = g.places(x)
    if any(isinstance(a, torch.dtype) for a in call.args[1:]):  # a view as another dtype
        out = call.run()
        if out.shape == x.shape:
            return g.marked(out, dims)
        raise g.refuse(call.name, "it views a block as a dtype of another size")
    whole_in = _whole_meta(g, x)
    args, kwargs = tree_map(lambda t: _whole_meta(g, t), (call.args[1:], call.kwargs))
    try:
        whole = call.func(whole_in, *args, **kwargs)
    except RuntimeError as e:
        raise g.refuse(call.name, f"on the whole samples' shape {tuple(whole_in.shape)}: "
                       f"{str(e).splitlines()[0]}") from e  # fmt: skip
    if not isinstance(whole, Tensor):
        raise g.refuse(call.name, f"it gives a {type(whole).__name__}")
    if prefixed(g.folds(x)):
        return _keeping_tokens(g, call, x, tuple(whole_in.shape), tuple(whole.shape))
    regrouped = _regroup(g, x, tuple(whole_in.shape), tuple(whole.shape))
    if isinstance(regrouped, str):
        size = whole_size(g, x)
        if tuple(whole.shape[-len(size):]) == size:  # (.., H, W) again: moved to a plain block
            target = [(n, None) for n in whole.shape[: -len(size)] if n != 1]
            target += [(n, k) for k, n in enumerate(size)]
            rows = tuple(b.stop - b.start for b in g.grid.block(*size))
            places = tuple(range(-len(size), 0))
            return _moved(g, x, target, (*whole.shape[: -len(size)], *rows), places, size)
        raise g.refuse(call.name, f"{_named(g, x, whole_in.shape)} -> {tuple(whole.shape)} "
                       f"{regrouped}")  # fmt: skip
    shape, out_dims, size, folds, moves = regrouped
    axes = g.grid.axes(len(dims))
    for k, m, inner in moves.into_groups:
        x = _rows_moved(x, x.dim() + dims[k], axes[k], blocks(m, axes[k][1]),
                        _grouped(m, inner, axes[k]))  # fmt: skip
    y = x.view(shape) if call.func in _VIEWS else x.reshape(shape)
    for at, k, groups, inner in moves.out_of_groups:
        m = groups * inner
        y = _rows_moved(y, at, axes[k], _grouped(m, inner, axes[k]), blocks(m, axes[k][1]))
    return g.marked(y, out_dims, size, folds)


Move = tuple[list[tuple[int, int]], list[tuple[int, int]]]
"""Row blocks of a spatial dimension over its ranks, before and after a move: (have, want)."""


@dataclass(frozen=True)
class _Moves:
    """Rows a reshape moves between neighbours, where a spatial dimension of ``m`` rows is cut
    into ``(m / inner, inner)`` (a window partition, space-to-depth) but its tensor_split
    blocks are not whole groups of ``inner`` rows: before the view each rank takes whole
    groups, the tensor_split layout of the groups (``into_groups``: (spatial dimension, m,
    inner)), and after a view that merges them again they go back (``out_of_groups``: (the
    output dimension, the spatial dimension, groups, inner)). 32 rows padded to 35 for
    windows of 7 on 2 ranks: blocks of 18 + 17 rows become 3 + 2 windows, 21 + 14 rows."""

    into_groups: tuple[tuple[int, int, int], ...] = ()
    out_of_groups: tuple[tuple[int, int, int, int], ...] = ()


def _grouped(m: int, inner: int, axis: Axis) -> list[tuple[int, int]]:
    """The blocks of ``m`` rows in whole groups of ``inner`` over the ranks along ``axis``:
    the groups' tensor_split."""
    return [(a * inner, b * inner) for a, b in blocks(m // inner, axis[1])]


def _rows_moved(x: Tensor, dim: int, axis: Axis, have: list[tuple[int, int]],
                want: list[tuple[int, int]]) -> Tensor:  # fmt: skip
    """Block ``x`` with its rows along ``dim`` moved from blocks ``have`` to blocks ``want``
    over the ranks along ``axis`` (``gather_rows``: each from the neighbours that hold it)."""
    return pkf.gather_rows(x, axis[0], dim, [b - a for a, b in have], want)


def _keeping_tokens(
    g: Guard, call: Call, x: Tensor, a: tuple[int, ...], b: tuple[int, ...]
) -> Tensor:
    """A reshape of block ``x`` (whole shape ``a``) whose token dimension has a prefix (a
    class token) to whole shape ``b``: local where the token dimension comes out whole in a
    place of its own, the dimensions before it and after it regrouping among themselves
    (a ViT's ``(N, L, 3, h, d)`` of its ``(N, L, 3C)`` projection)."""
    t = x.dim() + g.places(x)[0]
    before, after = math.prod(a[:t]), math.prod(a[t + 1 :])
    for j, n in enumerate(b):
        if n == a[t] and math.prod(b[:j]) == before and math.prod(b[j + 1 :]) == after:
            shape = (*b[:j], x.shape[t], *b[j + 1 :])
            y = x.view(shape) if call.func in _VIEWS else x.reshape(shape)
            return g.marked(y, (j - len(b),) * len(g.places(x)))
    raise g.refuse(call.name, f"{tuple(a)} -> {tuple(b)} regroups tokens that have a class "
                   "token before them")  # fmt: skip


def _named(g: Guard, x: Tensor, shape: Any) -> str:
    """``shape`` with the spatial sizes by name, so that a refusal reads the same on every
    rank (a block's sizes differ by rank)."""
    named = list(map(str, shape))
    letters: dict[int, str] = {}
    for name, at in zip({1: "L", 2: "HW", 3: "DHW"}[len(g.places(x))], _positions(g, x),
                        strict=True):  # fmt: skip
        letters[at] = letters.get(at, "") + name
    for at, name in letters.items():
        named[at] = name if len(name) == 1 else f"{shape[at]} ({name} folded)"
    return f"({', '.join(named)})"


Factor = tuple[int, int | None]  # (whole size, spatial dimension by its place in the record)


def _factors(g: Guard, x: Tensor, a: tuple[int, ...]) -> list[Factor]:
    """Block ``x``'s whole shape ``a`` as a list of factors, outermost first: a fold's
    factors, a spatial dimension's (size, its place in the record), another's (size, None);
    other dimensions of size 1 are left out."""
    per: list[list[Factor]] = [[(n, None)] if n != 1 else [] for n in a]
    dims, folded = g.places(x), set()
    for fold in g.folds(x):
        per[x.dim() + fold_place(g, x, fold)] = list(fold)
        folded |= {k for _, k in fold}
    for k, d in enumerate(dims):
        if k not in folded:
            per[x.dim() + d] = [(a[x.dim() + d], k)]
    return [f for dim in per for f in dim]


def _regroup(
    g: Guard, x: Tensor, a: tuple[int, ...], b: tuple[int, ...]
) -> tuple[tuple[int, ...], Places, tuple[int, ...], tuple[Fold, ...], _Moves] | str:
    """How block ``x`` of whole shape ``a`` reshapes to whole shape ``b``: this rank's shape,
    the spatial dimensions' places (from the end), their whole sizes, the folds and the rows
    moved around the view (:class:`_Moves`); or why it cannot.

    Both shapes are read as factors (:func:`_factors`), and each dimension of ``b`` takes the
    next ones whose product it is. A spatial factor may be split into (outer, inner): the
    outer part stays spatial, its blocks in tensor_split layout, every block whole groups of
    the inner size (space-to-depth, a window partition's ``(H / ws, ws)``; where the
    dimension's blocks are not, its rows move first, some ranks holding none if the groups
    are fewer than they).
    A dimension that takes one spatial factor and others after it is that spatial dimension
    again, in tensor_split layout of the product (depth-to-space, a window reverse; rows move
    back where the groups' blocks are not that layout); any other with a spatial factor is a
    fold, which only rules that treat it as a batch take."""
    ndim = len(g.places(x))
    axes = g.grid.axes(ndim)
    parts = [p for _, p, _ in axes]

    flat = _factors(g, x, a)
    found = _group(list(flat), b, parts, ones=False)
    if not isinstance(found, str) and found[1]:  # a partition: one-window grids are spatial
        found = _group(list(flat), b, parts, ones=True)
    if isinstance(found, str):
        return found
    groups, _, cuts = found
    folded = {k for fold in g.folds(x) for _, k in fold}
    if any(k in folded for k, _, _ in cuts):
        return "cuts a folded spatial dimension into groups its blocks do not hold whole"
    shape, places, size, folds, back = [], [0] * ndim, [0] * ndim, [], []
    for at, group in enumerate(groups):
        spatial = [(m, k) for m, k in group if k is not None]
        local = [tensor_split_sizes(m, parts[k])[axes[k][2]] if k is not None else m
                 for m, k in group]  # fmt: skip
        shape.append(math.prod(local))
        for _, k in spatial:
            places[k] = at - len(b)
        if not spatial:
            continue
        (m, k), rest = group[0], math.prod(f[0] for f in group[1:])
        if len(spatial) == 1 and group[0][1] is not None:
            size[k] = m * rest  # one spatial dimension, merged with what follows it
            if not in_whole_groups(m, rest, parts[k]):
                back.append((at, k, m, rest))
            continue
        folds.append(tuple(group))
        for m, k in spatial:
            size[k] = m
    return tuple(shape), tuple(places), tuple(size), tuple(folds), _Moves(cuts, tuple(back))


def _group(
    flat: list[Factor], b: tuple[int, ...], parts: list[int], ones: bool
) -> tuple[list[list[Factor]], bool, tuple[tuple[int, int, int], ...]] | str:
    """The factors ``flat`` of a block's whole shape taken by the dimensions of ``b`` in
    turn (:func:`_regroup`), whether a spatial factor was cut into (outer > 1, inner): a
    partition, and the cuts whose blocks are not whole groups of the inner size, as
    (spatial dimension, size, inner). ``ones``: a dimension of size 1 just before one of a
    spatial factor's size takes that factor as its outer part, (1, size): a window grid of
    one window along it (Swin's ``view(B, 2, 7, 1, 7, C)`` of a 14 x 7 map), as the others'
    grids are spatial."""
    i, groups, partition, cuts = 0, [], False, []

    def cut(m: int, k: int | None, outer: int) -> None:
        """Note a cut of spatial dimension ``k`` whose blocks are not whole groups."""
        if k is not None and not in_whole_groups(outer, m // outer, parts[k]):
            cuts.append((k, m, m // outer))

    for at, n in enumerate(b):
        group, prod = [], 1
        if (ones and n == 1 and i < len(flat) and flat[i][1] is not None
                and at + 1 < len(b) and b[at + 1] == flat[i][0] > 1):  # fmt: skip
            cut(*flat[i], 1)
            group, flat[i] = [(1, flat[i][1])], (flat[i][0], None)
        while prod < n:
            m, k = flat[i]
            if n % (prod * m) == 0:
                group.append(flat[i])
                prod, i = prod * m, i + 1
                continue
            outer = n // prod
            if n % prod or m % outer:
                return "regroups across a spatial dimension" if k is not None or any(
                    f[1] is not None for f in group) else "regroups dimensions unevenly"
            cut(m, k, outer)
            partition |= k is not None and outer > 1
            group.append((outer, k))
            flat[i] = (m // outer, None)
            prod = n
        # A spatial factor of size 1 goes with a window grid just before it (Swin's (nH, 1)),
        # else with the next dimension (a window's row of it, in the reverse), or into one
        # of size 1.
        while i < len(flat) and flat[i][0] == 1 and flat[i][1] is not None:
            free = b[at + 1 : at + 2] != (1,)  # no dimension of size 1 next to take it
            grid = bool(group) and group[-1][1] is not None and free
            if not (grid or at + 1 == len(b) or (n == 1 and (not group or free))):
                break
            group.append(flat[i])
            i += 1
        groups.append(group)
    if i != len(flat):
        return "leaves a spatial dimension of size 1 out"
    return groups, partition, tuple(cuts)


@rule(F.pixel_shuffle, F.pixel_unshuffle, params="input, factor")
def pixel_shuffle(g: Guard, call: Call) -> Any:
    """As its definition: a view that splits the channels, a permute and a reshape that merges
    each spatial dimension with a factor after it (shuffle), or the reverse (unshuffle), whose
    rules check that each block's rows regroup whole."""
    x, r = call["input"], int(call["factor"])
    channels_first(g, call, x)
    with g.rules():
        n, c, h, w = x.shape
        if call.func is F.pixel_shuffle:
            y = x.view(n, c // (r * r), r, r, h, w).permute(0, 1, 4, 2, 5, 3)
            return y.reshape(n, c // (r * r), h * r, w * r)
        y = x.view(n, c, h // r, r, w // r, r).permute(0, 1, 3, 5, 2, 4)
        return y.reshape(n, c * r * r, h // r, w // r)


@rule(*ops("permute transpose swapaxes swapdims movedim moveaxis", torch, Tensor),
      params="input, *_, **__", prefix=True)  # fmt: skip
def permute(g: Guard, call: Call) -> Any:
    """Local; the record follows the spatial dimensions to their new places (channels last
    and back)."""
    x, out = call["input"], call.run()
    probe = torch.empty((1,) * x.dim(), device="meta").as_strided(
        x.shape, tuple(range(1, x.dim() + 1))
    )  # strides 1..n tell which input dimension lands where
    moved = call.func(probe, *call.args[1:], **call.kwargs).stride()
    strides = [x.dim() + d + 1 for d in g.places(x)]  # the strides the spatial dimensions had
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
    dims = g.places(x)
    if any(int(sizes[len(sizes) + d]) != 1 for d in dims):
        raise g.refuse(call.name, f"it repeats a spatial dimension (sizes {tuple(sizes)})")
    return g.marked(call.run(), dims)


@rule(Tensor.repeat_interleave, torch.repeat_interleave,
      params="input, repeats=None, dim=None, *, output_size=None", folds=True)  # fmt: skip
def repeat_interleave(g: Guard, call: Call) -> Tensor:
    """Along a dimension that is not spatial: local. A small map repeated along its batch
    once per window of a window partition (GCViT's global query, given to every window of its
    image: ``q.repeat_interleave(B_ // B, 0)``, the count read whole): the map gathered whole,
    repeated for the windows this rank's partition holds, and the result folded as that
    partition is, so that it meets the windows' keys element for element."""
    x, r, dim = call["input"], call["repeats"], call["dim"]
    if not isinstance(r, int) or dim is None or dim % x.dim() - x.dim() in g.places(x):
        raise g.refuse(call.name, "it repeats along a spatial dimension, or flattens")
    found = None
    if dim % x.dim() == 0 and r > 1 and not g.folds(x):
        found = g.batch_fold(x.shape[0], r)
    whole = gathered_whole(g, x) if found is not None else None
    if whole is None:
        return g.marked(call.run(), g.places(x))
    like, fold = found
    y = whole.repeat_interleave(like.shape[0] // x.shape[0], dim=0)
    return g.marked(y, (-y.dim(),) * len(g.places(like)), g.size_of(like), (fold,))


@rule(*ops("expand", Tensor), params="input, *sizes", folds=True)
def expand(g: Guard, call: Call) -> Any:
    """Local where every dimension holding spatial ones keeps its size (-1, or the whole size
    read from ``x.shape``): size-1 dimensions and new leading ones expand (the relative
    position logits of HaloNet and BotNet, ``(B, H, 1, W, W).expand(-1, -1, H, -1, -1)``)."""
    x, sizes = call["input"], call["sizes"]
    if len(sizes) == 1 and not isinstance(sizes[0], int):
        sizes = tuple(sizes[0])
    sizes, whole = [int(n) for n in sizes], whole_shape(g, x)
    for d in set(g.places(x)):
        if sizes[len(sizes) + d] not in (-1, whole[d]):
            raise g.refuse(call.name, f"it expands a spatial dimension (sizes {tuple(sizes)})")
        sizes[len(sizes) + d] = -1
    return g.marked(x.expand(*sizes), g.places(x))


@rule(*ops("expand_as", Tensor), params="input, other", prefix=True)
def expand_as(g: Guard, call: Call) -> Any:
    """Local: a block expanded along non-spatial dimensions of size 1, or a whole tensor of
    size 1 in the spatial dimensions (timm's ECA gate, (N, C, 1, 1); MobileViTv2's context
    vector, (N, C, P, 1) against folded patches) expanded to a block, whose gradient is then
    each rank's share of the dense one (summed, as in pointwise)."""
    x, other = call["input"], call["other"]
    dims = g.places(other) if g.is_split(other) else g.places(x)
    if g.is_split(x):
        if not g.is_split(other) or g.form(other) != g.form(x):
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


def cut_whole(g: Guard, t: Tensor, block: Tensor, op: str) -> Tensor:
    """Whole tensor ``t`` meeting ``block`` (broadcast against it, from the end): sizes 1 stay
    as they are, and a spatial dimension of the whole samples' size is cut to this rank's rows
    of it (CoordConv's coordinate maps, ``torch.arange(x.shape[-1])``, a whole-size positional
    embedding); its gradient is then each rank's share, summed as a gate's. Any other size
    over a spatial dimension is refused."""
    dims, whole = g.places(block), whole_size(g, block)
    folds = {fold_place(g, block, fold): fold for fold in g.folds(block)}
    index: list[Any] = [slice(None)] * t.dim()
    for d, n, rows in zip(dims, whole, g.grid.block(*whole), strict=True):
        if d in folds:
            n = fold_count(folds[d])
        if t.dim() < -d or t.shape[d] == 1:
            continue
        if t.shape[d] != n:
            raise g.refuse(op, f"a whole tensor of shape {tuple(t.shape)} varies over a spatial "
                           f"dimension, whose whole size is {n}")  # fmt: skip
        if d not in folds:
            index[t.dim() + d] = rows
    t = g.summed(t)[tuple(index)]
    for d, fold in folds.items():  # a window partition's mask: this rank's windows
        if t.dim() >= -d and t.shape[d] != 1:
            t = t.index_select(d, fold_index(g, block, fold))
    return t


def to_form(g: Guard, t: Tensor, like: Tensor) -> Tensor | None:
    """Block ``t`` moved to the layout of block ``like`` (the same whole shape, its spatial
    dimensions elsewhere or folded otherwise); None where the whole shapes differ."""
    shape = tuple(whole_shape(g, t))
    if shape != tuple(whole_shape(g, like)) or prefixed(g.folds(t) + g.folds(like)):
        return None
    target = _factors(g, like, shape)
    return _moved(g, t, target, like.shape, g.places(like), g.size_of(like), g.folds(like))


def gathered_whole(g: Guard, t: Tensor, full: bool = False) -> Tensor | None:
    """Block ``t``, of any layout, whole on every rank (not marked): one all-gather of every
    rank's elements, put in the whole order; backward sums each rank's share of the gradient
    (a reduce-scatter), or with ``full`` (every rank holds the whole gradient: a model's
    output) keeps this rank's part. Tokens with class tokens before them (a ViT's hidden
    states): the token dimension gathered, the class tokens first; None for another layout
    with such a prefix."""
    if prefixed(g.folds(t)):
        return None if token_dim(g, t) is None else gathered_tokens(g, t, full)
    shape = tuple(whole_shape(g, t))
    source = _factors(g, t, shape)
    batch = source[0][0] if source[0][1] is None else 1
    if batch != 1:  # a whole outermost dimension (the batch): the same per sample
        source = source[1:]
    key = ("whole", tuple(source), len(g.places(t)), str(t.device))
    if key not in g.weights:
        orders = token_orders(g.grid, tuple(source), len(g.places(t)))
        where = whole_order(orders)
        g.weights[key] = ([len(o) for o in orders], None if where is None else where.to(t.device))
    sizes, where = g.weights[key]
    return gather_tokens(t.reshape(batch, -1), g.grid.comm, 1, sizes, where, full).view(shape)


def _moved(
    g: Guard, t: Tensor, target: list[Factor], shape: tuple[int, ...], places: Places,
    size: Any, folds: tuple[Fold, ...] = (),
) -> Tensor:  # fmt: skip
    """Block ``t`` moved to the layout whose factors are ``target`` (over the same whole
    elements in the same order), this rank's block of it of ``shape``: an exact all-to-all
    (:mod:`parallelkit.spatial.relayout`), planned once per pair of layouts."""
    source = _factors(g, t, tuple(whole_shape(g, t)))
    batch = source[0][0] if source[0] == target[0] and source[0][1] is None else 1
    if batch != 1:  # a whole outermost dimension (the batch): per-sample plans, smaller
        source, target = source[1:], target[1:]
    ndim = len(g.places(t))
    key = ("relayout", tuple(source), tuple(target), ndim, str(t.device))
    if key not in g.weights:
        g.weights[key] = relayout.plan(g.grid, tuple(source), tuple(target), ndim).to(t.device)
    y = relayout.relayout(t.reshape(batch, -1), g.grid.comm, g.weights[key])
    return g.marked(y.view(shape), places, size, folds)


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
        return layout.summed(mine, g.comm)[tuple(entries)]
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
    return layout.summed(torch.cat([x, zero], t)[tuple(entries)], g.comm)


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


_METADATA = """
dim ndimension element_size is_contiguous is_floating_point is_complex get_device data_ptr
stride storage_offset __repr__ __format__ __hash__ register_hook
"""
_SHAPE = (Tensor.size, prop("shape"), Tensor.numel, Tensor.nelement, Tensor.__len__)


@rule(PROPERTY, *ops(_METADATA, Tensor), *_SHAPE, prefix=True)
def metadata(g: Guard, call: Call) -> Any:
    """Answered from the block, but for its shape (``x.shape``, ``x.size()``, ``x.numel()``,
    ``len(x)``): the whole samples', as DTensor reports its global shape, so that sizes the
    forward code computes from it are the sample's (the reads are noted)."""
    if call.func not in _SHAPE or call.args[0] is not call.blocks[0]:
        return call.run()
    x = call.blocks[0]
    size = whole_size(g, x)
    shape = whole_shape(g, x, size)
    if call.func in (Tensor.numel, Tensor.nelement):
        return math.prod(shape)
    if call.func is Tensor.__len__:
        return shape[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    if not g.folds(x):
        g.note_sized(size)
    if dim is None:
        return shape
    if isinstance(dim, int):
        return shape[dim]
    return tuple(shape[d] for d in dim)


@rule(prop("data"), prefix=True)
def data(g: Guard, call: Call) -> Any:
    """The same block, without its history."""
    return g.marked(call.run(), g.places(call.blocks[0]))


@rule(Tensor.requires_grad.__set__, prefix=True)
def set_requires_grad(g: Guard, call: Call) -> None:
    """``x.requires_grad = flag`` on a block (MONAI's cached reference grids): the flag of
    this rank's block."""
    call.run()


@rule(prop("T"), prop("mT"), prop("H"), prop("mH"), exact="refused")
def transposed(g: Guard, call: Call) -> Any:
    """Refused: reverses or swaps the last dimensions."""
    raise g.refuse(call.name, "it moves the spatial dimensions")
