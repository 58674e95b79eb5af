"""Token mixing rules: attention, contractions and linear maps over all the tokens of split
samples, exact with collectives, and no whole sample on any rank.

A block's *token dimension* holds all of its spatial dimensions: a flattened H x W or
D x H x W (``x.flatten(2)``, a fold in the record), a signal's L, or the grid of MaxViT's grid
partition. Each rank holds a box of the whole token index space
(:func:`parallelkit.spatial.token_comm.token_orders`). On such blocks:

- **Softmax attention** (``F.scaled_dot_product_attention``; ``q @ k.transpose(-2, -1)``,
  ``softmax``, ``@ v``; the same by ``einsum``): queries stay on their rank. For
  ``scaled_dot_product_attention`` of queries, keys and values split alike (self-attention):
  where the heads divide among the ranks and no mask is given, the head all-to-all of
  DeepSpeed-Ulysses (each rank then attends for its share of the heads over every token, with
  1/P of the keys and values; two all-to-alls forward, two backward); otherwise the ring
  (:mod:`parallelkit.spatial.ring_attention`: key/value blocks passed around, partial results
  merged by their log-sum-exp; never more than two key/value blocks on a rank), with a whole
  mask or bias cut to this rank's query rows. Otherwise (the explicit pattern, keys and values
  of another map, such as Segformer's pooled ones, or whole queries) the keys and values are
  all-gathered and put in the whole order: the scores' columns are then the whole samples'
  keys, so a whole mask or bias needs only its rows cut. Keys of a single window (HaloNet's
  blocked attention on a map no larger than its block: the window's rank holds it, the others
  none) are gathered alike. A mask computed from the query block itself (SAM's decomposed
  relative positions: each query's bias from its row's and its column's tables) has this
  rank's query rows already and every key's column: it is taken as it is, its gradient
  staying with the rows.
- **Contractions over tokens** (``k.transpose(-2, -1) @ v`` of linear attention,
  cross-covariance ``q.transpose(-2, -1) @ k``, a whole (M, L) matrix times a block): a local
  product of this rank's tokens, all-reduced; the result is whole.
- **Linear maps over the token axis** (MLP-Mixer's token mixing, a flatten into a ``Linear``):
  each rank multiplies its tokens by the matching columns of the weight, then all-reduces;
  each rank's weight gradient is its columns' share.

Legend: ``L`` the whole token count, ``L_r`` this rank's; ``_w`` a tensor of whole tokens in
the whole order. Every function here returns None where the call is not its pattern, so that
the caller (``norms``: the rules of these operations) refuses as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelkit.spatial import record, token_comm
from parallelkit.spatial.ring_attention import ring_attention
from parallelkit.spatial.rules.registry import Call, Guard, rule, whole_size


def token_dim(g: Guard, t: Any) -> int | None:
    """Where block ``t``'s tokens are (from the end) if one dimension holds all its spatial
    dimensions, else None (a whole tensor, a block with separate spatial dimensions)."""
    if not isinstance(t, Tensor) or not g.is_split(t):
        return None
    places, folds = g.places(t), g.folds(t)
    if len(set(places)) != 1:
        return None
    if len(places) == 1 and not folds:
        return places[0]
    spatial = {k for _, k in folds[0] if isinstance(k, int)} if len(folds) == 1 else None
    if spatial == set(range(len(places))):
        return places[0]
    return None


def _factors(g: Guard, t: Tensor) -> token_comm.Factors:
    folds = g.folds(t)
    return folds[0] if folds else ((whole_size(g, t)[0], 0),)


def count(g: Guard, t: Tensor) -> int:
    """The whole token count of block ``t``'s token dimension (a class token included)."""
    return token_comm.fold_count(_factors(g, t))


def _orders(g: Guard, t: Tensor) -> tuple[list[Tensor], Tensor | None]:
    """Every rank's whole token indices of block ``t`` and where each whole token lies in
    their concatenation (None: in order already); made once per layout."""
    key = ("token orders", _factors(g, t), len(g.places(t)), str(t.device))
    if key not in g.weights:
        orders = token_comm.token_orders(g.grid, _factors(g, t), len(g.places(t)))
        where = token_comm.whole_order(orders)
        g.weights[key] = ([o.to(t.device) for o in orders],
                          None if where is None else where.to(t.device))  # fmt: skip
    return g.weights[key]


def own_tokens(g: Guard, t: Tensor) -> Tensor:
    """The whole token indices of this rank's tokens of block ``t``, in the block's order."""
    return _orders(g, t)[0][g.grid.comm.rank]


