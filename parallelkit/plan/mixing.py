"""The token-mixing calls of a walk: what the spatial strategy makes exact with collectives
inside the spatial region (``parallelkit/spatial/rules/tokens.py`` and the rules that read
other ranks' rows), recorded while the walk's forward runs on the meta device (a torch
function mode) beside its layers. The cost model prices each record
(:func:`parallelkit.plan.mixing_cost.mixing_traffic`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Mixing:
    """One token-mixing call in the spatial region and what its collectives move, per sample.

    ``kind`` and ``numel`` (whole tensors, one sample):

        attention  self-attention by ``scaled_dot_product_attention`` (queries, keys and values
                   of the same tokens): the head all-to-all or the ring, as the number of
                   ranks decides; numel (q, k, v, output)
        gather     keys or values (of another map, or of the explicit ``q @ k^T``, ``@ v``)
                   all-gathered whole; numel of each gathered tensor
        reduce     a contraction over tokens, a linear map over the token axis or an
                   ``AvgPool1d`` over the flattened tokens: its small result all-reduced;
                   numel (result,)
        fetch      rows another rank holds read in place of this rank's own: a ``flip`` along
                   a spatial dimension (the mirrored rows), a ``grid_sample`` (the rows its
                   coordinates reach, counted as one block: a smooth warp reads mostly its
                   own, a rotation another rank's); numel (the tensor read,)
        axis       a whole square matrix over one spatial dimension of a map (BAT's ``p @ x``,
                   a ``Linear`` along W): each rank's partial map reduce-scattered along
                   it forward, all-gathered backward; numel (the map,)
        move       a view or reshape that cuts the map's dimensions into groups of ``groups``
                   rows (Swin's window partition, a space-to-depth) or merges them back:
                   where a rank's block is not whole groups, rows move to a neighbour first;
                   numel (the tensor,)

    ``tokens``: the map flattened into the queries' (attention) or the gathered tensors' token
    dimension, whose block a rank holds. ``heads``: the attention's heads; ``masked``: a mask,
    causal masking or grouped keys/values, which the head all-to-all does not take.
    """

    name: str  # the module it ran in
    kind: str  # attention | gather | reduce | fetch | axis | move
    tokens: Shape
    numel: tuple[int, ...]
    heads: int = 0
    masked: bool = False
    groups: Shape = ()  # move: the group size along each of the map's dimensions (1: uncut)
    along: Shape = ()  # fetch, axis: the map's dimensions read across (0 for its first)


MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
RESHAPES = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
FLIPS = (torch.flip, torch.Tensor.flip)
ROW_READS = (*FLIPS, torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod,
             F.grid_sample)  # fmt: skip


CLASS_TOKENS = 8
"""The most whole tokens before a map's tokens that the walk reads as class tokens."""


def _arg(args: tuple, kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


class Mixings(TorchFunctionMode):
    """Records the token-mixing calls of the spatial region while the walk's forward runs
    (see the module docstring): what each moves under ``parallelkit/spatial/rules/tokens.py``'s
    rules. A call is handled as a whole (its inner calls are not seen): nn.MultiheadAttention
    is one record, as its rule writes it out."""

    def __init__(self, names: list[str], dims: int) -> None:
        super().__init__()
        self.names = names  # the modules running, innermost last
        self.dims = dims  # the samples' spatial dimensions
        self.maps: dict[int, Shape] = {}  # the region's feature maps by their token count
        self.records: list[Mixing] = []
        self.spatial = True

    def enter(self, name: str) -> None:
        self.names.append(name)

    def leave(self) -> None:
        self.names.pop()

    def add_map(self, size: Sequence[int]) -> None:
        if size and math.prod(size) > 1:
            self.maps.setdefault(math.prod(size), tuple(size))

    def _is_map(self, shape: Sequence[int]) -> bool:
        """Whether ``shape`` ends with one of the region's maps of 2 or 3 dimensions (a signal's
        L is its token dimension as it is)."""
        return any(len(m) > 1 and tuple(shape[-len(m) :]) == m for m in self.maps.values())

    def token_map(self, shape: Sequence[int]) -> Shape:
        """The map flattened into a dimension of per-sample ``shape``; () for none or a map."""
        if not self.spatial or self._is_map(shape) or tuple(shape[1:]) in self.maps.values():
            return ()
        return next((self.maps[n] for n in shape if n in self.maps), ())

    def tokens_at(self, t: Any, dim: int) -> Shape | None:
        """The map whose tokens tensor ``t`` holds in dimension ``dim``, if it does, maybe
        after a few class tokens (a class token, a distillation token, register tokens)."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or self._is_map(t.shape):
            return None
        n = t.shape[dim]
        return next((self.maps[n - p] for p in range(CLASS_TOKENS + 1) if n - p in self.maps),
                    None)  # fmt: skip

    def add(self, kind: str, tokens: Shape, *tensors: torch.Tensor, **more: Any) -> None:
        numel = tuple(t.numel() for t in tensors)  # batch 1: one sample
        self.records.append(Mixing(self.names[-1], kind, tokens, numel, **more))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.spatial and self.maps:
            if func is F.scaled_dot_product_attention:
                self._attention(args, kwargs, out)
            elif func is F.multi_head_attention_forward:
                self._multihead(args, kwargs, out)
            elif func in MATMULS and len(args) == 2:
                self._product(*args, out)
            elif func is F.linear:
                self._linear(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), out)
            elif func in RESHAPES and isinstance(args[0], torch.Tensor):
                self._regroup(args[0], out)
            elif func in ROW_READS:
                self._rows(func, args, kwargs)
        return out

    def _rows(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A flip, a running sum or product along a spatial dimension, or a ``grid_sample`` of
        a map (N, C, *spatial): the rows each rank reads of the others' blocks."""
        x = _arg(args, kwargs, 0, "input")
        if not isinstance(x, torch.Tensor) or x.dim() != self.dims + 2:
            return
        spatial = range(2, x.dim())
        if func is F.grid_sample:
            self.add("fetch", tuple(x.shape[2:]), x, along=tuple(range(self.dims)))
        elif func in FLIPS:
            dims = _arg(args, kwargs, 1, "dims")
            dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
            if along := tuple(sorted({d % x.dim() - 2 for d in dims if d % x.dim() in spatial})):
                self.add("fetch", tuple(x.shape[2:]), x, along=along)
        elif (d := _arg(args, kwargs, 1, "dim")) is not None and d % x.dim() in spatial:
            self.add("reduce", tuple(x.shape[2:]), x.select(d, 0))  # each block's last row

    def _regroup(self, x: torch.Tensor, out: Any) -> None:
        """A reshape that cuts a map's dimensions into (groups, rows of a group), or merges
        such groups back into the map: the rows ``parallelkit/spatial/rules/views.py`` moves
        between neighbours where blocks are not whole groups. Seen where the map itself is
        in the tensor (a padded map of another size is not)."""
        if not isinstance(out, torch.Tensor) or out.shape == x.shape:
            return
        for whole, cut in ((x.shape, out.shape), (out.shape, x.shape)):
            for m in self.maps.values():
                if len(m) > 1 and (groups := _groups(tuple(whole), tuple(cut), m)):
                    self.add("move", m, x, groups=groups)
                    return

    def _attention(self, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """The rule's choice: self-attention (queries, keys and values of one map, alike)
        goes by heads or around the ring; split keys of another map are gathered."""
        q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        mask, causal = _arg(args, kwargs, 3, "attn_mask"), _arg(args, kwargs, 5, "is_causal")
        gqa = kwargs.get("enable_gqa", False)
        tq, tk = self.tokens_at(q, -2), self.tokens_at(k, -2)
        if tk is None:  # whole keys and values: the queries' rows stay local
            return
        if tq == tk and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and not gqa:
            heads = q.shape[-3] if q.dim() >= 3 else 0
            masked = mask is not None or bool(causal)
            self.add("attention", tq, q, k, v, out, heads=heads, masked=masked)
        else:
            self.add("gather", tk, k, v)

    def _multihead(self, args: tuple, kwargs: dict, out: Any) -> None:
        """nn.MultiheadAttention on (L, N, E): by ``scaled_dot_product_attention`` where no
        weights are asked for, else by the explicit pattern (keys and values gathered)."""
        q, k, v = args[:3]
        tq, tk = self.tokens_at(q.transpose(0, 1), -2), self.tokens_at(k.transpose(0, 1), -2)
        if tk is None:
            return
        if kwargs.get("need_weights", True) or tq != tk:
            self.add("gather", tk, k, v)  # their projections: as many elements
            return
        masked = kwargs.get("attn_mask") is not None or kwargs.get("is_causal", False)
        y = out[0] if isinstance(out, tuple) else out
        self.add("attention", tq, q, k, v, y, heads=args[4], masked=masked)

    def _product(self, x: Any, w: Any, out: Any) -> None:
        """``x @ w`` as ``tokens.matmul`` reads it: scores and ``attn @ v`` gather ``w``;
        a contraction over tokens, or a map over them, all-reduces its result."""
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return
        if self._along_one(w, x, out, -2) or self._along_one(x, w, out, -1):
            return
        if min(x.dim(), w.dim()) < 2:
            return
        rows, cols = self.tokens_at(x, -2), self.tokens_at(x, -1)
        w_tokens = self.tokens_at(w, -2) or self.tokens_at(w, -1)
        if rows and w_tokens:  # q @ k^T, attn @ v
            self.add("gather", w_tokens, w)
        elif cols:
            self.add("reduce", cols, out)  # k^T @ v, a whole (L, M) map over the tokens
        elif rows is None and cols is None and (t := self.tokens_at(w, -2)):
            self.add("reduce", t, out)  # a whole (M, L) matrix times a block

    def _linear(self, x: Any, weight: Any, out: Any) -> None:
        """``F.linear`` over the token axis (MLP-Mixer's token mixing): its output all-reduced.
        Over (N, F) it is the fully connected layer that ends the region (gathered there)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or weight.dim() != 2:
            return
        if (t := self.tokens_at(x, -1)) and weight.shape[1] == x.shape[-1]:
            self.add("reduce", t, out)
        else:
            self._along_one(x, weight, out, -1)

    def _along_one(self, x: Any, w: Any, out: Any, d: int) -> bool:
        """A whole square matrix over one spatial dimension ``d`` (-2: ``w @ x``, -1: ``x @ w``)
        of a map (N, C, *spatial), to a map of the same shape (BAT's bilinear transform,
        sMLP's ``Linear`` along W): each rank's partial map reduce-scattered along it."""
        if not isinstance(x, torch.Tensor) or x.dim() != self.dims + 2 or self.dims < 2:
            return False
        n = x.shape[d]
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or w.shape[-2:] != (n, n):
            return False
        size, i = tuple(x.shape[2:]), self.dims + d
        known = self.maps.values()
        if size not in known and size[::-1] in known:  # a transposed image: H last
            size, i = size[::-1], self.dims - 1 - i
        elif size not in known:  # not a map of the region (attention's (N, h, L, d))
            return False
        self.add("axis", size, out, along=(i,))
        return True


def _groups(whole: Shape, cut: Shape, m: Shape) -> Shape | None:
    """The group size along each dimension of map ``m`` where shape ``whole`` holds ``m`` and
    shape ``cut`` holds, at the same place, each of its sizes whole or as (groups, rows), at
    least one cut; None otherwise."""
    k = len(m)
    for i in range(len(whole) - k + 1):
        if tuple(whole[i : i + k]) != m:
            continue
        lead = math.prod(whole[:i])
        for j in range(len(cut)):
            if math.prod(cut[:j]) == lead and (groups := _cut_at(cut, j, m)):
                return groups
    return None


def _cut_at(cut: Shape, j: int, m: Shape) -> Shape | None:
    """The group sizes where ``cut`` holds map ``m`` from place ``j`` on, each size whole or
    as (groups, rows), at least one of them in more than one group; None otherwise.

    A size as (1, rows) is one window along that dimension, as the rules read it only beside
    a real partition (Swin's ``view(B, 2, 7, 1, 7, C)``); alone it is a dimension of one put
    before the map (``view(n, 1, h, w)`` of an (n, h, w) map, the walk's batch of one), which
    moves nothing."""
    groups, partition = [], False
    for n in m:
        if j < len(cut) and cut[j] == n:
            groups.append(1)
            j += 1
        elif j + 1 < len(cut) and cut[j] * cut[j + 1] == n and cut[j] < n:
            groups.append(cut[j + 1])
            partition = partition or cut[j] > 1
            j += 2
        else:
            return None
    return tuple(groups) if partition else None


