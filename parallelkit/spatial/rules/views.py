"""View rules: reshapes, permutes, repeats and expands, and reads of a block's shape.

A block's spatial dimensions (H and W; D, H and W; L) may move (ConvNeXt permutes to channels
last and back: the record follows them), be cut into (groups, rows of a group) and merged back
(a space-to-depth, a window partition folded into the batch: :mod:`.forms` keeps the fold's
factors), as long as each rank's rows stay whole groups; where they are not, rows move to a
neighbour first (``_Moves``).

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
from parallelkit.geometry import blocks, in_whole_groups, tensor_split_sizes
from parallelkit.spatial.grid import Axis
from parallelkit.spatial.rules.forms import Factor, _factors, _moved, gathered_whole
from parallelkit.spatial.rules.registry import (
    PROPERTY,
    Call,
    Fold,
    Guard,
    Places,
    channels_first,
    ops,
    prop,
    rule,
    whole_shape,
    whole_size,
)
from parallelkit.spatial.token_comm import (
    prefixed,
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
