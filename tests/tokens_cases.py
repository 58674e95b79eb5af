"""Rank-side cases for token mixing on split samples: small networks that flatten a conv
feature map into tokens and mix all of them (global attention by ``F.scaled_dot_product_attention``,
by ``q @ k^T``/softmax/``@ v`` and by ``einsum``, with masks, biases and causality; whole
queries pooling the tokens; linear attention; MLP-Mixer's token MLP; a flatten into a
``Linear``; reductions over the tokens (ViT's mean pooling, sums, extremes, logsumexp, var,
std and norm); GCNet's context pooling with its softmax over the tokens, and a log_softmax;
cross-covariance attention over tokens normalized by ``F.normalize``), run parallelized
against the dense network: outputs, the input's gradient and every parameter's gradient,
float64.

``broken``: the collectives that bring the other ranks' tokens replaced by this rank's own
(attention over local keys only, a ring that passes nothing on, a sum over local tokens
only): the negative control.
"""

from __future__ import annotations

import copy
import math
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit import geometry
from parallelkit.comm import Communicator
from parallelkit.nn import SyncBatchNorm
from parallelkit.spatial import pool, relayout
from parallelkit.spatial import ring_attention as ring
from parallelkit.spatial.conv import transposed_out_size
from parallelkit.spatial.rules import forms, pooling, tokens, windows

Triple = tuple[str, torch.Tensor, torch.Tensor]


UNPOOL_WINDOWS = {"unpool": (2, 2, 0), "unpool overlapping": (3, 2, 1)}
"""TokenNet's kinds that pool with indices and unpool: (kernel, stride, padding)."""


