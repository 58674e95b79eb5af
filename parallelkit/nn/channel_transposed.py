"""A dense transposed convolution (1-D, 2-D or 3-D) whose channels are split over the ranks of
a communicator.

The same two splits as :class:`~parallelkit.nn.channel_parallel.ChannelParallelConv2d`, for
``nn.ConvTranspose1d/2d/3d`` (whose weight is laid out (C, C'/groups, *kernel_size)), taking
and returning whole, replicated tensors (the table shows 2-D; read (N, C, L) or
(N, C, D, H, W) for the others):

    split="out"   x (N,C,H,W)   copy_to_group        bwd: all-reduce of partial input grads
                  convT with W[:, block r], b[block r] -> (N,c',H',W')
                  gather_from_group (all-gather)     bwd: keep own block
    split="in"    x (N,C,H,W)   scatter_to_group     bwd: all-gather of block grads
                  convT with W[block r] -> partial (N,C',H',W')
                  reduce_from_group (all-reduce)     bwd: identity; + replicated bias

``groups=1`` only. ``from_dense`` picks "out" when there are at least as many output channels
as ranks, else "in" (e.g. a generator's last layer, 3 output channels).
"""

from __future__ import annotations

import torch
from torch import nn

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.geometry import tensor_split_sizes
from parallelkit.spatial.edges import CONV_TRANSPOSE


class ChannelParallelConvTransposeNd(nn.Module):
    """``nn.ConvTranspose{dims}d`` with its output (or input) channels split over ``comm``; use
    :class:`ChannelParallelConvTranspose1d`, ``2d`` or ``3d``."""

    spatial_dims: int = 2
    """Spatial dimensions: 1 (N, C, L), 2 (N, C, H, W), 3 (N, C, D, H, W)."""
    dense_type: type[nn.Module] = nn.ConvTranspose2d

    def __init__(self, dense: nn.Module, comm: Communicator, split: str) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(dense, self.dense_type):
            raise ValueError(
                f"{name}: expected an nn.{self.dense_type.__name__}, got {type(dense)}"
            )
        if dense.groups != 1 or dense.padding_mode != "zeros":
            raise ValueError(
                f"{name}: groups=1 and padding_mode='zeros' only, got "
                f"groups={dense.groups}, padding_mode={dense.padding_mode!r}"
            )
        channels = dense.out_channels if split == "out" else dense.in_channels
        if split not in ("out", "in") or channels < comm.size:
            raise ValueError(
                f"{name}: split {split!r} needs at least {comm.size} "
                f"{split}put channels, the layer has {channels}"
            )
        self.comm, self.split = comm, split
        self.in_channels, self.out_channels = dense.in_channels, dense.out_channels
        self.kernel_size, self.stride, self.padding = dense.kernel_size, dense.stride, dense.padding
        self.output_padding, self.dilation = dense.output_padding, dense.dilation
        self.sizes = tensor_split_sizes(channels, comm.size)
        start, n = sum(self.sizes[: comm.rank]), self.sizes[comm.rank]
        dim = 1 if split == "out" else 0
        w = dense.weight.detach().narrow(dim, start, n).clone()
        self.weight = nn.Parameter(w, requires_grad=dense.weight.requires_grad)
        self.bias = None
        if dense.bias is not None:
            b = dense.bias.detach()
            self.bias = nn.Parameter(b.narrow(0, start, n).clone() if split == "out" else b.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.spatial_dims + 2 or x.shape[1] != self.in_channels:
            spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[self.spatial_dims]
            raise ValueError(
                f"{type(self).__name__}: expected (N, {self.in_channels}, {spatial}), got "
                f"{tuple(x.shape)}"
            )
        conv = CONV_TRANSPOSE[self.spatial_dims]
        args = (self.stride, self.padding, self.output_padding, 1, self.dilation)
        if self.split == "out":
            y = conv(pkf.copy_to_group(x, self.comm), self.weight, self.bias, *args)
            return pkf.gather_from_group(y, self.comm, 1, self.sizes)
        x_shard = pkf.scatter_to_group(x, self.comm, 1, self.sizes)
        y = pkf.reduce_from_group(conv(x_shard, self.weight, None, *args), self.comm)
        return y if self.bias is None else y + self.bias.view(-1, *[1] * self.spatial_dims)

    @classmethod
    def from_dense(
        cls, dense: nn.Module, comm: Communicator, split: str | None = None
    ) -> ChannelParallelConvTransposeNd:
        """This rank's block of ``dense`` (copies); ``split`` defaults as the module says."""
        split = split or ("out" if dense.out_channels >= comm.size else "in")
        return cls(dense, comm, split).train(dense.training)

    def to_dense(self) -> nn.Module:
        """The equivalent ``nn.ConvTranspose*d``, its weight gathered (every rank calls it)."""
        w = self.weight.detach()
        dense = self.dense_type(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.output_padding, 1, self.bias is not None, self.dilation, device=w.device,
            dtype=w.dtype,
        )  # fmt: skip
        with torch.no_grad():
            dense.weight.copy_(self.comm.all_gather(w, 1 if self.split == "out" else 0, self.sizes))
            if self.bias is not None:
                b = self.bias.detach()
                dense.bias.copy_(
                    self.comm.all_gather(b, 0, self.sizes) if self.split == "out" else b
                )
        return dense.train(self.training)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, split={self.split!r}, sizes={self.sizes}"
        )


class ChannelParallelConvTranspose1d(ChannelParallelConvTransposeNd):
    """``nn.ConvTranspose1d`` on (N, C, L), its channels split over ``comm``."""

    spatial_dims, dense_type = 1, nn.ConvTranspose1d


class ChannelParallelConvTranspose2d(ChannelParallelConvTransposeNd):
    """``nn.ConvTranspose2d`` on (N, C, H, W), its channels split over ``comm``."""

    spatial_dims, dense_type = 2, nn.ConvTranspose2d


class ChannelParallelConvTranspose3d(ChannelParallelConvTransposeNd):
    """``nn.ConvTranspose3d`` on (N, C, D, H, W), its channels split over ``comm``."""

    spatial_dims, dense_type = 3, nn.ConvTranspose3d

