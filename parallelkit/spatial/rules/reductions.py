"""Reduction rules: over channels or the batch, local; over the spatial dimensions, one
all-reduce.

A reduction that leaves the spatial dimensions (H and W; D, H and W; L) alone runs on the
block as it is. One over all of them (and maybe more) is a sum of per-block parts,
all-reduced over the spatial group: the result is whole, the same on every rank. Its
backward follows the region's gradient convention (``record.summed``: a replicated loss needs
no communication; a consumer split again, an SE gate, gets the sum). Extremes route their
gradient, as torch's do, in equal parts to every place that holds the extreme, on whichever
rank. A reduction over only some of the spatial
dimensions, and those whose result needs more than sums and extremes (``max(dim)`` with its
indices over a spatial dimension), are refused.

A flattened token dimension (``x.flatten(2)``: every spatial dimension folded into one, see
``tokens``) is reduced alike: over it (and maybe more), the per-rank parts of the whole
tokens are all-reduced, a mean divided by the whole token count (ViT's ``x.flatten(2).mean(-1)``
or ``tokens.mean(1)``), and ``F.normalize`` over it is ``x`` over the all-reduced norm, a
block. ``softmax`` over every spatial dimension at once (a 1-D signal's length, a flattened
token dimension: attention pooling, a global-context block's weights) is the block less the
all-reduced ``logsumexp``, exponentiated: a block, exact.

A running sum or product along a split dimension (``cumsum``, ``cumprod``: an integral image)
is each block's own scan with the total of the blocks before it in the sample added
(multiplied) in, from one all-gather of each block's last row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parallelkit.functional as pkf
from parallelkit.spatial import record
from parallelkit.spatial.rules.pointwise import pointwise
from parallelkit.spatial.rules.registry import Call, Guard, fold_index, ops, rule, whole_shape
from parallelkit.spatial.rules.tokens import own_tokens


def _dims(x: Tensor, dim: Any) -> list[int]:
    """The reduced dimensions, from the front (None or () is every dimension)."""
    if dim is None or (isinstance(dim, tuple | list) and not dim):
        return list(range(x.dim()))
    return sorted({d % x.dim() for d in (dim if isinstance(dim, tuple | list) else (dim,))})


def _spatial(g: Guard, x: Tensor) -> list[int]:
    """Where block ``x``'s spatial dimensions are, from the front, each once (a flattened
    token dimension holds several)."""
    return sorted({x.dim() + d for d in g.places(x)})


def _every_spatial_fold(g: Guard, x: Tensor) -> bool:
    """Whether block ``x`` is unfolded, or its one fold holds all of every spatial dimension,
    maybe with other dimensions: a flattened token dimension (``x.flatten(2)``), or a whole
    attention map flattened (``(q @ k^T).view(n, -1)``, queries split and keys whole). The
    blocks of such a fold are disjoint parts of the whole one, so sums over it add up."""
    folds = g.folds(x)
    return not folds or (len(folds) == 1 and len(set(g.places(x))) == 1)


def _taken(g: Guard, call: Call, x: Tensor) -> None:
    """Refuse a block folded otherwise (a window partition, a fold of only some spatial
    dimensions)."""
    if not _every_spatial_fold(g, x):
        raise g.refuse(call.name, "it is given a window partition (spatial dimensions folded "
                       "apart, or only some of them); reductions take a fold only where it "
                       "holds every spatial dimension (x.flatten(2), x.view(n, -1))")  # fmt: skip


def _local(g: Guard, call: Call, x: Tensor, dims: list[int], keepdim: bool) -> Any:
    """A reduction over dimensions other than the spatial ones: local; a dropped dimension
    after a spatial one brings it nearer the end."""
    drop = [] if keepdim else dims
    return g.marked(call.run(), tuple(d + sum(r > x.dim() + d for r in drop) for d in g.places(x)))


def _whole(x: Tensor, dims: list[int], y: Tensor, keepdim: bool) -> Tensor:
    return y if keepdim else y.squeeze(dims)


def sum_spatial(g: Guard, x: Tensor) -> Tensor:
    """The whole samples' sums over the spatial dimensions (size 1 there), the same on every
    rank."""
    return record.summed(x.sum(_spatial(g, x), keepdim=True), g.comm)


def mean_spatial(g: Guard, x: Tensor) -> Tensor:
    """The whole samples' means over the spatial dimensions (size 1 there): sums and the
    pixel count in one all-reduce."""
    spatial = _spatial(g, x)
    local = x.sum(spatial, keepdim=True)
    count = x.new_full((1,), float(math.prod(x.shape[d] for d in spatial)))
    total = record.summed(torch.cat([local.flatten(), count]), g.comm)
    return (total[:-1] / total[-1]).view(local.shape)


def extreme(g: Guard, x: Tensor, dims: list[int], largest: bool) -> Tensor:
    """The whole samples' maximum (minimum) over ``dims`` (the spatial ones and maybe more), kept as
    size-1 dimensions, the same on every rank. Its value is the all-reduced extreme; its
    gradient goes, as torch's does, in equal parts to every place that holds it, on
    whichever rank: the sum of those places over their all-reduced count, which has that
    gradient and the same value, is added as a zero."""
    with torch.no_grad():
        if x.numel():
            local = x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True)
        else:  # an empty block holds no extreme
            shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
            local = x.new_full(shape, -math.inf if largest else math.inf)
        whole = g.comm.all_reduce(local.contiguous(), "max" if largest else "min")
    if not x.is_floating_point():  # no gradient to route
        return whole
    at = x == whole
    total = record.summed(
        torch.cat([torch.where(at, x, 0).sum(dims).flatten(), at.sum(dims).flatten().to(x)]),
        g.comm,
    )
    half = total.numel() // 2
    spread = (total[:half] / total[half:]).view(whole.shape)
    return whole + (spread - spread.detach())


def _over_spatial(g: Guard, call: Call, x: Tensor, dims: list[int]) -> bool:
    """True where ``dims`` hold every spatial dimension, False where none; refused in
    between."""
    spatial = set(_spatial(g, x))
    if spatial <= set(dims):
        return True
    if spatial & set(dims):
        raise g.refuse(call.name, "it reduces over some of the spatial dimensions (only over "
                       "all of them is exact)")  # fmt: skip
    return False


@rule(*ops("sum mean nansum nanmean", torch, Tensor),
      params="input, dim=None, keepdim=False, *, dtype=None, out=None", prefix=True)  # fmt: skip
def sum_mean(g: Guard, call: Call) -> Tensor:
    """Over the spatial dimensions (and maybe more, any layout): local sums and one
    all-reduce with the pixel count; the result is whole. Over a flattened token dimension
    (``x.flatten(2).mean(-1)``) alike, with the whole token count. Over other dimensions:
    local."""
    x, keepdim = call["input"], call["keepdim"]
    _taken(g, call, x)
    dims = _dims(x, call["dim"])
    if call["out"] is not None or "nan" in call.name:
        raise g.refuse(call.name, "out= and nan-skipping sums have no rule")
    if not _over_spatial(g, call, x, dims):
        return _local(g, call, x, dims, keepdim)
    if call["dtype"] is not None:
        x = g.marked(x.to(call["dtype"]), g.places(x))
    mean = "mean" in call.name
    y = mean_spatial(g, x) if mean else sum_spatial(g, x)
    if other := [d for d in dims if d not in _spatial(g, x)]:
        y = y.mean(other, keepdim=True) if mean else y.sum(other, keepdim=True)
    return _whole(x, dims, y, keepdim)


@rule(*ops("amax amin", torch, Tensor), params="input, dim=(), keepdim=False, *, out=None",
      prefix=True)  # fmt: skip
def amax(g: Guard, call: Call) -> Tensor:
    """Over the spatial dimensions (and maybe more): a no-grad all-reduce of the local
    extremes gives the
    value; the gradient goes in equal parts to every place holding it, on any rank, as
    torch's does. Over other dimensions: local."""
    x, keepdim = call["input"], call["keepdim"]
    _taken(g, call, x)
    dims = _dims(x, call["dim"])
    if not _over_spatial(g, call, x, dims):
        return _local(g, call, x, dims, keepdim)
    return _whole(x, dims, extreme(g, x, dims, largest=call.name.endswith("amax")), keepdim)


