"""Spatially parallel layers: one sample split over a grid of ranks, each keeping its block.

Every layer here takes this rank's block (N, C, *spatial) of samples (signals, images or
volumes: 1, 2 or 3 spatial dimensions, one class per torch layer) split over a
:class:`~parallelkit.spatial.SpatialGrid` in tensor_split layout, and returns its block of the
output in the same layout, by the kernels of :mod:`parallelkit.spatial.conv`: from pure
geometry (:mod:`parallelkit.geometry`) they know which input rows and columns the output block
reads, fetch what the rank does not hold (usually a halo from the neighbours, from further
ranks when blocks are thinner than the halo), then run the plain torch operation with no
padding on the assembled block. Backward sends the halo gradients back to their owners, who
add them in. The layers hold the parameters and the geometry; the kernels do the work.

Parameters are replicated over the grid and act on split activations, so each rank's
gradient is its share of the dense one: they pass through ``copy_to_group``, whose backward
sums the shares, and after backward every rank holds the dense gradient. Inside
``pk.parallelize``'s spatial region the shares are left as they are and summed after backward
in bucketed all-reduces (:mod:`parallelkit.spatial.record`).

The whole samples' size comes from one small all-gather of the blocks' sizes per call; pass
``size=(H, W)`` (``(D, H, W)``, ``(L,)``) to skip it.

Legend: ``_blk`` this rank's block, ``H W`` global sizes, ``[o0, o1)`` output block rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.blocks import SpatialLayer
from parallelkit.spatial.conv import (
    conv_blocks,
    conv_transpose_blocks,
    conv_windows,
    transposed_out_size,
)
from parallelkit.spatial.fetch import empty_output
from parallelkit.spatial.grid import GridSpec, grid_of


def _same_on_every_rank(layer: nn.Module, comm: Communicator) -> None:
    """Replicated parameters start as rank 0's: ranks may have drawn different ones."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for p in layer.parameters():
            if p.device.type != "meta":
                comm.broadcast(p.data, src=0, out=p.data)


class _SpatialConv(SpatialLayer):
    """What the spatial convolutions of every dimension share (``dense``: the torch class)."""

    windows_in_batch = True  # parallelkit.spatial.blocks

    dense: type[nn.Module]
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
        grid: GridSpec = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device, dtype,
        )  # fmt: skip
        if padding_mode != "zeros":
            raise ValueError(
                f"{type(self).__name__}: padding_mode {padding_mode!r} is not supported; "
                "use 'zeros'"
            )
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)
        self.windows = conv_windows(self.kernel_size, self.stride, padding, self.dilation)

    @property
    def pointwise(self) -> bool:
        """A 1x1 (1x1x1) convolution with stride 1 and no padding: it needs no halo, so it
        runs on a block of any form whose channels are dimension 1 (EfficientFormerV2's
        talking heads over an attention map, MobileViTv2's projections over folded
        patches)."""
        no_padding = self.padding in ("same", "valid") or not any(self.padding)
        return no_padding and set(self.kernel_size) == {1} and set(self.stride) == {1}

    def over_trailing(self, n: int) -> bool:
        """Whether it may take blocks with ``n`` non-spatial dimensions after the spatial ones:
        its window along them is 1 (stride 1, no padding), so it convolves each of their
        places alone (LambdaNet's position lambdas: a Conv3d with a kernel (r, r, 1) over
        values (N, 1, H, W, V))."""
        return 0 < n < len(self.windows) and all(
            (w.kernel, w.stride, w.pad_lo, w.pad_hi) == (1, 1, 0, 0) for w in self.windows[-n:]
        )

    def _over_trailing(self, x_blk: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, n: int) -> torch.Tensor:  # fmt: skip
        """The spatial convolution of each place of the ``n`` trailing dimensions, folded into
        the batch, with the kernel's spatial part."""
        s, rest = x_blk.dim() - 2 - n, x_blk.shape[-n:]
        ahead, after = tuple(range(-n, 0)), tuple(range(1, n + 1))
        y = x_blk.movedim(ahead, after).reshape(-1, *x_blk.shape[1 : 2 + s])
        size = record.size_of(x_blk) or self.grid.global_size(y, type(self).__name__)
        y = conv_blocks(y, weight.reshape(weight.shape[: 2 + s]), bias, self.windows[:s],
                        self.groups, self.grid, size, self.overlap)  # fmt: skip
        return y.reshape(x_blk.shape[0], *rest, *y.shape[1:]).movedim(after, ahead)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not record.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        if x_blk.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}: input has {x_blk.shape[1]} channels, expected "
                f"{self.in_channels} (block shape {tuple(x_blk.shape)})"
            )
        weight = record.replicated(self.weight, self.comm)
        bias = None if self.bias is None else record.replicated(self.bias, self.comm)
        if self.pointwise or record.batched(x_blk):  # no halo: the convolution as it is
            if 0 in x_blk.shape[2:]:  # F.conv refuses an empty block; the parameters stay
                return empty_output(x_blk, self.out_channels, x_blk.shape[2:], x_blk, weight, bias)
            return self._conv_forward(x_blk, weight, bias)
        if self.over_trailing(n := record.trailing(x_blk)):
            return self._over_trailing(x_blk, weight, bias, n)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        return conv_blocks(
            x_blk, weight, bias, self.windows, self.groups, self.grid, size, self.overlap
        )

    def out_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The whole output's spatial size for whole inputs of ``size``: geometry only."""
        return tuple(w.out_size(n) for w, n in zip(self.windows, size, strict=True))

    @classmethod
    def from_dense(cls, conv: nn.Module, comm: Communicator, grid: GridSpec = None):
        """A spatial layer holding ``conv``'s parameters (the same tensors)."""
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.Module:
        """The plain torch convolution holding this layer's parameters (they are replicated)."""
        conv = self.dense(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, self.bias is not None, self.padding_mode, device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)


