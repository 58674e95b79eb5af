"""Fetching what an output block reads: the part every spatially split layer shares.

A spatial layer (convolution, transposed convolution, pooling, upsampling) keeps its output
split like ``torch.tensor_split`` over a :class:`~parallelkit.spatial.SpatialGrid` and reads
input rows that other ranks may hold. The steps around the plain torch operation are the same
for all of them, so they live here, public, for the kernels of :mod:`parallelkit.spatial.conv`
and :mod:`parallelkit.spatial.pool` alike:

    fetch          the input rows a :class:`~parallelkit.geometry.Window` reads (halo fetch)
    fetch_ranges   the same for reads no Window describes (transposed convolution, upsampling)
    crop           a local result cut (or zero-extended) to this rank's output block
    empty_output   an empty block that still joins the backward collectives

The rows travel with :func:`parallelkit.functional.gather_rows`, whose backward returns the
halo gradients to their owners; which rows, is pure geometry (:mod:`parallelkit.geometry`).

Legend: ``_blk`` this rank's block, ``(o0, rows)`` an output block along one dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import parallelkit.functional as pkf
from parallelkit.geometry import Window, starts, tensor_split_sizes
from parallelkit.spatial.grid import SpatialGrid


def fetch(
    x_blk: torch.Tensor,
    grid: SpatialGrid,
    windows: Sequence[Window],
    size: Sequence[int],
    fill: float = 0.0,
    native: bool = False,
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The input rows this rank's output block reads along every spatial dimension (padding
    as ``fill``), the output block's size, and the padding left to the torch operation.

    ``native=True``: along a dimension that is not split (one rank), with equal padding on
    both sides, nothing is fetched and the operation pads by itself, which saves a copy of
    the whole block.
    """
    out, pads = [], []
    axes = grid.axes(len(size))
    for dim, (win, n, (comm, parts, _)) in enumerate(zip(windows, size, axes, strict=True)):
        in_sizes, out_sizes, want = win.plan(n, parts)
        if native and parts == 1 and win.pad_lo == win.pad_hi:
            pads.append(win.pad_lo)
        else:
            x_blk = pkf.gather_rows(x_blk, comm, 2 + dim, in_sizes, want, fill)
            pads.append(0)
        out.append(out_sizes[comm.rank])
    return x_blk, tuple(out), tuple(pads)


def fetch_ranges(
    x_blk: torch.Tensor,
    grid: SpatialGrid,
    size: Sequence[int],
    out_size: Callable[[int, int], int],
    needs: Callable[[int, int, int, int], tuple[int, int]],
) -> tuple[torch.Tensor, list[tuple[int, int]], list[int]]:
    """For layers whose output blocks read input rows that no :class:`Window` describes
    (transposed convolution, upsampling): along each dimension, ``out_size(dim, n)`` output
    rows in tensor_split blocks, and ``needs(dim, o0, o1, n)`` the input rows block
    ``[o0, o1)`` reads. Returns the fetched block, this rank's ``(o0, rows)`` output block and
    the first fetched input row, per dimension.
    """
    blocks, firsts = [], []
    for dim, (n, (comm, parts, _)) in enumerate(zip(size, grid.axes(len(size)), strict=True)):
        out_sizes = tensor_split_sizes(out_size(dim, n), parts)
        want = [
            needs(dim, o0, o0 + o, n) for o0, o in zip(starts(out_sizes), out_sizes, strict=True)
        ]
        x_blk = pkf.gather_rows(x_blk, comm, 2 + dim, tensor_split_sizes(n, parts), want)
        blocks.append((starts(out_sizes)[comm.rank], out_sizes[comm.rank]))
        firsts.append(want[comm.rank][0])
    return x_blk, blocks, firsts


def crop(y: torch.Tensor, origins: Sequence[int], blocks: Sequence[tuple[int, int]]):
    """Cut (or zero-extend) a local result whose first row along each dimension is global row
    ``origins[dim]`` to this rank's output block ``(o0, rows)``.

    A cut is a view of ``y``, not a copy: the layer's result is the largest tensor it makes,
    and a copy of it beside ``y`` would be the layer's peak (the few rows cut off stay
    allocated instead). Only rows that no input reaches are zero-extended, by ``F.pad``."""
    pads: list[int] = []
    for dim, (origin, (o0, o)) in enumerate(zip(origins, blocks, strict=True)):
        pads = [origin - o0, o0 + o - origin - y.shape[2 + dim], *pads]  # F.pad: last dim first
    if any(v > 0 for v in pads):
        return F.pad(y, pads)
    for dim, (origin, (o0, o)) in enumerate(zip(origins, blocks, strict=True)):
        y = y.narrow(2 + dim, o0 - origin, o)
    return y


def empty_output(
    x: torch.Tensor, channels: int, hw: Sequence[int], *params: torch.Tensor | None
) -> torch.Tensor:
    """An empty output block that still depends on the fetched input and the parameters, so
    that this rank joins the backward exchanges and all-reduces like every other rank."""
    y = x.new_zeros(x.shape[0], channels, *hw)
    for p in params:
        if p is not None:
            y = y + (0 * p).sum()  # a full zero gradient for p, not an expanded one
    return y
