"""Normalization rules: statistics over the spatial dimensions written out as means of the
whole samples.

GroupNorm, InstanceNorm and LayerNorm over (C,) and the spatial dimensions are rewritten in
operations that have rules (means over the spatial dimensions all-reduced, pointwise
arithmetic), so their gradients, through the whole statistics, are the dense ones. LayerNorm
and Linear over the channels of a channels-last block (ConvNeXt) are local; their weights'
gradients are summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parallelkit.functional as pkf
from parallelkit.spatial.rules import tokens
from parallelkit.spatial.rules.forms import cut_whole
from parallelkit.spatial.rules.registry import Call, Guard, channels_first, rule, whole_size


def _group_norm(g: Guard, x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None,
                eps: float) -> Tensor:  # fmt: skip
    """Written out in rules. A block whose spatial dimensions are folded after the channels
    (MobileViTv2's patches, (N, C, P, N)) takes its statistics over the groups flattened
    into one fold that holds all of them."""
    n, c = x.shape[:2]
    dims = tuple(range(2, x.dim() + 1))  # the group's channels and the spatial dimensions
    channel = (1, c, *(1,) * (x.dim() - 2))
    with g.rules():
        xg = x.reshape(n, groups, c // groups, *x.shape[2:])
        if g.folds(x):
            flat = x.reshape(n, groups, -1)
            mean = flat.mean(-1, keepdim=True)
            var = (flat - mean).square().mean(-1, keepdim=True)
            shape = (n, groups, *(1,) * (x.dim() - 1))
            mean, var = mean.reshape(shape), var.reshape(shape)
            centred = xg - mean
        else:
            mean = xg.mean(dims, keepdim=True)
            centred = xg - mean
            var = centred.square().mean(dims, keepdim=True)
        y = (centred / torch.sqrt(var + eps)).reshape(x.shape)
        if weight is not None:
            y = y * weight.view(channel)
        if bias is not None:
            y = y + bias.view(channel)
    return y


@rule(F.group_norm, params="input, num_groups, weight=None, bias=None, eps=1e-5", folds=True)
def group_norm(g: Guard, call: Call) -> Tensor:
    """Written out as means over the spatial dimensions (all-reduced, whole) and pointwise
    operations, so the statistics' gradients are summed (smp's FPN decoder); on spatial
    dimensions folded after the channels too (MobileViTv2's GroupNorm over its patches)."""
    x = call["input"]
    if not g.folds(x):
        channels_first(g, call, x)
    elif any(x.dim() + d < 2 for d in g.places(x)):
        raise g.refuse(call.name, "its channels (dimension 1) hold a spatial dimension")
    return _group_norm(g, call["input"], call["num_groups"], call["weight"], call["bias"],
                       call["eps"])  # fmt: skip


@rule(F.instance_norm,
      params="input, running_mean=None, running_var=None, weight=None, bias=None, "
      "use_input_stats=True, momentum=0.1, eps=1e-5")  # fmt: skip
def instance_norm(g: Guard, call: Call) -> Tensor:
    """With each sample's own statistics: group norm with one channel per group; running
    statistics, where given, updated as torch does, from the whole samples' means and
    unbiased variances averaged over the batch. With the running statistics (eval):
    pointwise."""
    x, mean, var = call["input"], call["running_mean"], call["running_var"]
    ndim = channels_first(g, call, x)
    c, eps, momentum = x.shape[1], call["eps"], call["momentum"]
    channel, spatial = (1, c, *(1,) * ndim), tuple(range(2, 2 + ndim))
    if not call["use_input_stats"]:
        with g.rules():
            y = (x - mean.view(channel)) / torch.sqrt(var.view(channel) + eps)
            if call["weight"] is not None:
                y = y * call["weight"].view(channel)
            return y + call["bias"].view(channel) if call["bias"] is not None else y
    if (mean is not None or var is not None) and momentum is None:
        raise g.refuse(call.name, "momentum=None (a cumulative average) has no rule")
    if mean is not None or var is not None:
        with torch.no_grad(), g.rules():
            stats = (x.mean(spatial).mean(0), x.var(spatial).mean(0))
        for running, new in zip((mean, var), stats, strict=True):
            if running is not None:
                running.mul_(1 - momentum).add_(new.to(running.dtype), alpha=momentum)
    return _group_norm(g, x, c, call["weight"], call["bias"], eps)


@rule(F.layer_norm, params="input, normalized_shape, weight=None, bias=None, eps=1e-5",
      prefix=True)  # fmt: skip
def layer_norm(g: Guard, call: Call) -> Tensor:
    """Over the channels of a channels-last block (ConvNeXt): local, weights' gradients
    summed. Over (C,) and the spatial dimensions (a WGAN-GP critic's
    ``nn.LayerNorm([C, H, W])``): statistics written out as means of the whole samples; the
    affine parameters, shaped for the whole samples, cut to the block."""
    return _over_last(g, call, centred=True)


@rule(F.rms_norm, params="input, normalized_shape, weight=None, eps=None", prefix=True)
def rms_norm(g: Guard, call: Call) -> Tensor:
    """As ``F.layer_norm``'s rule, without the mean: over a channels-last block's channels
    (timm's and torch's ``RMSNorm`` on tokens) local, weights' gradients summed; over (C,) and
    the spatial dimensions, the mean square written out over the whole samples."""
    return _over_last(g, call, centred=False)


def _over_last(g: Guard, call: Call, centred: bool) -> Tensor:
    """A layer norm (``centred``) or an RMS norm over the last ``normalized_shape``
    dimensions of block ``input``: local where they follow its spatial dimensions, written out
    as means of the whole samples where they end in them."""
    x, shape = call["input"], tuple(call["normalized_shape"])
    weight, bias, eps = g.summed(call["weight"]), g.summed(call.get("bias")), call["eps"]
    spatial = g.places(x)
    if -len(shape) > max(spatial):  # trailing dimensions after the spatial ones
        if centred:
            return g.marked(F.layer_norm(x, shape, weight, bias, eps), spatial)
        return g.marked(F.rms_norm(x, shape, weight, eps), spatial)
    if spatial != tuple(range(-len(spatial), 0)) or g.folds(x):
        raise g.refuse(call.name, "it acts over a spatial dimension of a channels-last block")
    size = whole_size(g, x)
    if shape[-len(size) :] != size:
        raise g.refuse(
            call.name, f"its normalized_shape {shape} does not end in the whole samples' {size}"
        )
    dims = list(range(x.dim() - len(shape), x.dim()))
    if eps is None:  # torch's rms_norm: the machine epsilon of the input's dtype
        eps = torch.finfo(x.dtype).eps
    with g.rules():
        y = x - x.mean(dims, keepdim=True) if centred else x
        square = y.square().mean(dims, keepdim=True)
    y = y / torch.sqrt(square + eps)
    block = (..., *g.grid.block(*size))
    if weight is not None:
        y = y * weight[block]
    if bias is not None:
        y = y + bias[block]
    return g.marked(y, spatial)


@rule(F.linear, params="input, weight, bias=None", prefix=True)
def linear(g: Guard, call: Call) -> Tensor:
    """Over the channels of a channels-last block (ConvNeXt's MLP): local, weights' gradients
    summed. Over a token dimension holding every spatial one (MLP-Mixer's token mixing, a
    flatten into a ``Linear``): ``tokens``. Over one spatial dimension of several, from its
    whole size to the same (sMLP's mixing along W, or along H after a transpose): each rank's
    slice of the weight, the partial maps reduce-scattered along that dimension
    (:func:`along_one`). Other sizes over a spatial dimension: refused."""
    x, weight, bias = call["input"], call["weight"], call["bias"]
    spatial = g.places(x)
    if max(spatial) == -1:
        if (y := tokens.linear(g, x, weight, bias)) is not None:
            return y
        if weight.dim() == 2:
            y = along_one(g, weight.t(), x, left=False, bias=bias)
            if y is not None:
                return y
        raise g.refuse(call.name, "it acts over a spatial dimension (permute the channels "
                       "last first)")  # fmt: skip
    return g.marked(F.linear(x, g.summed(weight), g.summed(bias)), spatial)


@rule(torch.matmul, Tensor.matmul, Tensor.__matmul__, params="input, other", prefix=True)
def matmul(g: Guard, call: Call) -> Tensor:
    """A block times a whole matrix over its last dimension, which is not spatial (a linear
    map over channels-last features): local, the matrix's gradient summed. Two blocks of one
    layout whose spatial dimensions are all batch dimensions (attention within windows,
    ``q @ k.transpose(-2, -1)`` on a window partition): local. A block's token dimension
    (every spatial dimension in one) as rows or columns: ``tokens`` (global attention's
    scores gather the keys, sums over tokens all-reduce). A whole square matrix times a block
    over one of its spatial dimensions, ``p @ x`` over its rows or ``x @ q`` over its last
    (a bilinear transform's, BAT's): each rank's slice of the matrix, the partial maps
    reduce-scattered along that dimension (:func:`along_one`)."""
    x, w = call["input"], call["other"]
    both = g.is_split(x) and g.is_split(w) and x.dim() == w.dim() > 2
    if both and g.form(x) == g.form(w) and max(g.places(x)) < -2:
        return g.marked(torch.matmul(x, w), g.places(x))
    if (y := tokens.matmul(g, x, w)) is not None:
        return y
    if both:
        raise g.refuse(call.name, "it multiplies blocks over a spatial dimension, or blocks "
                       "of different layouts")  # fmt: skip
    if g.is_split(x) and not g.is_split(w) and w.dim() == 2 and max(g.places(x)) != -1:
        return g.marked(torch.matmul(x, g.summed(w)), g.places(x))  # over channels last
    if (y := along_one(g, x, w, left=True)) is not None:  # whole p @ block x
        return y
    if (y := along_one(g, w, x, left=False)) is not None:  # block x @ whole q
        return y
    raise g.refuse(
        call.name, "it contracts a spatial dimension, or a whole tensor with a block (a block "
        "times a matrix over its channels-last dimension, and a whole square matrix along one "
        "spatial dimension, have rules)",
    )  # fmt: skip


def along_one(g: Guard, w: Any, x: Any, left: bool, bias: Tensor | None = None
              ) -> Tensor | None:  # fmt: skip
    """A whole matrix applied along one spatial dimension of block ``x``, the others kept:
    ``w @ x`` over its rows (``left``) or ``x @ w`` over its last dimension, from the whole
    size n of that dimension to n again (so the result is a block of the same layout); None
    where that is not the call. Each rank multiplies its block by the matrix's slice of its
    own rows, which gives its share of every output row; a reduce-scatter along the
    dimension's ranks sums the shares into each rank's rows (its backward all-gathers the
    rows' gradients). The matrix's gradient comes from this rank's slice only, summed as any
    whole tensor's that meets blocks (``summed``)."""
    if not isinstance(w, Tensor) or not g.is_split(x) or g.is_split(w) or w.dim() < 2:
        return None
    d, places = (-2 if left else -1), g.places(x)
    if g.folds(x) or places.count(d) != 1:
        return None
    size = whole_size(g, x)
    i = places.index(d)
    if w.shape[-2:] != (size[i], size[i]) or (bias is not None and bias.shape != (size[i],)):
        return None
    comm, parts, _ = g.grid.axes(len(size))[i]
    rows = g.grid.block(*size)[i]
    w = g.summed(w)
    y = torch.matmul(w[..., rows], x) if left else torch.matmul(x, w[..., rows, :])
    if parts > 1:
        y = pkf.reduce_scatter(y, comm, dim=y.dim() + d)
    if bias is not None:
        y = y + g.summed(bias)[rows]
    return g.marked(y, places)


@rule(F.scaled_dot_product_attention,
      params="query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, "
      "enable_gqa=False", prefix=True)  # fmt: skip
def attention(g: Guard, call: Call) -> Tensor:
    """Attention within windows folded into the batch (timm's and MONAI's window attention):
    local where query, key and value are blocks of one layout whose spatial dimensions are
    all batch dimensions; a whole mask of every window is cut to this rank's windows. Over a
    token dimension (global attention over H x W tokens, MaxViT's grid): ``tokens``, with
    the head all-to-all, the ring, or gathered keys and values. With dropout, or over one
    spatial dimension of several: refused."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    form = g.form(q) if g.is_split(q) else None
    blocks = (q, k, v, mask) if g.is_split(mask) else (q, k, v)
    if form is None or any(not g.is_split(t) or g.form(t) != form for t in blocks) or max(
        form[0]
    ) >= -2:
        if (y := tokens.attention(g, call)) is not None:
            return y
        raise g.refuse(call.name, "it attends over a spatial dimension, or over blocks of "
                       "different layouts")  # fmt: skip
    if call["dropout_p"]:
        raise g.refuse(call.name, "dropout_p > 0 draws a mask of its own per rank")
    if isinstance(mask, Tensor) and not g.is_split(mask):
        mask = cut_whole(g, mask, q, call.name)
    y = F.scaled_dot_product_attention(q, k, v, mask, 0.0, call["is_causal"], scale=call["scale"],
                                       enable_gqa=call["enable_gqa"])  # fmt: skip
    if y.numel() == 0 and isinstance(mask, Tensor) and mask.requires_grad:
        # No window here: torch's attention leaves the mask out of the graph, so a bias
        # table behind it would get its gradient on the other ranks only, and their gradient
        # all-reduces would start at other moments than this rank's (a hang beside the
        # model's own collectives on one communicator). A zero gradient keeps it in step.
        y = y + (0 * mask).sum()
    return g.marked(y, form[0])


@rule(torch.einsum, params="equation, *operands", folds=True, prefix=True)
def einsum(g: Guard, call: Call) -> Tensor:
    """Local where every spatial dimension's letter is in the output and only in blocks of
    one layout, at their own spatial dimension (``"nchw,dc->ndhw"``: a map over channels),
    or in whole operands of the whole size there, cut to the block's rows (MViTv2's
    relative positions, ``"byhwc,hkc->byhwk"``); whole operands' gradients summed. Blocks
    that hold their tokens in one letter
    (``"bhid,bhjd->bhij"``, ``"bhij,bhjd->bhid"``, ``"bhdn,bhen->bhde"``): ``tokens``, class
    tokens before them too (MONAI's ViT)."""
    equation, operands = call["equation"], call["operands"]
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    inputs, _, output = equation.replace(" ", "").partition("->")
    subscripts = inputs.split(",")
    if "." in equation or not output or len(subscripts) != len(operands):
        raise g.refuse(call.name, "only explicit equations without '...' have a rule")
    first = call.blocks[0]
    if any(g.folds(b) != g.folds(first) for b in call.blocks):
        raise g.refuse(call.name, "its blocks are folded differently")
    letters = [subscripts[operands.index(first)][d] for d in g.places(first)]
    why, cuts = None, {}
    for i, (sub, t) in enumerate(zip(subscripts, operands, strict=True)):
        mine = [sub[d] for d in g.places(t)] if g.is_split(t) else []
        if g.is_split(t) and mine != letters:
            why = "mixes a spatial dimension with another"
        elif not g.is_split(t) and set(sub) & set(letters):
            cuts[i] = _rows_of(g, first, letters, sub, t)
            why = "mixes a spatial dimension with another" if cuts[i] is None else why
    if why is None and any(c not in output for c in letters):
        why = "sums over a spatial dimension"
    if why is not None:
        if (y := tokens.einsum(g, subscripts, output, tuple(operands))) is not None:
            return y
        raise g.refuse(call.name, f"{equation!r} {why}")
    summed = [cuts[i] if i in cuts else t if g.is_split(t) else g.summed(t)
              for i, t in enumerate(operands)]  # fmt: skip
    dims = tuple(output.index(c) - len(output) for c in letters)
    return g.marked(torch.einsum(equation, *summed), dims)


def _rows_of(g: Guard, block: Tensor, letters: list[str], sub: str, t: Tensor) -> Tensor | None:
    """Whole einsum operand ``t`` (subscripts ``sub``) cut to ``block``'s rows along each
    spatial letter it has, where it is of the whole size there (its gradient summed, each
    rank's share); None where it is not, or ``block`` is folded (its letters then name one
    dimension)."""
    if g.folds(block) or len(set(letters)) != len(letters) or len(set(sub)) != len(sub):
        return None
    size = whole_size(g, block)
    rows = g.grid.block(*size)
    index: list[Any] = [slice(None)] * t.dim()
    for at, c in enumerate(sub):
        if c in letters:
            k = letters.index(c)
            if t.shape[at] != size[k]:
                return None
            index[at] = rows[k]
    return g.summed(t)[tuple(index)]


@rule(torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu, exact="refused", folds=True,
      prefix=True)  # fmt: skip
def recurrent(g: Guard, call: Call) -> Any:
    """Refused: a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: Sequencer's LSTMs
    along H and W) is a scan, each position's state made from the one before it, so a
    sequence split over ranks runs one rank after another; and its states are not
    blocks of any layout."""
    raise g.refuse(call.name, "it is a recurrent scan: each position's state is made from the "
                   "one before it, so it needs the whole sequence on one rank (a split one "
                   "would run one rank after another)")  # fmt: skip
