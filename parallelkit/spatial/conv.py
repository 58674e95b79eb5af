"""Convolution and transposed convolution of blocks: the kernels under the spatial layers and
the functional rules alike.

Each function takes this rank's block (N, C, *spatial) of whole samples of ``size`` split over
a :class:`~parallelkit.spatial.SpatialGrid` in tensor_split layout, and returns its block of
the output in the same layout. Which input rows an output block reads is pure geometry
(:mod:`parallelkit.geometry`); where every block holds the rows its neighbours want from it,
the block is convolved as it is and only the halo rows' terms are added
(:mod:`parallelkit.spatial.edges`), else the rows are fetched (:mod:`parallelkit.spatial.fetch`)
and the plain torch operation runs with no padding. Weights and biases are used as given: the
caller picks their gradient convention (``record.replicated`` in a layer, ``Guard.summed`` in
a rule).

Legend: ``_blk`` this rank's block, ``[o0, o1)`` output block rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallelkit.geometry import Window, conv_padding, per_dim, transposed_needs
from parallelkit.spatial import edges
from parallelkit.spatial.fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial.grid import SpatialGrid


def conv_windows(
    kernel: Sequence[int],
    stride: int | Sequence[int],
    padding: int | str | Sequence[int],
    dilation: int | Sequence[int],
) -> tuple[Window, ...]:
    """The window along each spatial dimension of a convolution with ``F.conv*d``'s
    arguments (as many dimensions as ``kernel`` has)."""
    dims = len(kernel)
    stride, dilation = per_dim(stride, dims), per_dim(dilation, dims)
    pads = conv_padding(padding, kernel, dilation)
    return tuple(
        Window(k, s, lo, hi, d)
        for k, s, (lo, hi), d in zip(kernel, stride, pads, dilation, strict=True)
    )


def conv_blocks(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: Sequence[Window],
    groups: int,
    grid: SpatialGrid,
    size: Sequence[int],
    overlap: bool = False,
) -> torch.Tensor:
    """This rank's block of ``F.conv1d/2d/3d`` of the whole samples of ``size``: the edge
    path where it applies (``overlap``: fetch the halo rows on a helper thread while the block
    is convolved), else the halo fetch."""
    if (plan := edges.plan(grid, windows, size)) is not None:
        return edges.conv(x_blk, weight, bias, windows, groups, grid, plan, overlap)
    x_halo, out_size, pad = fetch(x_blk, grid, windows, size, native=True)
    if min(out_size) == 0:
        return empty_output(x_halo, weight.shape[0], out_size, x_halo, weight, bias)
    stride = tuple(w.stride for w in windows)
    dilation = tuple(w.dilation for w in windows)
    return edges.convolve(x_halo, weight, bias, stride, pad, dilation, groups)


def transposed_out_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, ...]:
    """The whole output's spatial size of a transposed convolution of inputs of ``size``."""
    return tuple(
        (n - 1) * s - 2 * p + d * (k - 1) + 1 + op
        for n, k, s, p, op, d in zip(size, kernel, stride, padding, output_padding, dilation,
                                     strict=True)
    )  # fmt: skip


def conv_transpose_blocks(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    grid: SpatialGrid,
    size: Sequence[int],
) -> torch.Tensor:
    """This rank's block of ``F.conv_transpose1d/2d/3d`` of the whole samples of ``size``.

    Output row o receives from input rows i with ``i * stride - padding + dilation * t = o``.
    Where every block holds the rows its neighbours want from it, the block is scattered as it
    is and only the halo rows' scatters are added (:func:`edges.conv_transpose`: no copy of
    the block). Otherwise the input rows the output block receives from are fetched
    (:func:`~parallelkit.geometry.transposed_needs`), transposed-convolved with no padding,
    and cropped (a view; or zero-extended, where no input row reaches) to the block. The bias
    is added after cropping, so rows that no input reaches get it too.
    """
    kernel, ndim = tuple(weight.shape[2:]), len(stride)
    out_size = transposed_out_size(size, kernel, stride, padding, output_padding, dilation)
    plan = edges.transposed_plan(grid, size, out_size, kernel, stride, padding, dilation)
    if plan is not None:
        y = edges.conv_transpose(x_blk, weight, stride, padding, dilation, groups, grid, plan,
                                 out_size)  # fmt: skip
    else:

        def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
            return transposed_needs(o0, o1, n, kernel[dim], stride[dim], padding[dim],
                                    dilation[dim])  # fmt: skip

        x_blk, blocks, firsts = fetch_ranges(x_blk, grid, size, lambda d, _: out_size[d], needs)
        rows = tuple(o for _, o in blocks)
        out_channels = weight.shape[1] * groups
        if min(rows) == 0 or min(x_blk.shape[2:]) == 0:
            y = empty_output(x_blk, out_channels, rows, x_blk, weight)
        else:
            y = edges.CONV_TRANSPOSE[ndim](x_blk, weight, None, stride, 0, 0, groups, dilation)
            # Local row 0 is where the first fetched input row lands: a * stride - padding.
            y = crop(y, [firsts[i] * stride[i] - padding[i] for i in range(ndim)], blocks)
    # In place: y is this call's own (the convolution's output, or a view of it, whose
    # backward does not read it), and a copy would double the layer's largest tensor.
    return y if bias is None else y.add_(bias.view(-1, *(1,) * ndim))