def whole_tokens(g: Guard, t: Tensor, whole_out: bool = False) -> Tensor:
    """Block ``t`` with every rank's tokens, in the whole order (a whole tensor, not marked).
    ``whole_out``: what it feeds is whole (not a block), so under the "full" convention its
    gradient is every rank's in full."""
    return gathered_tokens(g, t, whole_out and not record.shares())


def gathered_tokens(g: Guard, t: Tensor, full: bool) -> Tensor:
    """:func:`whole_tokens`; ``full``: every rank holds the whole gradient (a model's output),
    so backward keeps this rank's part, rather than summing each rank's share."""
    orders, where = _orders(g, t)
    sizes = [len(o) for o in orders]
    return token_comm.gather_tokens(t, g.grid.comm, token_dim(g, t), sizes, where, full)


def _same_tokens(g: Guard, a: Tensor, b: Tensor) -> bool:
    """Whether blocks ``a`` and ``b`` hold the same tokens in the same order."""
    return _factors(g, a) == _factors(g, b) and len(g.places(a)) == len(g.places(b))


def _like(g: Guard, y: Tensor, t: Tensor) -> Tensor:
    """``y`` marked a block with the tokens of block ``t``, at the same place."""
    return g.marked(y, g.places(t), g.size_of(t), g.folds(t))


def _rows(g: Guard, t: Tensor, q: Tensor, dim: int) -> Tensor | None:
    """Whole tensor ``t`` (a mask, a bias) cut to query block ``q``'s tokens along ``dim``
    (from the end) where it spans the whole tokens there, its gradient summed; None where
    it has another size there."""
    if t.dim() < -dim or t.shape[dim] == 1:
        return g.summed(t)
    if t.shape[dim] != count(g, q):
        return None
    return g.summed(t).index_select(t.dim() + dim, own_tokens(g, q))


# --------------------------------------------------------------------------- attention
def attention(g: Guard, call: Call) -> Tensor | None:
    """``F.scaled_dot_product_attention`` with the tokens of query, key or value split (their
    dimension -2): see the module docstring."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    split = [t for t in (q, k, v) if g.is_split(t)]
    if any(token_dim(g, t) != -2 for t in split):
        return None
    # A mask made from the query block (SAM's decomposed relative positions): its rows are
    # this rank's queries already, its columns every key in the whole order.
    own_rows = g.is_split(mask)
    if own_rows and not (g.is_split(q) and token_dim(g, mask) == -2 and g.form(mask) == g.form(q)):
        return None
    if call["dropout_p"]:
        raise g.refuse(call.name, "dropout_p > 0 draws a mask of its own per rank")
    if g.is_split(k) != g.is_split(v) or (g.is_split(k) and g.form(k) != g.form(v)):
        return None
    causal, mine = call["is_causal"], g.is_split(q)
    if mine:
        lk = count(g, k) if g.is_split(k) else k.shape[-2]
        if own_rows and mask.shape[-1] != lk:
            return None
        if isinstance(mask, Tensor) and not own_rows and (mask := _rows(g, mask, q, -2)) is None:
            return None
        if causal:  # top left, as torch's: query i sees keys j <= i
            mask = own_tokens(g, q)[:, None] >= torch.arange(lk, device=q.device)
            causal = False
    kw = dict(scale=call["scale"], enable_gqa=call["enable_gqa"])
    if not g.is_split(k):  # whole keys and values meet the query block
        y = F.scaled_dot_product_attention(q, g.summed(k), g.summed(v), mask, 0.0, causal, **kw)
        return _like(g, y, q)
    heads = q.shape[-3] if q.dim() >= 3 else 0
    if (mine and mask is None and not causal and not call["enable_gqa"]
            and k.shape[-3:-2] == v.shape[-3:-2] == q.shape[-3:-2]
            and heads >= g.grid.comm.size > 1 and heads % g.grid.comm.size == 0
            and _same_tokens(g, q, k)):  # fmt: skip
        return _like(g, _by_heads(g, q, k, v, call["scale"]), q)
    if (mine and not call["enable_gqa"] and _same_tokens(g, q, k)
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):  # fmt: skip
        orders, where = _orders(g, k)
        if isinstance(mask, Tensor) and where is not None:  # its columns in rank order
            mask = mask.index_select(-1, torch.cat(orders))
        sizes = [len(o) for o in orders]
        return _like(g, ring_attention(q, k, v, g.grid.comm, sizes, mask, call["scale"]), q)
    k_w, v_w = whole_tokens(g, k, not mine), whole_tokens(g, v, not mine)
    y = F.scaled_dot_product_attention(q, k_w, v_w, mask, 0.0, causal, **kw)
    return _like(g, y, q) if mine else y


def _by_heads(g: Guard, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Attention by the head all-to-all: (.., h, L_r, d) blocks of one token layout become
    (.., h / P, L, d) with every rank's tokens (in rank order, the same for queries, keys and
    values, so the attention over them is the whole one's, permuted), attend, and go back."""
    orders, _ = _orders(g, q)
    sizes, comm = [len(o) for o in orders], g.grid.comm
    qs, ks, vs = (token_comm.heads_to_tokens(t, comm, sizes) for t in (q, k, v))
    y = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
    return token_comm.tokens_to_heads(y, comm, sizes, q.shape[-3])


