"""Resampling on blocks by per-dimension weights: interpolation of any mode, factor or size,
and adaptive average pooling to any size, from the rows each output block reads.

torch's interpolation (nearest, nearest-exact, linear, bilinear, bicubic, trilinear, area;
``align_corners``; any factor or size; ``antialias``) and adaptive average pooling act on each
spatial dimension apart: output row ``o`` of a dimension is a weighted sum of input rows, and
the weights depend only on the two lengths and the call's arguments. So the weights are the
operation itself applied to the identity (torch computes them; no formula is copied here): an
``(m, n)`` matrix per dimension. Each rank fetches the input rows that its output block's
weights reach (:func:`parallelkit.functional.gather_rows`, whose backward returns their
gradients to their owners) and multiplies, one dimension after another. Nothing the size of a
whole sample is made: the largest new tensors are the fetched block and the matrices.

Legend: ``n`` input rows, ``m`` output rows of one dimension; ``A`` its ``(m, n)`` weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import parallelkit.functional as pkf
from parallelkit.geometry import starts, tensor_split_sizes
from parallelkit.spatial.grid import SpatialGrid

Weights = Callable[[torch.Tensor], torch.Tensor]
"""Applies the 1-D operation to a batch of (n, 1, n) signals (the identity), along the last
dimension; returns (n, 1, m)."""

LINEAR = {"linear", "bilinear", "trilinear"}


def matrix(n: int, op: Weights) -> torch.Tensor:
    """The ``(m, n)`` float64 weights of ``op`` along one dimension of ``n`` rows."""
    eye = torch.eye(n, dtype=torch.float64).view(n, 1, n)
    return op(eye).reshape(n, -1).T.contiguous()


def interpolation(
    mode: str,
    size: int | None,
    scale: float | None,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    antialias: bool,
) -> Weights:
    """The 1-D part of ``F.interpolate(..., mode=mode)`` along one dimension: linear for the
    (bi-, tri-)linear modes; bicubic and antialiased modes through a 2-D call on (n, 3)
    images left as they are along W (torch's antialiased kernels misread a width of 1)."""
    if mode == "bicubic" or antialias:
        two_d = "bicubic" if mode == "bicubic" else "bilinear"

        def along_h(x: torch.Tensor) -> torch.Tensor:
            y = F.interpolate(
                x.unsqueeze(-1).expand(*x.shape, 3), size=None if size is None else (size, 3),
                scale_factor=None if scale is None else (scale, 1.0), mode=two_d,
                align_corners=align_corners, recompute_scale_factor=recompute_scale_factor,
                antialias=antialias,
            )  # fmt: skip
            return y[..., 1]

        return along_h
    one_d = "linear" if mode in LINEAR else mode
    corners = align_corners if one_d == "linear" else None

    def along(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(
            x, size=size, scale_factor=scale, mode=one_d, align_corners=corners,
            recompute_scale_factor=recompute_scale_factor,
        )  # fmt: skip

    return along


def adaptive_average(size: int) -> Weights:
    return lambda x: F.adaptive_avg_pool1d(x, size)


def resample(
    x_blk: torch.Tensor,
    grid: SpatialGrid,
    size: Sequence[int],
    matrices: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """This rank's output block of the separable operation whose weights along spatial
    dimension ``d`` are ``matrices[d]`` (None: that dimension unchanged), on the block
    ``x_blk`` of whole samples of ``size``. The output keeps the ``tensor_split`` layout."""
    axes = grid.axes(len(size))
    for d, (a, n, (comm, parts, rank)) in enumerate(zip(matrices, size, axes, strict=True)):
        if a is None:
            continue
        out_sizes = tensor_split_sizes(a.shape[0], parts)
        want = []
        for o0, o in zip(starts(out_sizes), out_sizes, strict=True):
            reached = a[o0 : o0 + o].ne(0).any(0).nonzero().flatten()
            want.append((int(reached[0]), int(reached[-1]) + 1) if len(reached) else (0, 0))
        fetched = pkf.gather_rows(x_blk, comm, 2 + d, tensor_split_sizes(n, parts), want)
        o0, (lo, hi) = starts(out_sizes)[rank], want[rank]
        w = a[o0 : o0 + out_sizes[rank], lo:hi].to(fetched)
        x_blk = (fetched.movedim(2 + d, -1) @ w.T).movedim(-1, 2 + d)
    return x_blk
