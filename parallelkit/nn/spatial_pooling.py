"""Spatially parallel pooling and upsampling: what whole networks need besides convolution.

Same scheme as :mod:`parallelkit.nn.spatial_parallel`: each rank keeps its block of the output,
fetches the input rows its windows read (:mod:`parallelkit.nn.spatial_fetch`; max pooling pads
with -inf, average pooling with zeros), and runs the plain torch operation on them. Global
average pooling ends the spatial region: a local sum and one all-reduce give every rank the
same (N, C, 1, 1) result, whose backward (for a loss that every rank computes identically) is
the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.geometry import Window, pair
from parallelkit.nn.spatial_fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial import layout
from parallelkit.spatial.grid import SpatialGrid, grid_of


class _SpatialPool(nn.Module):
    """Common part of max and average pooling: windows, validation, fetching."""

    fill = 0.0

    def __init__(self, kernel_size, stride, padding, dilation, ceil_mode, comm, grid) -> None:
        super().__init__()
        name = type(self).__name__
        if ceil_mode:
            raise ValueError(f"{name}: ceil_mode=True is not supported; pad the input instead")
        k, d = pair(kernel_size), pair(dilation)
        s = pair(stride) if stride is not None else k
        p = pair(padding)
        if any(pi > ki // 2 for pi, ki in zip(p, k, strict=True)):
            raise ValueError(
                f"{name}: padding {p} must be at most half the kernel {k}, as in torch"
            )
        self.kernel_size, self.stride, self.padding, self.dilation = k, s, p, d
        self.windows = tuple(Window(k[i], s[i], p[i], p[i], d[i]) for i in range(2))
        self.comm, self.grid = comm, grid_of(comm, grid)

    def _fetch(self, x_blk: torch.Tensor, size, native: bool = True):
        """(fetched block, output block (h, w), padding left to the torch operation)."""
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        return fetch(x_blk, self.grid, self.windows, size, self.fill, native)

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The whole output's (H, W) for whole inputs of ``size``: geometry only."""
        return self.windows[0].out_size(size[0]), self.windows[1].out_size(size[1])

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class SpatialMaxPool2d(_SpatialPool):
    """``nn.MaxPool2d`` on images split over a grid of ranks (padding rows are -inf)."""

    fill = float("-inf")

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
            raise ValueError("SpatialMaxPool2d: return_indices=True is not supported")
        super().__init__(kernel_size, stride, padding, dilation, ceil_mode, comm, grid)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        # max_pool2d pads with -inf itself, like the fetch.
        x, out_hw, pad = self._fetch(x_blk, size)
        if min(out_hw) == 0:
            return empty_output(x, x.shape[1], out_hw, x)
        return F.max_pool2d(x, self.kernel_size, self.stride, pad, self.dilation)

    @classmethod
    def from_dense(cls, pool: nn.MaxPool2d, comm: Communicator, grid=None) -> SpatialMaxPool2d:
        return cls(
            pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices,
            pool.ceil_mode, comm=comm, grid=grid,
        )  # fmt: skip

    def to_dense(self) -> nn.MaxPool2d:
        return nn.MaxPool2d(self.kernel_size, self.stride, self.padding, self.dilation)