# --------------------------------------------------------------------------- products
def matmul(g: Guard, x: Any, w: Any) -> Tensor | None:
    """``x @ w`` where a block's tokens are a row or column dimension (see the module
    docstring): the scores ``q @ k^T``, ``attn @ v`` and ``v @ attn^T`` (channels first, as
    SHViT writes it) gather the other operand's tokens;
    contractions over tokens are local products all-reduced."""
    tx, tw = token_dim(g, x), token_dim(g, w)
    if not isinstance(x, Tensor) or not isinstance(w, Tensor) or min(x.dim(), w.dim()) < 2:
        return None
    if tx == -2 and (tw in (-1, -2) or (tw is not None and count(g, w) == 1)):  # q @ k^T;
        return _like(g, x @ whole_tokens(g, w), x)  # attn @ v; keys of one window (HaloNet's
    # on a map no larger than its block: the window's rank holds them, the others none)
    if tx == -1 and tw == -1 and w.shape[-2] == count(g, x):  # v @ attn^T (SHViT): its
        return _like(g, whole_tokens(g, x) @ w, w)  # rows are every key, in the whole order
    if tx == -2 and not g.is_split(w):  # q @ (k^T v), whole matrices by batch: rows local
        return _like(g, x @ g.summed(w), x)
    if tx == -1 and tw == -2 and _same_tokens(g, x, w):  # k^T @ v: a sum over tokens
        return record.summed(x @ w, g.comm)
    if tx is None and not g.is_split(x) and tw == -1:  # whole queries @ k^T: columns local
        return _like(g, g.summed(x) @ w, w)
    if tx is None and not g.is_split(x) and tw == -2:  # whole (.., M, L) @ v: a sum
        if x.shape[-1] != count(g, w):
            return None
        return record.summed(g.summed(x).index_select(-1, own_tokens(g, w)) @ w, g.comm)
    if tx == -1 and not g.is_split(w) and w.shape[-2] == count(g, x):  # over the token axis
        return record.summed(x @ g.summed(w).index_select(-2, own_tokens(g, x)), g.comm)
    return None


@rule(torch.bmm, Tensor.bmm, params="input, mat2", folds=True)
def bmm(g: Guard, call: Call) -> Tensor:
    """As ``matmul`` on blocks: two blocks of one layout whose spatial dimensions are in the
    batch (attention within windows), local; a block's tokens in a row or column dimension,
    as ``matmul`` (scores gather the keys, contractions over tokens all-reduce)."""
    x, w = call["input"], call["mat2"]
    if g.is_split(x) and g.is_split(w) and g.form(x) == g.form(w) and max(g.places(x)) < -2:
        return g.marked(torch.bmm(x, w), g.places(x))
    y = matmul(g, x, w)
    if y is None:
        raise g.refuse(call.name, "it multiplies blocks over a spatial dimension that is not "
                       "a token dimension, or blocks of different layouts")  # fmt: skip
    return y


