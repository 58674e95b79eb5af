"""Spatially parallel pooling: what whole networks need besides convolution and upsampling.

Same scheme as :mod:`parallelkit.nn.spatial_parallel`, for signals, images and volumes (one
class per torch layer, ``dims`` spatial dimensions): each rank keeps its block of the output,
by the kernels of :mod:`parallelkit.spatial.pool` (which fetch the input rows the output
block's windows read; max pooling pads with -inf, average pooling with zeros). Global average
pooling ends the spatial region: a local sum and one all-reduce give every rank the same
(N, C, 1, 1) result (a 1 per spatial dimension), whose backward (for a loss that every rank
computes identically) is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.blocks import SpatialLayer
from parallelkit.spatial.grid import GridSpec, grid_of
from parallelkit.spatial.pool import (
    avg_pool_blocks,
    avg_pool_tokens,
    max_pool_blocks,
    pool_windows,
)


class _SpatialPool(SpatialLayer, nn.Module):
    """Common part of max and average pooling: the windows and the whole size. A block whose
    spatial dimensions are all folded into its batch (SAM2's windows) is pooled as dense:
    each window's own pixels, which no other rank holds."""

    spatial_dims = 2
    windows_in_batch = True  # parallelkit.spatial.blocks

    def __init__(self, kernel_size, stride, padding, dilation, ceil_mode, comm, grid) -> None:
        super().__init__()
        self.windows = pool_windows(kernel_size, stride, padding, dilation, ceil_mode,
                                    self.spatial_dims, type(self).__name__)  # fmt: skip
        self.kernel_size = tuple(w.kernel for w in self.windows)
        self.stride = tuple(w.stride for w in self.windows)
        self.padding = tuple(w.pad_lo for w in self.windows)
        self.dilation = tuple(w.dilation for w in self.windows)
        self.ceil_mode = bool(ceil_mode)
        self.comm, self.grid = comm, grid_of(comm, grid)

    def _size(self, x_blk: torch.Tensor, size: Sequence[int] | None) -> Sequence[int]:
        return size or self.grid.global_size(x_blk, type(self).__name__)

    def out_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The whole output's spatial size for whole inputs of ``size``: geometry only."""
        return tuple(w.out_size(n) for w, n in zip(self.windows, size, strict=True))

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"ceil_mode={self.ceil_mode}"
        )


class SpatialMaxPool2d(_SpatialPool):
    """``nn.MaxPool2d`` on images split over a grid of ranks (padding rows are -inf, and so
    are rows past the padding that a ``ceil_mode`` window reads); :class:`SpatialMaxPool1d`
    and :class:`SpatialMaxPool3d` alike."""

    dense: type[nn.Module] = nn.MaxPool2d

    @classmethod
    def covers(cls, module: nn.Module) -> bool:
        """Not with ``return_indices``: the pooling stays dense, and its call's rule numbers
        the indices in the whole sample's plane (for ``MaxUnpool``)."""
        return not getattr(module, "return_indices", False)

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
        *,
        comm: Communicator,
        grid: GridSpec = None,
    ) -> None:
        if return_indices:
            raise ValueError(f"{type(self).__name__}: return_indices=True is not supported")
        super().__init__(kernel_size, stride, padding, dilation, ceil_mode, comm, grid)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not record.is_split(x_blk) or record.batched(x_blk):  # whole, or windows in the batch
            return self.to_dense()(x_blk)
        return max_pool_blocks(x_blk, self.windows, self.grid, self._size(x_blk, size))

    @classmethod
    def from_dense(cls, pool: nn.Module, comm: Communicator, grid=None) -> _SpatialPool:
        return cls(
            pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices,
            pool.ceil_mode, comm=comm, grid=grid,
        )  # fmt: skip

    def to_dense(self) -> nn.Module:
        return self.dense(
            self.kernel_size, self.stride, self.padding, self.dilation, ceil_mode=self.ceil_mode
        )


class SpatialMaxPool1d(SpatialMaxPool2d):
    spatial_dims, dense = 1, nn.MaxPool1d


class SpatialMaxPool3d(SpatialMaxPool2d):
    spatial_dims, dense = 3, nn.MaxPool3d