@rule(*ops("max min", torch, Tensor), params="input, dim=None, keepdim=False, *, out=None",
      prefix=True)  # fmt: skip
def max_min(g: Guard, call: Call) -> Any:
    """``max(x)`` of everything: as ``amax``. ``max(x, dim)`` with its indices: local over
    other dimensions; over a dimension that holds every spatial one (a token dimension,
    VOLO's token-labelling head ``x.max(1)``; a signal's length), torch's winner of the whole
    dimension (its first maximum, or first NaN) named by two all-reduces and made whole by a
    third, its index the whole dimension's, the gradient routed to it alone as torch routes
    it; over some of them, refused. ``max(x, other)``: pointwise."""
    x, dim, keepdim = call["input"], call["dim"], call["keepdim"]
    if isinstance(dim, Tensor):
        return pointwise(g, call)
    if dim is None:
        dims = _dims(x, None)
        return _whole(x, dims, extreme(g, x, dims, largest=call.name.endswith("max")), False)
    dims = _dims(x, dim)
    if dims == _spatial(g, x) and _every_spatial_fold(g, x):
        return _winner(g, x, dims[0], keepdim, largest=call.name.endswith("max"))
    if set(dims) & set(_spatial(g, x)):
        raise g.refuse(call.name, "it reduces over a spatial dimension with indices, not over "
                       "all of them in one (amax has a rule)")  # fmt: skip
    return _local(g, call, x, dims, keepdim)


