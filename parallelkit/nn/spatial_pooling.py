"""Spatially parallel pooling and upsampling: what whole networks need besides convolution.

Same scheme as :mod:`parallelkit.nn.spatial_parallel`, for signals, images and volumes (one
class per torch layer, ``dims`` spatial dimensions): each rank keeps its block of the output,
fetches the input rows its windows read (:mod:`parallelkit.nn.spatial_fetch`; max pooling pads
with -inf, average pooling with zeros), and runs the plain torch operation on them. Global
average pooling ends the spatial region: a local sum and one all-reduce give every rank the
same (N, C, 1, 1) result (a 1 per spatial dimension), whose backward (for a loss that every
rank computes identically) is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.geometry import Window, pair
from parallelkit.nn.spatial_fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial import layout
from parallelkit.spatial.grid import SpatialGrid, grid_of

MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _avg_pool(x: torch.Tensor, kernel, stride, padding, divisor_override=None) -> torch.Tensor:
    """``F.avg_pool1d/2d/3d``; 1-D through 2-D, since avg_pool1d has no ``divisor_override``."""
    ndim = x.dim() - 2
    if ndim == 1:
        y = F.avg_pool2d(x.unsqueeze(-1), (*kernel, 1), (*stride, 1), (*padding, 0),
                         divisor_override=divisor_override)  # fmt: skip
        return y.squeeze(-1)
    avg = F.avg_pool2d if ndim == 2 else F.avg_pool3d
    return avg(x, kernel, stride, padding, divisor_override=divisor_override)


class _SpatialPool(nn.Module):
    """Common part of max and average pooling: windows, validation, fetching."""

    fill = 0.0
    dims = 2

    def __init__(self, kernel_size, stride, padding, dilation, ceil_mode, comm, grid) -> None:
        super().__init__()
        name = type(self).__name__
        k, d = pair(kernel_size, self.dims), pair(dilation, self.dims)
        s = pair(stride, self.dims) if stride is not None else k
        p = pair(padding, self.dims)
        if any(pi > ki // 2 for pi, ki in zip(p, k, strict=True)):
            raise ValueError(
                f"{name}: padding {p} must be at most half the kernel {k}, as in torch"
            )
        self.kernel_size, self.stride, self.padding, self.dilation = k, s, p, d
        self.ceil_mode = bool(ceil_mode)
        self.windows = tuple(
            Window(k[i], s[i], p[i], p[i], d[i], self.ceil_mode) for i in range(self.dims)
        )
        self.comm, self.grid = comm, grid_of(comm, grid)

    def _fetch(self, x_blk: torch.Tensor, size, native: bool = True):
        """(fetched block, output block size, padding left to the torch operation). With
        ``ceil_mode`` every row is fetched (padding too), and the operation pads nothing."""
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        native = native and not self.ceil_mode
        return fetch(x_blk, self.grid, self.windows, size, self.fill, native)

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

    fill = float("-inf")
    dense: type[nn.Module] = nn.MaxPool2d

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
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        if return_indices:
            raise ValueError(f"{type(self).__name__}: return_indices=True is not supported")
        super().__init__(kernel_size, stride, padding, dilation, ceil_mode, comm, grid)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        # max_pool pads with -inf itself, like the fetch.
        x, out_size, pad = self._fetch(x_blk, size)
        if min(out_size) == 0:
            return empty_output(x, x.shape[1], out_size, x)
        return MAX_POOL[self.dims](x, self.kernel_size, self.stride, pad, self.dilation)

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
    dims, dense = 1, nn.MaxPool1d


class SpatialMaxPool3d(SpatialMaxPool2d):
    dims, dense = 3, nn.MaxPool3d


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
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        super().__init__(kernel_size, stride, padding, 1, ceil_mode, comm, grid)
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        # Zero padding counted in the mean (or none), and no window past the padding: avg_pool
        # may pad by itself.
        plain = self.divisor_override is not None or (
            not self.ceil_mode and (self.count_include_pad or max(self.padding) == 0)
        )
        x, out_size, pad = self._fetch(x_blk, size, native=plain)
        if min(out_size) == 0:
            return empty_output(x, x.shape[1], out_size, x)
        k, s = self.kernel_size, self.stride
        if plain:
            return _avg_pool(x, k, s, pad, self.divisor_override)
        zero = (0,) * self.dims
        return _avg_pool(x, k, s, zero, 1) / _avg_pool(self._real(x, size), k, s, zero, 1)

    def _real(self, x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        """1 where the fetched block holds what the mean counts (the sample, and its padding
        with ``count_include_pad``), 0 elsewhere (pure geometry)."""
        mask = x.new_ones((1, 1) + (1,) * self.dims)
        axes = self.grid.axes(self.dims)
        for dim, (win, n, (_, parts, idx)) in enumerate(zip(self.windows, size, axes, strict=True)):
            _, _, want = win.plan(n, parts)
            lo, hi = want[idx]
            rows = torch.arange(lo, hi, device=x.device)
            first, stop = (-win.pad_lo, n + win.pad_hi) if self.count_include_pad else (0, n)
            shape = [1] * (2 + self.dims)
            shape[2 + dim] = -1
            mask = mask * ((rows >= first) & (rows < stop)).to(x.dtype).view(shape)
        return mask

    @classmethod
    def from_dense(cls, pool: nn.Module, comm: Communicator, grid=None) -> _SpatialPool:
        return cls(
            pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
            getattr(pool, "divisor_override", None), comm=comm, grid=grid,
        )  # fmt: skip

    def to_dense(self) -> nn.Module:
        extra = () if self.dims == 1 else (self.divisor_override,)
        return self.dense(
            self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            *extra,
        )  # fmt: skip


class SpatialAvgPool1d(SpatialAvgPool2d):
    dims, dense = 1, nn.AvgPool1d


class SpatialAvgPool3d(SpatialAvgPool2d):
    dims, dense = 3, nn.AvgPool3d


INTERPOLATING = ("linear", "bilinear", "trilinear")


class SpatialUpsample(nn.Module):
    """``nn.Upsample`` by an integer ``scale_factor``, mode "nearest", or "linear",
    "bilinear", "trilinear" (``align_corners=False``), on samples split over a grid of ranks.

    Each rank fetches the input rows its output block interpolates from, plus one row on each
    side for the interpolating modes, so that no interpolation is clamped at a block edge that
    is not the sample's edge, upsamples them and crops its block.
    """

    def __init__(
        self,
        scale_factor: int,
        mode: str = "nearest",
        align_corners: bool | None = None,
        *,
        comm: Communicator,
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("nearest", *INTERPOLATING) or align_corners:
            raise ValueError(
                f"SpatialUpsample: mode must be 'nearest', 'linear', 'bilinear' or 'trilinear' "
                f"with align_corners=False, got mode={mode!r}, align_corners={align_corners}"
            )
        if int(scale_factor) != scale_factor or scale_factor < 1:
            raise ValueError(
                f"SpatialUpsample: scale_factor must be a positive integer, got {scale_factor}"
            )
        self.scale_factor, self.mode = int(scale_factor), mode
        self.comm, self.grid = comm, grid_of(comm, grid)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        s, extra = self.scale_factor, 1 if self.mode in INTERPOLATING else 0

        def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
            return (max(o0 // s - extra, 0), min(-(-o1 // s) + extra, n)) if o1 > o0 else (0, 0)

        x_blk, blocks, firsts = fetch_ranges(x_blk, self.grid, size, lambda _, n: n * s, needs)
        if min(o for _, o in blocks) == 0:
            return empty_output(x_blk, x_blk.shape[1], [o for _, o in blocks], x_blk)
        y = F.interpolate(x_blk, scale_factor=s, mode=self.mode)
        return crop(y, [a * s for a in firsts], blocks)  # local row 0 is global row a * s

    def out_size(self, size: Sequence[int]) -> tuple[int, ...]:
        return tuple(n * self.scale_factor for n in size)

    @classmethod
    def from_dense(cls, up: nn.Upsample, comm: Communicator, grid=None) -> SpatialUpsample:
        if up.size is not None or up.scale_factor is None:
            raise ValueError("SpatialUpsample: only scale_factor= upsampling is supported")
        sf = up.scale_factor
        sf = sf[0] if isinstance(sf, tuple) else sf
        return cls(sf, up.mode, up.align_corners, comm=comm, grid=grid)

    def to_dense(self) -> nn.Upsample:
        return nn.Upsample(scale_factor=self.scale_factor, mode=self.mode)


class SpatialGlobalAvgPool2d(nn.Module):
    """``nn.AdaptiveAvgPool1d/2d/3d(1)`` ending the spatial region: (N, C, *spatial) blocks of
    any spatial dimensions -> the same (N, C, 1, ...) means on every rank. One all-reduce of
    the local sums and pixel counts; its backward is the identity, right for a loss every rank
    computes identically (inside ``pk.parallelize``'s region, an all-reduce of the gradient
    shares: ``layout.summed``). ``dense``: the kind of pool it stands for, which runs whole
    tensors and is what :meth:`to_dense` gives back (a 3-D pool stays a 3-D pool)."""

    ends_spatial_region = True  # for parallelkit.parallel.spatial_guard

    def __init__(
        self, *, comm: Communicator, dense: type[nn.Module] = nn.AdaptiveAvgPool2d
    ) -> None:
        super().__init__()
        self.comm, self.dense = comm, dense

    @classmethod
    def from_dense(cls, pool: nn.Module, comm: Communicator) -> SpatialGlobalAvgPool2d:
        return cls(comm=comm, dense=type(pool))

    def forward(self, x_blk: torch.Tensor) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        n, c, *spatial = x_blk.shape
        sums = x_blk.sum(tuple(range(2, x_blk.dim()))).reshape(-1)
        count = sums.new_tensor([math.prod(spatial)])
        total = layout.summed(torch.cat([sums, count]), self.comm)
        return (total[:-1] / total[-1]).view(n, c, *(1,) * len(spatial))

    def to_dense(self) -> nn.Module:
        return self.dense(1)