class SpatialAvgPool2d(_SpatialPool):
    """``nn.AvgPool2d`` on images split over a grid of ranks.

    ``count_include_pad=False`` divides by the number of real (non-padding) inputs in each
    window, which each rank computes locally from the geometry.
    """

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

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        # Zero padding counted in the mean (or none): avg_pool2d may pad by itself.
        plain = (
            self.divisor_override is not None or self.count_include_pad or max(self.padding) == 0
        )
        x, out_hw, pad = self._fetch(x_blk, size, native=plain)
        if min(out_hw) == 0:
            return empty_output(x, x.shape[1], out_hw, x)
        if plain:
            return F.avg_pool2d(
                x, self.kernel_size, self.stride, pad, divisor_override=self.divisor_override
            )
        sums = F.avg_pool2d(x, self.kernel_size, self.stride, 0, divisor_override=1)
        return sums / F.avg_pool2d(self._real(x, size), self.kernel_size, self.stride, 0,
                                   divisor_override=1)  # fmt: skip

    def _real(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """1 where the fetched block holds image pixels, 0 on padding (pure geometry)."""
        masks = []
        for dim, (win, n) in enumerate(zip(self.windows, size, strict=True)):
            _, parts, idx = self.grid.axis(dim)
            _, _, want = win.plan(n, parts)
            lo, hi = want[idx]
            rows = torch.arange(lo, hi, device=x.device)
            masks.append(((rows >= 0) & (rows < n)).to(x.dtype))
        return (masks[0].view(-1, 1) * masks[1].view(1, -1)).expand(1, 1, -1, -1)

    @classmethod
    def from_dense(cls, pool: nn.AvgPool2d, comm: Communicator, grid=None) -> SpatialAvgPool2d:
        return cls(
            pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
            pool.divisor_override, comm=comm, grid=grid,
        )  # fmt: skip

    def to_dense(self) -> nn.AvgPool2d:
        return nn.AvgPool2d(
            self.kernel_size, self.stride, self.padding, False, self.count_include_pad,
            self.divisor_override,
        )  # fmt: skip


class SpatialUpsample(nn.Module):
    """``nn.Upsample`` by an integer ``scale_factor``, mode "nearest" or "bilinear"
    (``align_corners=False``), on images split over a grid of ranks.

    Each rank fetches the input rows its output block interpolates from, plus one row on each
    side for bilinear, so that no interpolation is clamped at a block edge that is not an image
    edge, upsamples them and crops its block.
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
        if mode not in ("nearest", "bilinear") or align_corners:
            raise ValueError(
                f"SpatialUpsample: mode must be 'nearest' or 'bilinear' with "
                f"align_corners=False, got mode={mode!r}, align_corners={align_corners}"
            )
        if int(scale_factor) != scale_factor or scale_factor < 1:
            raise ValueError(
                f"SpatialUpsample: scale_factor must be a positive integer, got {scale_factor}"
            )
        self.scale_factor, self.mode = int(scale_factor), mode
        self.comm, self.grid = comm, grid_of(comm, grid)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        s, extra = self.scale_factor, 1 if self.mode == "bilinear" else 0

        def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
            return (max(o0 // s - extra, 0), min(-(-o1 // s) + extra, n)) if o1 > o0 else (0, 0)

        x_blk, blocks, firsts = fetch_ranges(x_blk, self.grid, size, lambda _, n: n * s, needs)
        if min(o for _, o in blocks) == 0:
            return empty_output(x_blk, x_blk.shape[1], (blocks[0][1], blocks[1][1]), x_blk)
        y = F.interpolate(x_blk, scale_factor=s, mode=self.mode)
        return crop(y, [a * s for a in firsts], blocks)  # local row 0 is global row a * s

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        return size[0] * self.scale_factor, size[1] * self.scale_factor

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
    """``nn.AdaptiveAvgPool2d(1)`` ending the spatial region: (N, C, h, w) blocks -> the same
    (N, C, 1, 1) means on every rank. One all-reduce of the local sums and pixel counts; its
    backward is the identity, right for a loss every rank computes identically (inside
    ``pk.parallelize``'s region, an all-reduce of the gradient shares: ``layout.summed``)."""

    ends_spatial_region = True  # for parallelkit.parallel.spatial_guard

    def __init__(self, *, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x_blk: torch.Tensor) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        n, c = x_blk.shape[:2]
        sums = x_blk.sum((2, 3)).reshape(-1)
        count = sums.new_tensor([x_blk.shape[2] * x_blk.shape[3]])
        total = layout.summed(torch.cat([sums, count]), self.comm)
        return (total[:-1] / total[-1]).view(n, c, 1, 1)

    def to_dense(self) -> nn.AdaptiveAvgPool2d:
        return nn.AdaptiveAvgPool2d(1)