def _winner(g: Guard, x: Tensor, d: int, keepdim: bool, largest: bool) -> Any:
    """``x.max(d)`` (``x.min(d)``) over dimension ``d``, which holds every spatial one: each
    rank's first extreme (first NaN) and its whole index there; one all-reduce of the
    extreme and of whether any is NaN, one of the lowest whole index that reaches it (torch
    keeps the first), one that makes the winner's value whole (a sum of the winner's value
    and zeros), whose backward routes the gradient to the winner alone."""
    folds = g.folds(x)
    whole = fold_index(g, x, folds[0]) if folds else own_tokens(g, x)
    if x.shape[d]:
        value, at = x.max(d, keepdim=True) if largest else x.min(d, keepdim=True)
        index = whole[at]
    else:  # an empty block reaches no extreme (its value still in the graph: every rank's
        # backward meets the collective below)
        shape = [1 if i == d else n for i, n in enumerate(x.shape)]
        if x.is_floating_point():
            value = x.narrow(d, 0, 0).sum(d, keepdim=True) + (-math.inf if largest else math.inf)
        else:
            limits = torch.iinfo(x.dtype)
            value = x.new_full(shape, limits.min if largest else limits.max)
        index = torch.full(shape, -1, dtype=torch.long, device=x.device)
    nan = value.isnan()
    bound = math.inf if largest else -math.inf  # what a NaN counts as in the extreme
    with torch.no_grad():
        limit = torch.where(nan, bound, value)  # a minimum is the maximum of its negation
        ends = g.comm.all_reduce(torch.stack([limit if largest else -limit, nan.to(limit.dtype)]),
                                 "max")  # fmt: skip
        extreme = ends[0] if largest else -ends[0]
        reached = torch.where(ends[1] > 0, nan, value == extreme) & (index >= 0)
        first = g.comm.all_reduce(torch.where(reached, index, torch.iinfo(torch.long).max), "min")
    mine = index == first
    values = record.summed(torch.where(mine, value, 0), g.comm)
    if not keepdim:
        values, first = values.squeeze(d), first.squeeze(d)
    return torch.return_types.max((values, first)) if largest else torch.return_types.min(
        (values, first))  # fmt: skip


@rule(*ops("argmax argmin prod all any", torch, Tensor),
      params="input, dim=None, keepdim=False, *_, **__", prefix=True)  # fmt: skip
def along_others(g: Guard, call: Call) -> Any:
    """Local over channels or the batch (``argmax(1)``, ``prod(1)``);
    refused over a spatial dimension, or over everything."""
    x = call["input"]
    if call["dim"] is None:
        raise g.refuse(call.name, "it reduces over every dimension, the spatial ones among them")
    dims = _dims(x, call["dim"])
    if set(dims) & set(_spatial(g, x)):
        raise g.refuse(call.name, "it reduces over a spatial dimension (only sum, mean, var, "
                       "std, norm, logsumexp, softmax, amax and amin over all of them are exact "
                       "here)")  # fmt: skip
    return _local(g, call, x, dims, call["keepdim"])


@rule(*ops("softmax log_softmax", torch, Tensor, F), params="input, dim=None, *rest, **options",
      prefix=True)  # fmt: skip