def linear(g: Guard, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``F.linear`` over the token axis (MLP-Mixer's token mixing; a flatten into a
    ``Linear``): this rank's columns of the weight times its tokens, all-reduced; whole."""
    if token_dim(g, x) != -1 or weight.dim() != 2 or weight.shape[1] != count(g, x):
        return None
    columns = g.summed(weight).index_select(1, own_tokens(g, x))
    y = record.summed(F.linear(x, columns), g.comm)
    return y if bias is None else y + bias


def einsum(g: Guard, subscripts: list[str], output: str, operands: tuple) -> Tensor | None:
    """An explicit ``einsum`` whose blocks each hold their tokens in one letter: operands
    with the first block's layout stay; other blocks are gathered whole (keys, values); the
    first block's token letter must reach the output (its rows), else, where every block
    has one layout and its letter is summed over, a local product all-reduced."""
    blocks = [t for t in operands if g.is_split(t)]
    letters = []
    for sub, t in zip(subscripts, operands, strict=True):
        if g.is_split(t):
            d = token_dim(g, t)
            if d is None or len(sub) != t.dim():
                return None
            letters.append(sub[d])
    first = blocks[0]
    a = letters[0]
    kept = [g.is_split(t) and g.form(t) == g.form(first) and c == a
            for t, c in zip(blocks, letters, strict=True)]  # fmt: skip
    for sub, t in zip(subscripts, operands, strict=True):
        if not g.is_split(t) and a in sub:
            return None
    if a not in output:
        if not all(kept):
            return None
        summed = [t if g.is_split(t) else g.summed(t) for t in operands]
        return record.summed(torch.einsum(",".join(subscripts) + "->" + output, *summed), g.comm)
    args, i = [], 0
    for sub, t in zip(subscripts, operands, strict=True):
        if not g.is_split(t):
            args.append(g.summed(t))
            continue
        if not kept[i] and a in sub:
            return None  # another block with the rows' letter: not the same tokens
        args.append(t if kept[i] else whole_tokens(g, t))
        i += 1
    y = torch.einsum(",".join(subscripts) + "->" + output, *args)
    return g.marked(y, (output.index(a) - len(output),) * len(g.places(first)),
                    g.size_of(first), g.folds(first))  # fmt: skip


@rule(F.multi_head_attention_forward,
      params="query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, "
      "bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=True, "
      "key_padding_mask=None, need_weights=True, attn_mask=None, use_separate_proj_weight=False, "
      "q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, "
      "static_v=None, average_attn_weights=True, is_causal=False", prefix=True)  # fmt: skip
def multi_head_attention(g: Guard, call: Call) -> tuple[Tensor, Tensor | None]:
    """``nn.MultiheadAttention`` written out in rules: the projections (``F.linear``), a view
    to heads, attention over the tokens (``scaled_dot_product_attention``, or, where the
    weights are asked for, ``q @ k^T``, ``softmax`` and ``@ v``, as torch does), and the
    output projection; a mask made additive as torch makes it. Refused: ``bias_k``/``bias_v``,
    ``add_zero_attn``, a key padding mask, static keys, dropout in training, unbatched
    inputs."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    h = call["num_heads"]
    extra = ("bias_k", "bias_v", "key_padding_mask", "static_k", "static_v")
    if any(call[n] is not None for n in extra) or call["add_zero_attn"] or q.dim() != 3:
        raise g.refuse(call.name, "bias_k, bias_v, add_zero_attn, key_padding_mask, static "
                       "keys and unbatched inputs have no rule")  # fmt: skip
    if call["training"] and call["dropout_p"]:
        raise g.refuse(call.name, "dropout_p > 0 in training draws a mask of its own per rank")
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:  # True: not allowed, as torch's
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(mask, -math.inf)
    if isinstance(mask, Tensor) and mask.dim() == 3:  # (N * h, L, S)
        mask = mask.view(-1, h, *mask.shape[1:])
    with g.rules():
        if call["use_separate_proj_weight"]:
            weights = (call["q_proj_weight"], call["k_proj_weight"], call["v_proj_weight"])
        else:
            weights = call["in_proj_weight"].chunk(3)
        biases = (None,) * 3 if call["in_proj_bias"] is None else call["in_proj_bias"].chunk(3)
        heads = []
        for t, w, b in zip((q, k, v), weights, biases, strict=True):
            t = F.linear(t, w, b)  # (L, N, E)
            heads.append(t.view(t.shape[0], t.shape[1], h, -1).permute(1, 2, 0, 3))
        qh, kh, vh = heads  # (N, h, L, d)
        n, _, length, d = qh.shape
        attn = None
        if call["need_weights"]:
            attn = (qh * d**-0.5) @ kh.transpose(-2, -1)
            attn = (attn if mask is None else attn + mask).softmax(-1)
            y = attn @ vh
        else:
            y = F.scaled_dot_product_attention(qh, kh, vh, mask)
        y = y.permute(2, 0, 1, 3).reshape(length, n, -1)
        y = F.linear(y, call["out_proj_weight"], call["out_proj_bias"])
    if attn is not None and call["average_attn_weights"]:  # over the heads: local
        attn = _like(g, attn.mean(1), attn)
    return y, attn
