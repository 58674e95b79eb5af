"""Ring attention: softmax attention whose queries, keys and values are all split by tokens,
exact with no rank ever holding every key and value.

Each rank keeps its queries. The key/value blocks travel around the ring of the group (rank r
sends to r + 1 and receives from r - 1), P steps, and each step's partial attention is merged
into the running result by its log-sum-exp: the running max and sum of the online softmax
(ring attention, as Megatron's context parallelism and PhysicsNeMo run it). Backward goes
around the ring again with the keys and values and their gradients: each rank recomputes the
probabilities of each block from the saved log-sum-exp, adds its queries' share to the
travelling key/value gradients, and after P steps and one more shift every block's gradient
is back on its rank.

Memory per rank: its own queries, keys and values, one travelling key/value pair (with their
gradients in backward) and one (L_r x L_s) block of scores at a time, never the (L_r x L)
scores or the whole keys and values that gathering them would hold. Time: P - 1 shifts
forward and P backward, one after the other, against one all-gather and one reduce-scatter.

Shapes: q (.., L_r, d), k (.., Lk_r, d), v (.., Lk_r, e) with the same leading dimensions;
``sizes[s]`` the number of keys rank s holds; ``mask`` (.., L_r, Lk) broadcastable to the
scores, this rank's query rows and every key's column, the columns in rank order (rank 0's
keys, then rank 1's, ...: each step's columns are then a slice, not a copy), boolean (True:
attend) or additive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from parallelkit.comm import Communicator


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    comm: Communicator,
    sizes: Sequence[int],
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k_all, v_all, mask)`` for this rank's queries, with
    the keys and values passed around the ring (see the module docstring)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    keys = tuple((sum(sizes[:r]), n) for r, n in enumerate(sizes))  # (start, count) per rank
    return _RingAttention.apply(q, k, v, mask, comm, keys, scale)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, keys: tuple[int, int],
            scale: float) -> Tensor:  # fmt: skip
    """This rank's queries against the key block at ``keys`` (start, count) of the mask's
    columns: (.., L_r, Lk_s), masked as SDPA masks."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is None:
        return s
    m = mask.narrow(-1, *keys)
    return s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a query whose keys here are all masked) as 0, so that
    ``exp(s - lse)`` is 0 there rather than NaN."""
    return lse.masked_fill(lse == -math.inf, 0.0)


def _merge(out: Tensor, lse: Tensor, out_s: Tensor, lse_s: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint keys merged by their log-sum-exps: each weighted
    by its share of the total exp-sum (the online softmax's rescaling by the running max)."""
    total = torch.logaddexp(lse, lse_s)
    at = _finite(total)
    return (out * (lse - at).exp().unsqueeze(-1)
            + out_s * (lse_s - at).exp().unsqueeze(-1)), total  # fmt: skip


def _shift(comm: Communicator, tensors: Sequence[Tensor], tokens: int) -> list[Tensor]:
    """``tensors`` sent to the next rank; the previous rank's, of ``tokens`` tokens, back."""
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    bufs = [t.new_empty((*t.shape[:-2], tokens, t.shape[-1])) for t in tensors]
    return comm.neighbor_exchange([(nxt, t) for t in tensors], [(prv, b) for b in bufs])


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, comm, keys, scale):  # type: ignore[override]
        rank, size = comm.rank, comm.size
        k_s, v_s, out, lse = k, v, None, None
        for step in range(size):
            src = (rank - step) % size  # whose keys and values this rank holds now
            s = _scores(q, k_s, mask, keys[src], scale)
            lse_s = torch.logsumexp(s, -1)
            out_s = (s - _finite(lse_s).unsqueeze(-1)).exp() @ v_s
            out, lse = (out_s, lse_s) if out is None else _merge(out, lse, out_s, lse_s)
            if step < size - 1:
                k_s, v_s = _shift(comm, (k_s, v_s), keys[(src - 1) % size][1])
        ctx.comm, ctx.keys, ctx.scale = comm, keys, scale
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, mask, out, lse = ctx.saved_tensors
        comm, keys, scale = ctx.comm, ctx.keys, ctx.scale
        rank, size = comm.rank, comm.size
        mask_grad = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros_like(mask) if mask_grad else None
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dP * P) of the softmax backward
        dq = torch.zeros_like(q)
        k_s, v_s, dk_s, dv_s = k, v, torch.zeros_like(k), torch.zeros_like(v)
        for step in range(size):
            src = (rank - step) % size
            p = (_scores(q, k_s, mask, keys[src], scale) - _finite(lse).unsqueeze(-1)).exp()
            ds = p * (dout @ v_s.transpose(-2, -1) - delta)  # the scores' gradient
            dq += (ds @ k_s) * scale
            dk_s += (ds.transpose(-2, -1) @ q) * scale
            dv_s += p.transpose(-2, -1) @ dout
            if dmask is not None:
                part = dmask.narrow(-1, *keys[src])
                part += ds.sum_to_size(part.shape)
            if step < size - 1:  # the gradients travel with their keys and values
                tokens = keys[(src - 1) % size][1]
                k_s, v_s, dk_s, dv_s = _shift(comm, (k_s, v_s, dk_s, dv_s), tokens)
        # Each rank now holds the whole gradient of the next rank's block: one more shift.
        dk, dv = _shift(comm, (dk_s, dv_s), k.shape[-2]) if size > 1 else (dk_s, dv_s)
        return dq, dk, dv, dmask, None, None, None
