"""How a block and a whole tensor meet, and how a block moves between forms: a whole tensor
of the samples' size cut to a block (``cut_whole``), a block moved to another block's layout
(``to_form``, ``_moved``: one all-to-all) or gathered whole (``gathered_whole``), and the
factors of a dimension folded from spatial ones (``Factor``). The view, indexing and pointwise
rules share them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from parallelkit.spatial import relayout
from parallelkit.spatial.rules.registry import (
    Fold,
    Guard,
    Places,
    fold_index,
    fold_place,
    whole_shape,
    whole_size,
)
from parallelkit.spatial.rules.tokens import gathered_tokens, token_dim
from parallelkit.spatial.token_comm import (
    fold_count,
    gather_tokens,
    prefixed,
    token_orders,
    whole_order,
)

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
