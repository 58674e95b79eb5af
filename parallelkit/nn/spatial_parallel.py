"""Spatially parallel layers: one image split over a grid of ranks, each keeping its block.

Every layer here takes this rank's block (N, C, h, w) of images split over a
:class:`~parallelkit.spatial.SpatialGrid` in tensor_split layout, and returns its block of the
output in the same layout. From pure geometry (:mod:`parallelkit.geometry`) it knows which
input rows and columns its output block reads; it fetches what it does not hold
(:mod:`parallelkit.nn.spatial_fetch`: usually a halo from the neighbours, from further ranks
when blocks are thinner than the halo; padding rows are zeros, or -inf for max pooling), then
runs the plain torch operation with no padding on the assembled block. Backward sends the halo
gradients back to their owners, who add them in.

Parameters are replicated over the grid and act on split activations, so each rank's
gradient is its share of the dense one: they pass through ``copy_to_group``, whose backward
sums the shares, and after backward every rank holds the dense gradient. Inside
``pk.parallelize``'s spatial region the shares are left as they are and summed after backward
in bucketed all-reduces (:mod:`parallelkit.spatial.layout`).

The whole images' (H, W) come from one small all-gather of the blocks' sizes per call; pass
``size=(H, W)`` to skip it.

Legend: ``_blk`` this rank's block, ``H W`` global sizes, ``[o0, o1)`` output block rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.geometry import Window, conv_padding, pair, transposed_needs
from parallelkit.nn import spatial_edges
from parallelkit.nn.spatial_fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial import layout
from parallelkit.spatial.grid import SpatialGrid, grid_of


def _same_on_every_rank(layer: nn.Module, comm: Communicator) -> None:
    """Replicated parameters start as rank 0's: ranks may have drawn different ones."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for p in layer.parameters():
            if p.device.type != "meta":
                comm.broadcast(p.data, src=0, out=p.data)


def conv_windows(
    kernel: Sequence[int],
    stride: int | Sequence[int],
    padding: int | str | Sequence[int],
    dilation: int | Sequence[int],
) -> tuple[Window, Window]:
    """The (H, W) windows of a convolution with ``F.conv2d``'s arguments."""
    kernel, stride, dilation = pair(kernel), pair(stride), pair(dilation)
    pads = conv_padding(padding, kernel, dilation)
    return tuple(  # type: ignore[return-value]
        Window(k, s, lo, hi, d)
        for k, s, (lo, hi), d in zip(kernel, stride, pads, dilation, strict=True)
    )


def conv2d_blocks(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: tuple[Window, Window],
    groups: int,
    grid: SpatialGrid,
    size: tuple[int, int],
    overlap: bool = False,
) -> torch.Tensor:
    """This rank's block of ``F.conv2d`` of the whole images of ``size``, whose blocks over
    ``grid`` ``x_blk`` is one of: the edge path where it applies, else the halo fetch.
    ``weight`` and ``bias`` are used as given (the caller picks their gradient convention)."""
    if (edges := spatial_edges.plan(grid, windows, size)) is not None:
        return spatial_edges.conv2d(x_blk, weight, bias, windows, groups, grid, edges, overlap)
    x_halo, out_hw, pad = fetch(x_blk, grid, windows, size, native=True)
    if min(out_hw) == 0:
        return empty_output(x_halo, weight.shape[0], out_hw, x_halo, weight, bias)
    stride = tuple(w.stride for w in windows)
    dilation = tuple(w.dilation for w in windows)
    return F.conv2d(x_halo, weight, bias, stride, pad, dilation, groups)