def softmax(g: Guard, call: Call) -> Tensor:
    """Over channels or the batch (class scores' ``softmax(1)``): local. Over every spatial
    dimension at once (the one dimension of a signal, or a flattened token dimension: the
    weights of attention pooling and of a global-context block), ``x - logsumexp(x)`` with the
    logsumexp all-reduced (its rule below), exponentiated for ``softmax``: a block, and its
    gradient the whole softmax's through that rule's. Over some of them, refused."""
    x = call["input"]
    if call["dim"] is None:
        raise g.refuse(call.name, "it reduces over every dimension, the spatial ones among them")
    dims = _dims(x, call["dim"])
    if not _over_spatial(g, call, x, dims):
        return _local(g, call, x, dims, keepdim=True)
    _taken(g, call, x)
    dtype = call["options"].get("dtype") or next(
        (a for a in call["rest"] if isinstance(a, torch.dtype)), None
    )
    with g.rules():
        x = x if dtype is None else x.to(dtype)
        y = x - x.logsumexp(dims[0], keepdim=True)
        return y if call.name.endswith("log_softmax") else y.exp()


@rule(F.mse_loss, F.l1_loss,
      params="input, target, size_average=None, reduce=None, reduction='mean', weight=None")
def pointwise_loss(g: Guard, call: Call) -> Tensor:
    """A block against a block (the reconstruction loss SegResNetVAE computes in its forward):
    the pointwise terms, then ``mean`` or ``sum`` over the whole samples (all-reduced, whole);
    ``reduction='none'`` keeps the block."""
    x, target, reduction = call["input"], call["target"], call["reduction"]
    if call["size_average"] is not None or call["reduce"] is not None or call["weight"] is not None:
        raise g.refuse(call.name, "size_average, reduce and weight have no rule")
    with g.rules():
        diff = x - target
        terms = diff.square() if call.func is F.mse_loss else diff.abs()
        if reduction == "none":
            return terms
        return terms.mean() if reduction == "mean" else terms.sum()


@rule(torch.logsumexp, Tensor.logsumexp, params="input, dim, keepdim=False, *, out=None",
      prefix=True)  # fmt: skip
def logsumexp(g: Guard, call: Call) -> Tensor:
    """Over the spatial dimensions (and maybe more): the all-reduced maximum m, then one
    all-reduced sum of exp(x - m); whole. Over other dimensions: local."""
    x, keepdim = call["input"], call["keepdim"]
    _taken(g, call, x)
    dims = _dims(x, call["dim"])
    if not _over_spatial(g, call, x, dims) or call["out"] is not None:
        return _local(g, call, x, dims, keepdim)
    m = extreme(g, x, dims, largest=True).detach()  # a constant: the gradient is softmax's
    m = torch.where(m.isfinite(), m, 0)
    with g.rules():
        total = (x - m).exp().sum(dims, keepdim=True)
    return _whole(x, dims, total.log() + m, keepdim)


@rule(*ops("var std", torch, Tensor),
      params="input, dim=None, unbiased=None, keepdim=False, *, correction=None, "
      "out=None", prefix=True)  # fmt: skip
def var_std(g: Guard, call: Call) -> Tensor:
    """Over the spatial dimensions (and maybe more; AdaIN-style statistics), any correction:
    written out as means of the whole samples (the rules above) and scaled by the whole
    count. Over other dimensions: local."""
    x, keepdim = call["input"], call["keepdim"]
    _taken(g, call, x)
    dims = _dims(x, call["dim"])
    if not _over_spatial(g, call, x, dims):
        return _local(g, call, x, dims, keepdim)
    correction = call["correction"]
    if correction is None:
        correction = 0 if call["unbiased"] is False else 1
    shape = whole_shape(g, x)  # a token dimension's size is the whole token count
    n = math.prod(shape[d] for d in dims)
    with g.rules():
        mean = x.mean(dims, keepdim=True)
        var = (x - mean).square().mean(dims, keepdim=True)
    var = var * (n / (n - correction) if n != correction else math.inf)
    return _whole(x, dims, var.sqrt() if "std" in call.name else var, keepdim)


