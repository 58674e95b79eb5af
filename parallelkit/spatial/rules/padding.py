"""Rules that move a sample's rows to new places: ``F.pad`` (constant, reflect, replicate,
circular), ``roll`` (a cyclic shift) and ``flip`` (a reversal).

Each rank's new block is rows of the sample that may lie in other ranks' blocks: offset by the
pads, wrapped around, or mirrored. Pure geometry names them, and
:func:`parallelkit.functional.gather_rows` fetches them from whoever holds them; its backward
sends each row's gradient home. Along dimensions that are not split, all three are local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parallelkit.functional as pkf
from parallelkit.geometry import starts, tensor_split_sizes
from parallelkit.spatial.rules.forms import gathered_whole
from parallelkit.spatial.rules.registry import Call, Guard, channels_first, ops, rule, whole_size
from parallelkit.spatial.rules.tokens import token_dim
from parallelkit.spatial.token_comm import prefix_of, with_prefix


def _token_pad(g: Guard, x: Tensor, pads: list[int], mode: str, value: float) -> Tensor | None:
    """Block ``x`` padded by a constant before its token dimension only: on the first rank,
    which holds the prefix, the pad itself; the others keep their tokens (a new tensor).
    None for any other pad."""
    d = token_dim(g, x)
    at = 2 * (-d - 1) if d is not None else len(pads)  # F.pad's order: the last dimension first
    if mode != "constant" or at >= len(pads) or pads[at] <= 0 or any(pads[:at] + pads[at + 1 :]):
        return None
    fold = g.folds(x)[0]
    y = F.pad(x, pads, value=value) if g.grid.at_origin else x.view_as(x)
    return g.marked(y, g.places(x), folds=(with_prefix(fold, prefix_of(fold) + pads[at]),))


@rule(F.pad, params="input, pad, mode='constant', value=None", prefix=True)
def pad(g: Guard, call: Call) -> Tensor:
    """The padded samples' blocks in tensor_split layout: with a constant (negative pads
    crop), each rank fetches its new block's rows (``gather_rows``, the constant outside the
    sample); reflect, replicate and circular read mirrored or wrapped rows in three fetches of
    contiguous rows per dimension. The pads are the whole samples' (a pad computed from
    ``x.shape`` is computed from the whole size: timm's "same" padding, a pad to a multiple
    of a patch size, MONAI's pad to a skip connection's size). Pads of other dimensions only
    are local, on any block (EfficientViT pads its tokens' value vectors with a 1). A
    constant pad before a token dimension only (CoaT's zero row in the class token's place)
    is a prefix of that constant, as a class token (``indexing._class_tokens``). Any other pad
    of a dimension holding folded spatial ones (BotNet's and HaloNet's relative logits,
    skewed to absolute positions by a pad, a flatten and a reshape across rows) runs on the
    whole tensor, all-gathered (``forms.gathered_whole``): what follows is whole, and is cut
    to the blocks where it meets them (the attention scores)."""
    x, pads = call["input"], list(call["pad"])
    mode, value = call["mode"], call["value"] or 0.0
    padded = {x.dim() - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]}
    if not padded & {x.dim() + d for d in g.places(x)}:
        return g.marked(call.run(), g.places(x))
    if g.folds(x):
        if (y := _token_pad(g, x, pads, mode, value)) is not None:
            return y
        if (whole := gathered_whole(g, x)) is None:
            raise g.refuse(call.name, "it pads a dimension that holds folded spatial ones")
        return F.pad(whole, pads, mode, call["value"])  # a relative-to-absolute skew: whole
    last = tuple(range(-len(g.places(x)), 0))
    if g.places(x) != last:  # channels last (Swin's pads): the same on (N, C, *spatial)
        return _pad_moved(g, x, pads, mode, call["value"])
    ndim = channels_first(g, call, x)
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise g.refuse(call.name, f"mode={mode!r} has no rule")
    size = whole_size(g, x)
    spatial = [*pads, *[0] * (2 * ndim)][: 2 * ndim]  # F.pad's order: the last dimension first
    rest = pads[2 * ndim :]
    if mode != "constant" and (rest or min(spatial) < 0):
        raise g.refuse(call.name, f"mode={mode!r} with pads {pads} (only the spatial "
                       "dimensions, >= 0)")  # fmt: skip
    y, axes, new_size = x, g.grid.axes(ndim), []
    for d in range(ndim):
        n, (comm, parts, _) = size[d], axes[d]
        lo, hi = spatial[2 * (ndim - 1 - d)], spatial[2 * (ndim - 1 - d) + 1]
        if mode == "constant":
            new = tensor_split_sizes(n + lo + hi, parts)
            want = [(a - lo, a - lo + m) for a, m in zip(starts(new), new, strict=True)]
            y = pkf.gather_rows(y, comm, 2 + d, tensor_split_sizes(n, parts), want, value)
        elif lo or hi:
            y = _wrap_pad(g, y, 2 + d, n, lo, hi, mode)
        new_size.append(n + lo + hi)
    if rest:  # leading dimensions: local
        y = F.pad(y, [0, 0] * ndim + rest, value=value)
    return g.marked(y, size=tuple(new_size))


def _pad_moved(g: Guard, x: Tensor, pads: list[int], mode: str, value: Any) -> Tensor:
    """``F.pad`` of a block whose spatial dimensions are not last: moved last (the others
    keep their order), padded with the pads moved alike, and moved back."""
    at = tuple(x.dim() + d for d in g.places(x))
    order = [d for d in range(x.dim()) if d not in at] + list(at)
    per = {x.dim() - 1 - i: pads[2 * i : 2 * i + 2] for i in range(len(pads) // 2)}
    moved_pads = [v for d in reversed(order) for v in per.get(d, (0, 0))]
    last = tuple(range(x.dim() - len(at), x.dim()))
    with g.rules():
        y = F.pad(x.movedim(at, last), moved_pads, mode, value)
        return y.movedim(last, at)


def _source_row(i: int, n: int, mode: str) -> int:
    """The sample's row that padded row ``i`` (of ``n`` rows, counted from the first row)
    repeats in F.pad's ``mode``."""
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i if i >= n else i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


def _wrap_pad(g: Guard, x: Tensor, dim: int, n: int, lo: int, hi: int, mode: str) -> Tensor:
    """This rank's block of the whole images padded along ``dim`` by ``lo`` and ``hi`` rows
    in a non-constant ``mode``. Every rank takes part in all three fetches (an empty range
    where its block has no such rows), and keeps each in its graph, so that the backward's
    exchanges meet on every rank."""
    if (mode == "reflect" and max(lo, hi) >= n) or max(lo, hi) > n:
        raise ValueError(
            f"spatial parallelism: F.pad mode={mode!r} of {max(lo, hi)} rows needs more "
            f"rows than the sample's {n}"
        )
    comm, parts, rank = g.grid.axes(x.dim() - 2)[dim - 2]
    new = tensor_split_sizes(n + lo + hi, parts)
    pieces = []
    for part in range(3):  # the low pad, the image, the high pad
        want, mine = [], []
        for r, (a, m) in enumerate(zip(starts(new), new, strict=True)):
            first, stop = ((a, min(a + m, lo)), (max(a, lo), min(a + m, lo + n)),
                           (max(a, lo + n), a + m))[part]  # fmt: skip
            rows = [_source_row(i - lo, n, mode) for i in range(first, stop)]
            want.append((min(rows), max(rows) + 1) if rows else (0, 0))
            mine = rows if r == rank else mine
        got = pkf.gather_rows(x, comm, dim, tensor_split_sizes(n, parts), want)
        if mine != list(range(want[rank][0], want[rank][1])):  # mirrored or repeated
            order = torch.tensor([i - want[rank][0] for i in mine], device=x.device)
            got = got.index_select(dim, order.long())
        pieces.append(got)
    return torch.cat(pieces, dim)


@rule(*ops("roll", torch, Tensor), params="input, shifts, dims=None")
def roll(g: Guard, call: Call) -> Tensor:
    """A cyclic shift (Swin's shifted windows): along other dimensions local; along a split
    one, each rank's new rows are the sample's rows ``shift`` before them, wrapped around, in
    at most two contiguous runs that two row fetches bring from whoever holds them."""
    x, shifts, dims = call["input"], call["shifts"], call["dims"]
    if dims is None:
        raise g.refuse(call.name, "it acts on the flattened tensor")
    shifts = shifts if isinstance(shifts, tuple | list) else (shifts,)
    dims = dims if isinstance(dims, tuple | list) else (dims,)
    record = g.places(x)
    size, axes = whole_size(g, x), g.grid.axes(len(record))
    y = x
    for shift, dim in zip(shifts, dims, strict=True):
        d = dim % x.dim() - x.dim()
        if d not in record:
            y = torch.roll(y, shift, d)
            continue
        k = record.index(d)
        n, (comm, parts, _) = size[k], axes[k]
        sizes = tensor_split_sizes(n, parts)
        runs: list[list[tuple[int, int]]] = [[], []]
        for a, m in zip(starts(sizes), sizes, strict=True):
            first = (a - shift) % n
            runs[0].append((first, min(n, first + m)))
            runs[1].append((0, m - (runs[0][-1][1] - first)))
        y = torch.cat([pkf.gather_rows(y, comm, d, sizes, want) for want in runs], d)
    return g.marked(y, record)


@rule(*ops("flip", torch, Tensor), params="input, dims")
def flip(g: Guard, call: Call) -> Tensor:
    """A reversal (a flip written into the forward, as test-time flips are): along other
    dimensions local; along a split one, each rank's new rows are the sample's rows at the
    mirror of its place, ``n - stop`` to ``n - start``, one row fetch from whoever holds them,
    then reversed."""
    x, dims = call["input"], call["dims"]
    dims = [d % x.dim() - x.dim() for d in (dims if isinstance(dims, tuple | list) else (dims,))]
    record = g.places(x)
    if len(set(dims)) < len(dims) or not dims:
        return g.marked(call.run(), record)  # torch's error for a dimension named twice
    size, axes = whole_size(g, x), g.grid.axes(len(record))
    y = x
    for d in dims:
        if d not in record:
            y = y.flip(d)
            continue
        k = record.index(d)
        n, (comm, parts, _) = size[k], axes[k]
        sizes = tensor_split_sizes(n, parts)
        y = pkf.gather_rows(y, comm, d, sizes, _mirrored(sizes, n)).flip(d)
    return g.marked(y, record)


def _mirrored(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Per block of ``sizes`` (of ``n`` rows), the rows at the mirror of its place."""
    return [(n - a - m, n - a) for a, m in zip(starts(sizes), sizes, strict=True)]