class SpatialParallelConv2d(nn.Conv2d):
    """``nn.Conv2d`` on images split over a ``rows x cols`` grid of ranks (default: rows).

    Any kernel size, stride, padding (ints, tuples, "same", "valid"), dilation and groups;
    uneven splits and blocks thinner than the halo (rows then come from further ranks).
    Forward: fetch the halo, convolve with no padding; backward: return the halo gradients and
    sum the parameter gradients over the grid. Constructed directly, every rank must construct
    it: the parameters start as rank 0's.

    A stride-1 "same" convolution along every split dimension skips the fetch: it convolves
    the block as it is and adds the halo rows' terms to its edge rows
    (:mod:`parallelkit.nn.spatial_edges`), copying nothing; ``overlap = True`` fetches those
    rows on a helper thread while the block is convolved.
    """

    overlap = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | str | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        comm: Communicator,
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        if padding_mode != "zeros":
            raise ValueError(
                f"SpatialParallelConv2d: padding_mode {padding_mode!r} is not supported; "
                "use 'zeros'"
            )
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device, dtype,
        )  # fmt: skip
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)
        self.windows = conv_windows(self.kernel_size, self.stride, padding, self.dilation)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        if x_blk.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}: input has {x_blk.shape[1]} channels, expected "
                f"{self.in_channels} (block shape {tuple(x_blk.shape)})"
            )
        weight = layout.replicated(self.weight, self.comm)
        bias = None if self.bias is None else layout.replicated(self.bias, self.comm)
        return conv2d_blocks(
            x_blk, weight, bias, self.windows, self.groups, self.grid, size, self.overlap
        )

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The whole output's (H, W) for whole inputs of ``size``: geometry only."""
        return self.windows[0].out_size(size[0]), self.windows[1].out_size(size[1])

    @classmethod
    def from_dense(
        cls, conv: nn.Conv2d, comm: Communicator, grid: Sequence[int] | None = None
    ) -> SpatialParallelConv2d:
        """A spatial layer holding ``conv``'s parameters (the same tensors)."""
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.Conv2d:
        """The plain ``nn.Conv2d`` holding this layer's parameters (they are replicated)."""
        conv = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, self.bias is not None, self.padding_mode, device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)


class SpatialConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on images split over a grid of ranks (e.g. the DCGAN generator's
    kernel 4, stride 2, padding 1 upsampling).

    Output row o receives from input rows i with ``i * stride - padding + dilation * t = o``.
    Each rank fetches the input rows its output block receives from (geometry:
    :func:`~parallelkit.geometry.transposed_needs`), runs the transposed convolution on them
    with no padding, and crops (or zero-extends, where no input row reaches) the result to its
    block. The bias is added after cropping, so rows that no input reaches get it too.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        output_padding: int | Sequence[int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | Sequence[int] = 1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        comm: Communicator,
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
            bias, dilation, padding_mode, device, dtype,
        )  # fmt: skip
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation

        def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
            return transposed_needs(o0, o1, n, k[dim], s[dim], p[dim], d[dim])

        x_blk, blocks, firsts = fetch_ranges(x_blk, self.grid, size, self._out_rows, needs)
        out_hw = (blocks[0][1], blocks[1][1])
        weight = layout.replicated(self.weight, self.comm)
        bias = None if self.bias is None else layout.replicated(self.bias, self.comm)
        if min(out_hw) == 0 or min(x_blk.shape[2:]) == 0:
            y = empty_output(x_blk, self.out_channels, out_hw, x_blk, weight)
        else:
            y = F.conv_transpose2d(x_blk, weight, None, s, 0, 0, self.groups, d)
            # Local row 0 is where the first fetched input row lands: a * stride - padding.
            y = crop(y, [firsts[i] * s[i] - p[i] for i in range(2)], blocks)
        return y if bias is None else y + bias.view(-1, 1, 1)

    def _out_rows(self, dim: int, n: int) -> int:
        span = self.dilation[dim] * (self.kernel_size[dim] - 1) + 1
        pad, stride = self.padding[dim], self.stride[dim]
        return (n - 1) * stride - 2 * pad + span + self.output_padding[dim]

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The whole output's (H, W) for whole inputs of ``size``: geometry only."""
        return self._out_rows(0, size[0]), self._out_rows(1, size[1])

    @classmethod
    def from_dense(
        cls, conv: nn.ConvTranspose2d, comm: Communicator, grid: Sequence[int] | None = None
    ) -> SpatialConvTranspose2d:
        if conv.padding_mode != "zeros":
            raise ValueError("SpatialConvTranspose2d: only padding_mode='zeros'")
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.output_padding, conv.groups, conv.bias is not None, conv.dilation,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.ConvTranspose2d:
        conv = nn.ConvTranspose2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.output_padding, self.groups, self.bias is not None, self.dilation,
            device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)