def _norm(g: Guard, call: Call, p: Any) -> Tensor:
    """The p-norm over the spatial dimensions (and maybe more) written out in rules: sums of
    |x|, of x², or
    the extreme of |x|. At a zero norm its gradient is zero, as torch's is."""
    x, keepdim = call["input"], call["keepdim"]
    _taken(g, call, x)
    dims = _dims(x, call["dim"])
    if call.get("out") is not None:
        raise g.refuse(call.name, "out= has no rule")
    if not _over_spatial(g, call, x, dims):
        return _local(g, call, x, dims, keepdim)
    if call.get("dtype") is not None:
        x = g.marked(x.to(call["dtype"]), g.places(x))
    p = 2 if p == "fro" else p
    if p not in (1, 2, math.inf):
        raise g.refuse(call.name, f"p={p!r} over the spatial dimensions has no rule (1, 2 and "
                       "inf have)")  # fmt: skip
    with g.rules():
        if p == math.inf:
            y = x.abs().amax(dims, keepdim=True)
        elif p == 1:
            y = x.abs().sum(dims, keepdim=True)
        else:
            s = (x * x).sum(dims, keepdim=True)
    if p == 2:
        y = torch.where(s > 0, s, 1).sqrt() * (s > 0)
    return _whole(x, dims, y, keepdim)


@rule(torch.norm, Tensor.norm,
      params="input, p='fro', dim=None, keepdim=False, out=None, dtype=None",
      prefix=True)  # fmt: skip
def norm(g: Guard, call: Call) -> Tensor:
    """Over the spatial dimensions (and maybe more; ConvNeXt-V2's global response
    normalization), p = 1, 2 or inf: written out as sums or extremes of the whole samples
    (whole). Over other dimensions: local."""
    return _norm(g, call, call["p"])


@rule(torch.linalg.vector_norm,
      params="input, ord=2, dim=None, keepdim=False, *, dtype=None, out=None",
      prefix=True)  # fmt: skip
def vector_norm(g: Guard, call: Call) -> Tensor:
    """As ``torch.norm``."""
    return _norm(g, call, call["ord"])


@rule(F.normalize, params="input, p=2.0, dim=1, eps=1e-12, out=None", prefix=True)
def normalize(g: Guard, call: Call) -> Tensor:
    """Over channels (or any dimension but the spatial ones): local. Over every spatial
    dimension (``dim=(2, 3)``, or a flattened token dimension: cross-covariance attention's
    ``F.normalize(q, dim=-1)``), p = 1, 2 or inf: ``x`` over the whole samples' norm
    (``torch.norm``'s rule, all-reduced), clamped to eps as torch's; a block. Over some of
    them: refused."""
    x = call["input"]
    if call["out"] is not None:
        raise g.refuse(call.name, "out= has no rule")
    dims = _dims(x, call["dim"])
    if not set(dims) & set(_spatial(g, x)):  # a window partition's channels too
        return g.marked(call.run(), g.places(x))
    _taken(g, call, x)
    if not set(_spatial(g, x)) <= set(dims):
        raise g.refuse(call.name, "it normalizes over a spatial dimension but not over every "
                       "one (only over all of them, a flattened token dimension, is "
                       "exact)")  # fmt: skip
    with g.rules():
        return x / torch.norm(x, call["p"], dims, keepdim=True).clamp_min(call["eps"])


@rule(*ops("cumsum cumprod", torch, Tensor), params="input, dim, *, dtype=None, out=None")
def scan(g: Guard, call: Call) -> Tensor:
    """A running sum or product (an integral image): along other dimensions local; along a
    split one, each rank's own scan, then the total of the blocks before it in the sample
    added (multiplied) in: one all-gather of every block's last row, whose backward brings
    each later position's gradient back to the rows before it."""
    x, d = call["input"], call["dim"] % call["input"].dim() - call["input"].dim()
    if call["out"] is not None:
        raise g.refuse(call.name, "it writes into out=")
    places = g.places(x)
    y = call.run()
    if d not in places:
        return g.marked(y, places)
    comm, parts, coord = g.grid.axes(len(places))[places.index(d)]
    product = call.func.__name__ == "cumprod"
    if y.shape[d]:
        last = y.narrow(d, y.shape[d] - 1, 1)
    else:  # an empty block: nothing to add (multiply), but it joins the all-gather
        last = y.new_full([1 if i == y.dim() + d else n for i, n in enumerate(y.shape)],
                          float(product))  # fmt: skip
    before = pkf.all_gather(last, comm, d, [1] * parts).narrow(d, 0, coord)
    y = y * before.prod(d, keepdim=True) if product else y + before.sum(d, keepdim=True)
    return g.marked(y, places)
