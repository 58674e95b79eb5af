"""``ParallelConv2d``: a drop-in ``nn.Conv2d`` that runs split over ranks, whole tensors in
and out.

It takes and returns the same (replicated) tensors an ``nn.Conv2d`` would, so it can replace
one convolution in any model; inside, ``mode="channel"`` splits the output channels
(:class:`ChannelParallelConv2d`), ``mode="spatial"`` scatters the image into blocks over a grid,
convolves with halos (:class:`SpatialParallelConv2d`) and gathers the output.

Chained layers can keep tensors split between them: ``gather_output=False`` returns this
rank's part (its block of the image, or of the output channels) and ``input_is_split=True``
takes such a part (spatial: a block of the image; channel: a block of the input channels, in
the layout of ``ChannelParallelConv2d``). ``pk.parallelize`` arranges the spatial ones for a
whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.nn.channel_parallel import ChannelParallelConv2d
from parallelkit.nn.spatial_parallel import SpatialParallelConv2d
from parallelkit.spatial.grid import GridSpec, gather, scatter

MODES = ("channel", "spatial")


class ParallelConv2d(nn.Module):
    """``nn.Conv2d(...)`` plus ``comm`` and ``mode`` ("channel" | "spatial"; ``grid`` for
    spatial); whole replicated tensors in and out, exactly the dense result."""

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
        mode: str = "channel",
        grid: GridSpec = None,
        input_is_split: bool = False,
        gather_output: bool = True,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"ParallelConv2d: mode must be one of {MODES}, got {mode!r}")
        self.mode, self.comm, self.grid = mode, comm, grid
        self.input_is_split, self.gather_output = input_is_split, gather_output
        args = (in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
        if mode == "channel":
            self.conv: nn.Module = ChannelParallelConv2d(
                *args, padding_mode, device, dtype, comm=comm, **self._channel_layout()
            )
        else:
            self.conv = SpatialParallelConv2d(
                *args, padding_mode, device, dtype, comm=comm, grid=grid
            )

    def _channel_layout(self) -> dict:
        # A split input is a block of input channels: the "in" split consumes it directly.
        if self.input_is_split:
            return dict(split="in", input_is_split=True, scatter_output=not self.gather_output)
        return dict(split="out", gather_output=self.gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "channel":
            return self.conv(x)
        x_blk = x if self.input_is_split else scatter(x, self.comm, self.grid)
        y_blk = self.conv(x_blk)
        return gather(y_blk, self.comm, self.grid) if self.gather_output else y_blk

    @classmethod
    def from_dense(
        cls,
        conv: nn.Conv2d,
        comm: Communicator,
        mode: str = "channel",
        grid: GridSpec = None,
        input_is_split: bool = False,
        gather_output: bool = True,
    ) -> ParallelConv2d:
        """A drop-in layer holding ``conv``'s weights (channel: this rank's block)."""
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode, device="meta",
            comm=comm, mode=mode, grid=grid, input_is_split=input_is_split,
            gather_output=gather_output,
        )  # fmt: skip
        if mode == "channel":
            layer.conv = ChannelParallelConv2d.from_dense(conv, comm, **layer._channel_layout())
        else:
            layer.conv = SpatialParallelConv2d.from_dense(conv, comm, grid)
        return layer

    def to_dense(self) -> nn.Conv2d:
        return self.conv.to_dense()