class SpatialAvgPool2d(_SpatialPool):
    """``nn.AvgPool2d`` on images split over a grid of ranks; :class:`SpatialAvgPool1d` and
    :class:`SpatialAvgPool3d` alike.

    ``count_include_pad=False`` divides by the number of real (non-padding) inputs in each
    window, which each rank computes locally from the geometry; so does ``ceil_mode``, whose
    last windows count only the rows up to the end of the padding, as torch's do.
    """

    dense: type[nn.Module] = nn.AvgPool2d

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
        *,
        comm: Communicator,
        grid: GridSpec = None,
    ) -> None:
        super().__init__(kernel_size, stride, padding, 1, ceil_mode, comm, grid)
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not record.is_split(x_blk) or record.batched(x_blk):  # whole, or windows in the batch
            return self.to_dense()(x_blk)
        return avg_pool_blocks(x_blk, self.windows, self.grid, self._size(x_blk, size),
                               self.count_include_pad, self.divisor_override)  # fmt: skip

    @classmethod
    def from_dense(cls, pool: nn.Module, comm: Communicator, grid=None) -> _SpatialPool:
        return cls(
            pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
            getattr(pool, "divisor_override", None), comm=comm, grid=grid,
        )  # fmt: skip

    def to_dense(self) -> nn.Module:
        extra = () if self.spatial_dims == 1 else (self.divisor_override,)
        return self.dense(
            self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            *extra,
        )  # fmt: skip


class SpatialAvgPool1d(SpatialAvgPool2d):
    """Also over a block's flattened tokens, ``(N, C, H * W)`` (Next-ViT's keys): windows of
    the whole token order, the result whole (:func:`parallelkit.spatial.pool.avg_pool_tokens`)."""

    spatial_dims, dense = 1, nn.AvgPool1d

    @property
    def over_tokens(self) -> bool:
        """Whether the guard may give it a block's tokens: windows without padding."""
        return self.padding == (0,) and not self.ceil_mode and self.divisor_override is None

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if (tokens := record.tokens(x_blk)) is not None and self.over_tokens:
            index, count = tokens
            return avg_pool_tokens(x_blk, index, count, self.kernel_size[0], self.stride[0],
                                   self.grid.comm)  # fmt: skip
        return super().forward(x_blk, size)


class SpatialAvgPool3d(SpatialAvgPool2d):
    spatial_dims, dense = 3, nn.AvgPool3d


class SpatialGlobalAvgPool2d(SpatialLayer, nn.Module):
    """``nn.AdaptiveAvgPool1d/2d/3d(1)`` ending the spatial region: (N, C, *spatial) blocks of
    any spatial dimensions -> the same (N, C, 1, ...) means on every rank. One all-reduce of
    the local sums and pixel counts; its backward is the identity, right for a loss every rank
    computes identically (inside ``pk.parallelize``'s region, an all-reduce of the gradient
    shares: ``record.summed``). ``dense``: the kind of pool it stands for, which runs whole
    tensors and is what :meth:`to_dense` gives back (a 3-D pool stays a 3-D pool)."""

    takes_blocks = "ends"
    stands_for = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)

    @classmethod
    def covers(cls, module: nn.Module) -> bool:
        """Pooling to size 1 only; other sizes meet the guard's adaptive pooling rule."""
        size = module.output_size
        return all(v == 1 for v in (size if isinstance(size, tuple | list) else (size,)))

    def __init__(
        self, *, comm: Communicator, dense: type[nn.Module] = nn.AdaptiveAvgPool2d
    ) -> None:
        super().__init__()
        self.comm, self.dense = comm, dense

    @classmethod
    def from_dense(cls, pool: nn.Module, comm: Communicator, grid=None) -> SpatialGlobalAvgPool2d:
        return cls(comm=comm, dense=type(pool))

    def forward(self, x_blk: torch.Tensor) -> torch.Tensor:
        if not record.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        n, c, *spatial = x_blk.shape
        sums = x_blk.sum(tuple(range(2, x_blk.dim()))).reshape(-1)
        count = sums.new_tensor([math.prod(spatial)])
        total = record.summed(torch.cat([sums, count]), self.comm)
        return (total[:-1] / total[-1]).view(n, c, *(1,) * len(spatial))

    def to_dense(self) -> nn.Module:
        return self.dense(1)