class TokenNet(nn.Module):
    """conv -> tokens (N, L, C) -> one token-mixing ``kind`` -> back to (N, C, *spatial) ->
    conv; ``dims`` spatial dimensions."""

    def __init__(self, kind: str, dims: int = 2, c: int = 8, heads: int = 2, size: tuple = ()):
        super().__init__()
        conv = getattr(nn, f"Conv{dims}d")
        self.kind, self.heads, self.c = kind, heads, c
        tokens_n = 1
        for n in size:
            tokens_n *= n
        self.stem = conv(3, c, 3, padding=1)
        self.norm = nn.LayerNorm(c)
        self.token_bn = nn.BatchNorm1d(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.bias = nn.Parameter(0.1 * torch.randn(heads, tokens_n, tokens_n))
        self.queries = nn.Parameter(torch.randn(1, heads, 3, c // heads))
        self.mix1, self.mix2 = nn.Linear(tokens_n, 6), nn.Linear(6, tokens_n)
        self.fc = nn.Linear(c * tokens_n, 5)
        self.mha = nn.MultiheadAttention(c, heads, batch_first=True)
        allowed = torch.rand(tokens_n, tokens_n, generator=torch.Generator().manual_seed(2)) > 0.3
        masked = ~(allowed | torch.eye(tokens_n, dtype=torch.bool))
        self.register_buffer("mask", masked.double())  # DataParallel broadcasts no bool
        self.head = conv(c, 2, 3, padding=1)
        self.pool_fc = nn.Linear(12 * c + 2, 5)
        self.gc_mask, self.gc_t = conv(c, 1, 1), nn.Linear(c, c)
        self.temperature = nn.Parameter(1 + 0.1 * torch.randn(heads, 1, 1))
        self.talk1, self.talk2 = nn.Conv2d(heads, heads, 1), nn.Conv2d(heads, heads, 1)
        self.patch_norm, self.patch_qkv = nn.GroupNorm(1, c), nn.Conv2d(c, 1 + 2 * c, 1)
        self.window_w, self.cols_proj = nn.Parameter(torch.randn(3, 4)), nn.Linear(9 * c, c)
        self.rel_h = nn.Parameter(torch.randn(size[0] if size else 1, 3, c))  # (H, K, C)
        if len(size) == 2:  # SAM's tables of (query row, key row) and (query col, key col)
            self.rel_rows = nn.Parameter(0.3 * torch.randn(size[0], size[0], c // heads))
            self.rel_cols = nn.Parameter(0.3 * torch.randn(size[1], size[1], c // heads))
        windows = UNPOOL_WINDOWS.get(kind, (2, 2, 0))  # kernel, stride, padding
        self.pool_i = getattr(nn, f"MaxPool{dims}d")(*windows, return_indices=True)
        self.unpool = getattr(nn, f"MaxUnpool{dims}d")(*windows)
        self.fold_in = conv(c, 9 * c, 1)
        self.pab_top, self.pab_center = conv(c, 4, 1), conv(c, 4, 1)
        self.pab_bottom, self.pab_out = conv(c, c, 3, padding=1), conv(c, c, 3, padding=1)
        self.cls = nn.Parameter(torch.randn(1, 2, c))  # a class and a distillation token
        self.pos = nn.Parameter(0.1 * torch.randn(1, 2 + tokens_n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        n, c, *spatial = x.shape
        t = x.flatten(2).transpose(1, 2)  # (N, L, C)
        L, h = t.shape[1], self.heads
        if self.kind == "flatten linear":  # a classifier head over the flattened features
            return self.fc(F.relu(x).flatten(1))
        if self.kind == "class token output":  # a ViT's hidden states returned, class tokens
            u = torch.cat((self.cls.expand(n, -1, -1), t), 1) + self.pos  # first: whole
            return self.qkv(self.norm(u))
        if self.kind == "token pool":  # reductions over the flattened tokens: a whole head
            # (t[:, 0:] as timm's ViT pools past its prefix tokens, of which it has none here)
            f = F.gelu(x).flatten(2)  # (N, C, L)
            feats = [f.mean(-1), t[:, 0:].sum(1) / L, f.amax(-1), t.amin(1), f.logsumexp(-1),
                     f.var(-1), t.std(1, correction=0), f.norm(dim=-1), f.mean((1, 2))[:, None],
                     f.mean(1).logsumexp(-1, keepdim=True),
                     F.normalize(x, dim=(2, 3)).square().mul(x).sum((2, 3))]  # fmt: skip
            # VOLO's token-labelling head: the maximum over the tokens with its index
            top, where = t.max(1)
            feats += [top, f.min(-1).values, 1e-3 * where.to(f.dtype)]
            return self.pool_fc(torch.cat(feats, 1))
        if self.kind == "gc context":  # GCNet: a softmax over the tokens, a weighted sum
            logits = self.gc_mask(x).flatten(2)  # (N, 1, L)
            weights = logits.softmax(-1)
            context = (x.flatten(2) @ weights.transpose(1, 2)).squeeze(-1)  # (N, C), whole
            logp = F.log_softmax(x.flatten(2), 2).reshape(n, c, *spatial)
            gate = self.gc_t(context).reshape(n, c, *(1 for _ in spatial))
            return self.head(x + gate + 0.1 * logp)
        if self.kind in UNPOOL_WINDOWS:  # SegNet: max pooling's indices, MaxUnpool to them
            k, s, p = UNPOOL_WINDOWS[self.kind]
            d, whole = len(spatial), x.shape[2:]
            y, index = self.pool_i(x)
            up = self.unpool(self.gc_mask(y).sigmoid() * y, index, output_size=whole)
            pool_f, unpool_f = getattr(F, f"max_pool{d}d"), getattr(F, f"max_unpool{d}d")
            _, index_f = pool_f(up.relu() + x, k, s, p, return_indices=True)  # functional
            numbers = index_f.double().mean(tuple(range(2, 2 + d)), keepdim=True)  # the plane's
            return self.head(x + up + unpool_f(y, index_f, k, s, p, output_size=whole)
                             + 1e-3 * numbers)  # fmt: skip
        if self.kind == "tensor unfold":  # HaloNet-style sliding windows with a halo, by hand
            win = F.pad(x, (1, 1, 1, 1)).unfold(2, 3, 1).unfold(3, 4, 2)  # (N, C, H, W', 3, 4)
            return self.head((win * self.window_w).sum((-2, -1)))
        if self.kind == "F.unfold":  # im2col, then a linear map of each position's window
            (hh, ww) = spatial
            cols = F.unfold(x, 3, padding=1, stride=(1, 2))  # (N, 9C, H * W')
            y = self.cols_proj(cols.transpose(1, 2)).transpose(1, 2)  # (N, C, H * W')
            return self.head(y.reshape(n, c, hh, (ww - 1) // 2 + 1))
        if self.kind == "F.fold":  # VOLO's outlook attention: each position's 3 x 3 window,
            (hh, ww) = spatial  # summed back into the map where the windows overlap (col2im)
            cols = self.fold_in(x).flatten(2)  # (N, 9C, H * W)
            same = F.fold(cols, (hh, ww), 3, padding=1)
            up = F.fold(cols.tanh(), (2 * hh, 2 * ww - 1), 3, padding=1, stride=2)
            return self.head(x + same + F.avg_pool2d(up, 2, ceil_mode=True))
        if self.kind == "patch attention":  # MobileViTv2: 2 x 2 patches folded, (N, C, P, N)
            (hh, ww), r = spatial, 2
            p = x.reshape(n, c, hh // r, r, ww // r, r).permute(0, 1, 3, 5, 2, 4)
            p = self.patch_norm(p.reshape(n, c, r * r, -1))  # GroupNorm over C, P and patches
            q, k, v = self.patch_qkv(p).split([1, c, c], dim=1)  # a 1x1 conv on the fold
            context = (k * F.softmax(q, dim=-1)).sum(-1, keepdim=True)  # (N, C, P, 1), whole
            y = F.relu(v) * context.expand_as(v)
            y = y.reshape(n, c, r, r, hh // r, ww // r).permute(0, 1, 4, 2, 5, 3)
            return self.head(x + y.reshape(n, c, hh, ww))
        if self.kind.startswith("scrambled reshape"):  # smp's MAnet PABBlock, as written
            top = self.pab_top(x).flatten(2)  # (N, 4, L)
            center = self.pab_center(x).flatten(2).transpose(1, 2)  # (N, L, 4)
            bottom = self.pab_bottom(x).flatten(2).transpose(1, 2)  # (N, L, C)
            attn = torch.matmul(center, top).view(n, -1).softmax(1).view(n, L, L)
            mixed = torch.matmul(attn, bottom).reshape(n, c, *spatial)  # (N, L, C) read as
            if self.kind.endswith("in place"):  # (N, C, H, W): no transpose. Written into:
                mixed = mixed.clone()  # x moves to its layout, not it to x's
                mixed += x
            return self.head(self.pab_out(x + mixed))
        if self.kind == "token selection":  # MAE: a random third of the tokens kept (whole),
            # encoded, and put back among mask tokens in their places
            ids = torch.multinomial(torch.ones(n, L), max(L // 3, 1),
                                    generator=torch.Generator().manual_seed(3))  # fmt: skip
            kept = t[torch.arange(n)[:, None], ids]  # (N, k, C)
            same = t[:, ids[0] - L]  # the first sample's choice for all, negative indices
            kept = kept + self.proj(self.norm(kept)) + 0.5 * same
            back = self.cls[:, :1].expand(n, L, c).clone()
            back[torch.arange(n)[:, None], ids] = kept
            return self.head((t + back).transpose(1, 2).reshape(n, c, *spatial))
        if self.kind == "class token":  # DeiT: two tokens before the patch tokens
            u = torch.cat((self.cls[:, :1].expand(n, -1, -1), self.cls[:, 1:].expand(n, -1, -1),
                           t), 1) + self.pos  # fmt: skip
            d = c // h
            q, k, v = self.qkv(self.norm(u)).reshape(n, L + 2, 3, h, d).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)  # (N, h, 2 + L, d)
            # MONAI's SABlock on a ViT with a class token: the same attention by einsum
            attn = torch.einsum("bhxd,bhyd->bhxy", q, k).mul(d**-0.5).softmax(-1)
            a = a + 0.5 * torch.einsum("bhxy,bhyd->bhxd", attn, v)
            # CaiT's class attention: the class token's query over every token, written out
            attn_cls = ((q[:, :, 0:1] @ k.transpose(-2, -1)) * d**-0.5).softmax(-1) @ v
            a = a + F.pad(v[:, :, 2:] * 0.5, (0, 0, 2, 0))  # CoaT: zeros in the tokens' place
            y = self.proj(a.transpose(1, 2).reshape(n, L + 2, c))
            pooled = y[:, 0] + y[:, 1] + attn_cls.transpose(1, 2).reshape(n, c) + y[:, 2:].mean(1)
            gate = self.gc_t(pooled).reshape(n, c, *(1 for _ in spatial))  # whole
            return self.head(x + y[:, 2:].transpose(1, 2).reshape(n, c, *spatial) + gate)
        if self.kind == "token batchnorm":  # LeViT's LinearNorm: BatchNorm1d over (N * L, C)
            y = self.token_bn(self.proj(t).flatten(0, 1)).reshape_as(t)
            return self.head(x + y.transpose(1, 2).reshape(n, c, *spatial))
        if self.kind == "token mlp":  # MLP-Mixer: a linear map over the token axis
            mixed = self.mix2(F.gelu(self.mix1(self.norm(t).transpose(1, 2))))
            return self.head(x + mixed.reshape(n, c, *spatial))
        if self.kind.startswith("mha"):  # nn.MultiheadAttention, with a boolean mask
            weights = self.kind == "mha"
            y, _ = self.mha(t, t, t, need_weights=weights, attn_mask=self.mask.bool())
            return self.head(x + y.transpose(1, 2).reshape(n, c, *spatial))
        q, k, v = self.qkv(self.norm(t)).reshape(n, L, 3, h, c // h).permute(2, 0, 3, 1, 4)
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.kind == "sdpa bias":  # a whole relative-position bias as a float mask
            y = F.scaled_dot_product_attention(q, k, v, self.bias)
        elif self.kind == "decomposed relative positions":  # SAM's ViT: each query's bias
            # from its row's and its column's tables, (N h, L, L), the attention's float mask
            hh, ww = spatial
            qb, kb, vb = (t.reshape(n * h, L, c // h) for t in (q, k, v))
            r_q = qb.reshape(n * h, hh, ww, c // h)
            rows = torch.einsum("bhwc,hkc->bhwk", r_q, self.rel_rows)
            cols = torch.einsum("bhwc,wkc->bhwk", r_q, self.rel_cols)
            bias = (rows[:, :, :, :, None] + cols[:, :, :, None, :]).reshape(-1, L, L)
            y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias).view(n, h, L, -1)
        elif self.kind == "sdpa causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "explicit":  # timm's Attention without fused attention; SHViT's
            attn = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + self.bias).softmax(-1)
            channels_first = v.transpose(-2, -1) @ attn.transpose(-2, -1)  # v @ attn^T
            y = attn @ v + 0.5 * channels_first.transpose(-2, -1)
        elif self.kind == "einsum":  # MONAI's SABlock; MViTv2's relative positions by row
            attn = torch.einsum("bhxd,bhyd->bhxy", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)
            y = torch.einsum("bhxy,bhyd->bhxd", attn, v)
            rel = torch.einsum("nchw,hkc->nhwk", x, self.rel_h)  # a whole (H, K, C) table
            x = x + rel.mean(-1).unsqueeze(1)
        elif self.kind == "talking heads":  # EfficientFormerV2: 1x1 convs over the heads
            attn = self.talk2(self.talk1(q @ k.transpose(-2, -1)).softmax(-1))
            y = attn @ v
        elif self.kind == "map softmax":  # MAnet's position attention: one softmax, whole map
            attn = (q @ k.transpose(-2, -1)).reshape(n, -1).softmax(-1).view(n, h, L, L)
            y = attn @ v
        elif self.kind == "linear attention":  # sums over tokens: k^T v, then q (k^T v)
            kv = k.softmax(-1).transpose(-2, -1) @ v
            y = q.softmax(-1) @ kv + torch.einsum("bhnd,bhne->bhde", k, v).sum() * 1e-3
        elif self.kind == "relu linear attention":  # EfficientViT's LiteMLA: v padded by a 1
            q, k = F.relu(q), F.relu(k)  # so that the sums over tokens bring their normalizer
            kv = k.transpose(-2, -1) @ F.pad(v, (0, 1), mode="constant", value=1.0)
            out = q @ kv
            y = out[..., :-1] / (out[..., -1:] + 1e-3)
        elif self.kind == "xca":  # XCiT's cross-covariance attention over normalized tokens
            qn = F.normalize(q.transpose(-2, -1), dim=-1)  # (N, h, d, L)
            kn = F.normalize(k.transpose(-2, -1), dim=-1)
            attn = ((qn @ kn.transpose(-2, -1)) * self.temperature).softmax(-1)  # whole
            y = (attn @ v.transpose(-2, -1)).transpose(-2, -1)
        elif self.kind == "pooling queries":  # whole learned queries over every token
            pooled = F.scaled_dot_product_attention(self.queries.expand(n, -1, -1, -1), k, v)
            scores = (self.queries @ k.transpose(-2, -1)).exp()  # local columns
            pooled = pooled + (scores @ v) / L  # a whole (M, L) matrix times v: a sum
            y = v + pooled.mean(2, keepdim=True)
        else:
            raise ValueError(self.kind)
        y = self.proj(y.transpose(1, 2).reshape(n, L, c))
        return self.head(x + y.transpose(1, 2).reshape(n, c, *spatial))


def token_parity(
    comm: Communicator, kind: str, grid: dict, shape: tuple, heads: int = 2,
    broken: bool = False, ring_fault: str | None = None,
) -> list[Triple]:  # fmt: skip
    """The parallelized TokenNet(kind) against the dense one on a batch of 2 samples of
    ``shape`` (C, *spatial). ``ring_fault``: the ring attention with a fault (negative
    controls): "no shift" (each rank's keys and values never leave it) or "no rescale"
    (partial results added without their log-sum-exp weights); or, not in the ring, "no
    relayout" (a block read in another layout where it is, nothing exchanged), or "own pooled
    rows" (each output block unpools only the pooled rows its rank holds)."""
    torch.manual_seed(0)
    dense = TokenNet(kind, len(shape) - 1, heads=heads, size=shape[1:]).double()
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(copy.deepcopy(dense), g, g)
    x = torch.randn(2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_dense, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = dense(x_dense)
    y.square().sum().backward()
    with ExitStack() as stack:
        if broken:
            stack.enter_context(mock.patch.object(tokens, "whole_tokens", _own_tokens))
            stack.enter_context(mock.patch.object(forms, "gathered_tokens", _own_tokens))
            stack.enter_context(mock.patch.object(tokens, "_by_heads", _own_heads))
            stack.enter_context(mock.patch.object(tokens.record, "summed", lambda t, _: t))
            stack.enter_context(mock.patch.object(windows, "fetch", _halo_off_by_one))
            stack.enter_context(mock.patch.object(pooling, "_plane", _block_numbers))
            stack.enter_context(mock.patch.object(windows, "conv_transpose_blocks", _alone))
            stack.enter_context(mock.patch.object(SyncBatchNorm, "forward", _local_batch_norm))
        if ring_fault == "no shift" or broken:
            stack.enter_context(mock.patch.object(ring, "_shift", lambda c, ts, n: list(ts)))
        if ring_fault == "no rescale":
            stack.enter_context(mock.patch.object(ring, "_merge", _sum_unweighted))
        if ring_fault == "no relayout":
            stack.enter_context(mock.patch.object(relayout, "_move", _reshaped_in_place))
        if ring_fault == "own pooled rows":
            stack.enter_context(mock.patch.object(pool, "fetch_ranges", _own_pooled_rows))
        y_mine = model(x_mine)
        y_mine.square().sum().backward()
    out = [("output", y_mine.detach(), y.detach())]
    if x_mine.grad is not None:
        out.append(("input grad", x_mine.grad, x_dense.grad))
    wanted = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        key = ".".join(part for part in name.split(".") if part != "module")
        if key in wanted and wanted[key].grad is not None:
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            out.append((f"{key} grad", got, wanted[key].grad))
    return out


def _local_batch_norm(self, x):  # type: ignore[no-untyped-def]
    """The negative control of a synchronized norm: statistics of this rank's block alone."""
    return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                        self.training, self.momentum or 0.0, self.eps)  # fmt: skip


def _reshaped_in_place(x, comm, send, recv, size):  # type: ignore[no-untyped-def]
    """The negative control of a relayout: each rank's elements read in the new layout where
    they are (a local reshape), nothing exchanged."""
    flat = x.reshape(x.shape[0], -1)[:, :size]
    return torch.cat([flat, flat.new_zeros(x.shape[0], size - flat.shape[1])], 1)


def _sum_unweighted(out, lse, out_s, lse_s):  # type: ignore[no-untyped-def]
    """The negative control of the ring's merge: partial attentions added as they are."""
    return out + out_s, torch.logaddexp(lse, lse_s)


def _own_tokens(g, t, whole_out=False):  # type: ignore[no-untyped-def]
    """The negative control: "every rank's tokens" that are only this rank's."""
    return t


def _own_heads(g, q, k, v, scale):  # type: ignore[no-untyped-def]
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _halo_off_by_one(x, grid, windows, size, native=False):  # type: ignore[no-untyped-def]
    """The negative control of the unfolds: the fetched rows one row off."""
    x_halo, out_size, pad = _FETCH(x, grid, windows, size, native)
    return x_halo.roll(1, 2), out_size, pad


_FETCH = windows.fetch


def _alone(x, weight, bias, stride, padding, extra, dilation, groups, grid, size):  # type: ignore[no-untyped-def]
    """The negative control of the fold: each block's windows summed alone, the rows they
    reach in the neighbours' blocks dropped (the scatter not sent)."""
    want = _CONV_T(x, weight, bias, stride, padding, extra, dilation, groups, grid, size)
    y = F.conv_transpose2d(x, weight, None, stride, padding, extra, groups, dilation)
    out = torch.zeros_like(want)
    crop = []
    whole = transposed_out_size(size, weight.shape[2:], stride, padding, extra, dilation)
    for d, (w, o) in enumerate(zip(grid.block(*size), grid.block(*whole), strict=True)):
        first = w.start * stride[d]  # the global row of y's local row 0
        crop.append(slice(max(o.start - first, 0), max(o.stop - first, 0)))
    part = y[(..., *crop)]
    out[(..., *(slice(0, n) for n in part.shape[2:]))] = part
    return out


_CONV_T = windows.conv_transpose_blocks


def _own_pooled_rows(x_blk, grid, size, out_size, needs):  # type: ignore[no-untyped-def]
    """The negative control of unpooling across blocks: each output block takes only the
    pooled rows its own rank holds, the neighbours' values that land in it never sent."""

    def own(dim, o0, o1, n):  # type: ignore[no-untyped-def]
        parts = grid.axes(len(size))[dim][1]
        rank = geometry.starts(geometry.tensor_split_sizes(out_size(dim, n), parts)).index(o0)
        a, b = geometry.blocks(n, parts)[rank]
        lo, hi = needs(dim, o0, o1, n)
        return (max(lo, a), min(hi, b)) if min(hi, b) > max(lo, a) else (a, a)

    return _FETCH_RANGES(x_blk, grid, size, out_size, own)


_FETCH_RANGES = pool.fetch_ranges


def _block_numbers(index, local, starts, whole):  # type: ignore[no-untyped-def]
    """The negative control of max_pool's indices: numbered in the block's plane."""
    return index


def orders_match_blocks(comm: Communicator, grid: dict, size: tuple) -> list[Triple]:
    """Every rank's token indices (``token_orders``) are its block of the whole index map,
    flattened, and together a permutation of the whole tokens."""
    from parallelkit.spatial import grid_of, token_comm

    g = pk.Grid(comm, **grid)
    spatial = grid_of(g.spatial_comm, g.spatial)
    factors = tuple((n, k) for k, n in enumerate(size))
    orders = token_comm.token_orders(spatial, factors, len(size))
    whole = torch.arange(torch.Size(size).numel()).view(size)
    mine = whole[spatial.block(*size)].reshape(-1)
    flat = torch.cat(orders)
    where = token_comm.whole_order(orders)
    back = flat if where is None else flat[where]
    return [("own order", orders[spatial.comm.rank], mine),
            ("a permutation", back, torch.arange(flat.numel()))]  # fmt: skip


def all_to_all_adjoint(comm: Communicator, heads: int) -> list[Triple]:
    """``heads_to_tokens`` against the whole tensor cut by hand, and the dot-product test
    <F x, y> = <x, F* y> for it and ``tokens_to_heads`` (sums over every rank)."""
    from parallelkit.geometry import starts, tensor_split_sizes
    from parallelkit.spatial import token_comm

    sizes = [3 + r % 2 for r in range(comm.size)]  # uneven token blocks
    gen = torch.Generator().manual_seed(7)
    whole = torch.randn(2, heads, sum(sizes), 3, dtype=torch.float64, generator=gen)
    y_whole = torch.randn(2, heads, sum(sizes), 3, dtype=torch.float64, generator=gen)
    r, share = comm.rank, tensor_split_sizes(heads, comm.size)
    tok = slice(starts(sizes)[r], starts(sizes)[r] + sizes[r])
    hd = slice(starts(share)[r], starts(share)[r] + share[r])
    x = whole[:, :, tok]
    fx = token_comm.heads_to_tokens(x, comm, sizes)
    y = y_whole[:, hd]
    fty = token_comm.tokens_to_heads(y, comm, sizes, heads)
    dots = torch.stack([(fx * y).sum(), (x * fty).sum()])
    dots = comm.all_reduce(dots)
    return [("heads_to_tokens", fx, whole[:, hd]), ("tokens_to_heads", fty, y_whole[:, :, tok]),
            ("<F x, y> = <x, F* y>", dots[0], dots[1])]  # fmt: skip


def relayout_adjoint(comm: Communicator, grid: dict, size: tuple) -> list[Triple]:
    """A (C, H, W) sample's blocks moved to the layout of its memory read as (H * W, C)
    (a fold of H and W, then C): against the whole tensor cut by hand, and the dot-product
    test <F x, y> = <x, F* y> (sums over every rank), F* being autograd's backward."""
    from parallelkit.spatial import grid_of
    from parallelkit.spatial.token_comm import token_orders

    whole_grid = pk.Grid(comm, **grid)
    g = grid_of(whole_grid.spatial_comm, whole_grid.spatial)
    c, (h, w) = 3, size
    source, target = ((c, None), (h, 0), (w, 1)), ((h, 0), (w, 1), (c, None))
    plan = relayout.plan(g, source, target, 2)
    gen = torch.Generator().manual_seed(7)
    whole = torch.randn(2, c * h * w, dtype=torch.float64, generator=gen)
    y_whole = torch.randn(2, c * h * w, dtype=torch.float64, generator=gen)
    mine = token_orders(g, source, 2)[comm.rank]
    theirs = token_orders(g, target, 2)[comm.rank]
    x = whole[:, mine].clone().requires_grad_()
    fx = relayout.relayout(x, g.comm, plan)
    (fx * y_whole[:, theirs]).sum().backward()
    dots = torch.stack([(fx.detach() * y_whole[:, theirs]).sum(), (whole[:, mine] * x.grad).sum()])
    dots = comm.all_reduce(dots)
    return [("relayout", fx.detach(), whole[:, theirs]), ("<F x, y> = <x, F* y>", dots[0], dots[1])]


def dropout_refused(comm: Communicator) -> str:
    """Attention with dropout inside draws its own mask per rank: refused on every rank."""

    class Dropped(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.flatten(2).transpose(1, 2)
            y = F.scaled_dot_product_attention(t, t, t, dropout_p=0.5)
            return y.transpose(1, 2).reshape(x.shape)

    model = pk.parallelize(Dropped(), comm, "spatial")
    try:
        model(torch.randn(1, 2, 4, 4))
    except ValueError as e:
        comm.barrier()
        return str(e)
    return "no error"


def refusal_of(comm: Communicator, kind: str, grid: dict, shape: tuple) -> str:
    """The message of the ValueError the parallelized TokenNet(kind) raises on this rank
    (every rank must raise it: the barrier after it would hang otherwise)."""
    torch.manual_seed(0)
    dense = TokenNet(kind, len(shape) - 1, size=shape[1:]).double()
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(dense, g, g)
    try:
        model(torch.randn(2, *shape, dtype=torch.float64))
    except ValueError as e:
        comm.barrier()
        return str(e)
    return "no error"


# ------------------------------------------------------------- pooling indices on the blocks
# (C, *spatial), the grid, (kernel, stride, padding, dilation, ceil_mode), the input's kind:
# "ties" integers in [-1, 2] (many equal maxima per window); "inf" ties, NaNs and half -inf
# (windows of -inf only at the padding, windows with two NaNs).
POOL_CASES = {
    2: [((2, 10, 6), dict(rows=2), (2, 2, 0, 1, False), "ties"),
        ((2, 9, 7), dict(cols=2), (3, 2, 1, 1, False), "inf"),
        ((2, 10, 5), dict(rows=2), (3, 1, 1, 1, False), "ties"),
        ((2, 11, 5), dict(rows=2), (3, 2, 1, 2, True), "inf"),  # dilation, ceil_mode
        ((2, 7, 6), dict(rows=2), (2, 2, 0, 1, True), "ties"),  # a last window half out
        ((2, 11), dict(rows=2), (3, 2, 1, 1, False), "inf"),  # a signal
        ((2, 5, 6, 4), dict(depth=2), (3, 2, 1, 1, False), "inf")],  # a volume
    3: [((2, 10, 5), dict(rows=3), (3, 2, 1, 1, False), "inf"),
        ((2, 4, 5), dict(rows=3), (2, 2, 0, 1, False), "ties"),  # an empty pooled block
        ((2, 9, 4), dict(rows=3), (5, 3, 2, 1, True), "inf")],
    4: [((2, 11, 7), dict(rows=2, cols=2), (3, 2, 1, 1, False), "inf"),
        ((2, 11, 7), dict(rows=2, cols=2), (2, 2, 0, 1, False), "ties"),
        ((2, 3, 7, 5), dict(rows=2, cols=2), (3, 2, 1, 1, False), "inf"),
        ((2, 13), dict(rows=4), (3, 3, 1, 1, False), "ties")],
}  # fmt: skip
POOL_AXES = ("depth", "rows", "cols")


def _sample(shape: tuple, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-1, 3, (2, *shape), generator=gen).double()
    if kind == "inf":
        where = torch.rand(x.shape, generator=gen)
        x[where < 0.1] = float("nan")
        x[where > 0.5] = -float("inf")
    return x


def pool_indices_parity(comm: Communicator, size: int, fault: str | None = None) -> list:
    """Every case of ``size`` ranks: max pooling with indices and max unpooling to them on
    this rank's blocks (:mod:`parallelkit.spatial.pool`) against torch on the whole input:
    values, indices, the input's gradient; the unpooled output of other values (which
    differ where overlapping windows name one place), their gradient. ``fault``: "padding
    named" (windows of -inf keep the padding row the fetched block's pooling names) or "own
    pooled rows" (unpooling only the pooled rows this rank holds), negative controls."""
    with ExitStack() as stack:
        if fault == "padding named":
            stack.enter_context(mock.patch.object(pool, "_first_real_row", lambda s, d: s))
        if fault == "own pooled rows":
            stack.enter_context(mock.patch.object(pool, "fetch_ranges", _own_pooled_rows))
        out = []
        for case in POOL_CASES[size]:
            out += [(f"{case}: {label}", *rest) for label, *rest in _pool_case(comm, *case)]
        return out


def _pool_case(comm: Communicator, shape: tuple, grid: dict, args: tuple, kind: str) -> list:
    from parallelkit.spatial import grid_of

    (k, s, p, d, ceil), ndim, size = args, len(shape) - 1, shape[1:]
    spatial = grid_of(comm, tuple(grid.get(a, 1) for a in POOL_AXES))
    gen = torch.Generator().manual_seed(2)
    x = _sample(shape, kind).requires_grad_()
    y, idx = getattr(F, f"max_pool{ndim}d")(x, k, s, p, d, ceil, return_indices=True)
    w = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    (y * w).sum().backward()
    cut = (slice(None), slice(None), *spatial.block(*size))
    out_cut = (slice(None), slice(None), *spatial.block(*y.shape[2:]))
    x_blk = x.detach()[cut].clone().requires_grad_()
    windows = pool.pool_windows(k, s, p, d, ceil, ndim, "max_pool")
    y_blk, idx_blk = pool.max_pool_indices_blocks(x_blk, windows, spatial, size)
    (y_blk * w[out_cut]).sum().backward()
    exact = dict(equal_nan=True, rtol=0, atol=0)  # the gradients' sums: in another order
    out = [("values", y_blk.detach(), y.detach()[out_cut], exact),
           ("indices", idx_blk, idx[out_cut], {}),
           ("input grad", x_blk.grad, x.grad[cut], {})]  # fmt: skip
    if d != 1:  # MaxUnpool has no dilation: its windows would not hold the indices
        return out
    v = torch.randn(y.shape, dtype=y.dtype, generator=gen).requires_grad_()
    u = getattr(F, f"max_unpool{ndim}d")(v, idx, k, s, p, output_size=size)
    w_u = torch.randn(u.shape, dtype=u.dtype, generator=gen)
    (u * w_u).sum().backward()
    v_blk = v.detach()[out_cut].clone().requires_grad_()
    unpool_windows = pool.pool_windows(k, s, p, 1, False, ndim, "max_unpool")
    u_blk = pool.max_unpool_blocks(
        v_blk, idx[out_cut], unpool_windows, spatial, y.shape[2:], size
    )  # torch's indices: the pooling's are checked above
    (u_blk * w_u[cut]).sum().backward()
    out.append(("unpooled", u_blk.detach(), u.detach()[cut], exact))
    out.append(("unpooled input grad", v_blk.grad, v.grad[out_cut], exact))
    return out


class _Winners(nn.Module):
    """``max`` and ``min`` over the flattened tokens, values and indices, as VOLO's head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.flatten(2).transpose(1, 2)  # (N, L, C)
        top, low = t.max(1), t.min(1)
        return torch.cat([top.values, low.values, top.indices.to(x.dtype),
                          low.indices.to(x.dtype)], 1)  # fmt: skip


def winners_parity(comm: Communicator, grid: dict) -> list[Triple]:
    """``max(1)`` and ``min(1)`` over tokens on blocks, where the extremes tie across blocks
    (channel 0 constant, channel 1's maximum and minimum twice, far apart) and a NaN sits in
    the last rank's block (channel 2 of sample 0): torch's first winner and its index, the
    gradient to it alone, against the dense module."""
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 0.5
    x[:, 1, 0, 1] = x[:, 1, 4, 2] = 9.0
    x[:, 1, 0, 2] = x[:, 1, 4, 3] = -9.0
    x[0, 2, 4, 0] = math.nan
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(_Winners(), g, g)
    x_dense, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_mine = _Winners()(x_dense), model(x_mine)
    weights = torch.arange(1.0, 1 + y.shape[1], dtype=torch.float64)
    (torch.nan_to_num(y) * weights).sum().backward()
    (torch.nan_to_num(y_mine) * weights).sum().backward()
    return [("winners", torch.nan_to_num(y_mine, nan=-1.0), torch.nan_to_num(y, nan=-1.0)),
            ("input grad", x_mine.grad, x_dense.grad)]  # fmt: skip