class SpatialParallelConv2d(_SpatialConv, nn.Conv2d):
    """``nn.Conv2d`` on images split over a ``rows x cols`` grid of ranks (default: rows);
    :class:`SpatialParallelConv1d` and :class:`SpatialParallelConv3d` are the same for
    signals and volumes.

    Any kernel size, stride, padding (ints, tuples, "same", "valid"), dilation and groups;
    uneven splits and blocks thinner than the halo (rows then come from further ranks).
    Forward: fetch the halo, convolve with no padding; backward: return the halo gradients and
    sum the parameter gradients over the grid. Constructed directly, every rank must construct
    it: the parameters start as rank 0's.

    A stride-1 "same" convolution along every split dimension skips the fetch: it convolves
    the block as it is and adds the halo rows' terms to its edge rows
    (:mod:`parallelkit.spatial.edges`), copying nothing; ``overlap = True`` fetches those
    rows on a helper thread while the block is convolved.
    """

    dense = nn.Conv2d


class SpatialParallelConv1d(_SpatialConv, nn.Conv1d):
    """``nn.Conv1d`` on signals (N, C, L) split along L (see :class:`SpatialParallelConv2d`)."""

    dense = nn.Conv1d


class SpatialParallelConv3d(_SpatialConv, nn.Conv3d):
    """``nn.Conv3d`` on volumes (N, C, D, H, W) split over a ``depth x rows x cols`` grid
    (see :class:`SpatialParallelConv2d`)."""

    dense = nn.Conv3d




class _SpatialConvTranspose(SpatialLayer):
    """``nn.ConvTranspose2d`` on images split over a grid of ranks (e.g. the DCGAN generator's
    kernel 4, stride 2, padding 1 upsampling); the 1-D and 3-D classes alike.

    Where every block holds the rows its neighbours want from it, the block is scattered as
    it is and only the halo rows' scatters are added; otherwise the input rows the output block
    receives from are fetched (:func:`parallelkit.spatial.conv.conv_transpose_blocks`).
    """

    dense: type[nn.Module]

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
        grid: GridSpec = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
            bias, dilation, padding_mode, device, dtype,
        )  # fmt: skip
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not record.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        weight = record.replicated(self.weight, self.comm)
        bias = None if self.bias is None else record.replicated(self.bias, self.comm)
        return conv_transpose_blocks(
            x_blk, weight, bias, self.stride, self.padding, self.output_padding, self.dilation,
            self.groups, self.grid, size,
        )  # fmt: skip

    def out_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The whole output's spatial size for whole inputs of ``size``: geometry only."""
        return transposed_out_size(size, self.kernel_size, self.stride, self.padding,
                                   self.output_padding, self.dilation)  # fmt: skip

    @classmethod
    def from_dense(cls, conv: nn.Module, comm: Communicator, grid: GridSpec = None):
        if conv.padding_mode != "zeros":
            raise ValueError(f"{cls.__name__}: only padding_mode='zeros'")
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.output_padding, conv.groups, conv.bias is not None, conv.dilation,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.Module:
        conv = self.dense(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.output_padding, self.groups, self.bias is not None, self.dilation,
            device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)


class SpatialConvTranspose1d(_SpatialConvTranspose, nn.ConvTranspose1d):
    dense = nn.ConvTranspose1d


class SpatialConvTranspose2d(_SpatialConvTranspose, nn.ConvTranspose2d):
    dense = nn.ConvTranspose2d


class SpatialConvTranspose3d(_SpatialConvTranspose, nn.ConvTranspose3d):
    dense = nn.ConvTranspose3d
