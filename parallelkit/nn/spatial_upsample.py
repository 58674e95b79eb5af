"""Spatially parallel upsampling: ``nn.Upsample`` on blocks of split samples.

Same scheme as :mod:`parallelkit.nn.spatial_parallel`: each rank keeps its block of the
output, by the kernel :func:`parallelkit.spatial.pool.upsample_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.blocks import SpatialLayer
from parallelkit.spatial.grid import GridSpec, grid_of
from parallelkit.spatial.pool import check_upsample, upsample_blocks, upsample_factor


class SpatialUpsample(SpatialLayer, nn.Module):
    """``nn.Upsample`` by an integer ``scale_factor``, mode "nearest", or "linear",
    "bilinear", "trilinear" (``align_corners=False``), on samples split over a grid of ranks.

    Each rank fetches the input rows its output block interpolates from, plus one row on each
    side for the interpolating modes, so that no interpolation is clamped at a block edge that
    is not the sample's edge, upsamples them and crops its block.
    """

    dense = nn.Upsample

    @classmethod
    def covers(cls, module: nn.Module) -> bool:
        """One integer factor, nearest or (bi-, tri-)linear without ``align_corners``: what
        the kernel does. Other upsampling stays dense and meets the guard's
        ``F.interpolate`` rule."""
        sf = module.scale_factor
        factors = sf if isinstance(sf, tuple) else (sf,)
        return module.size is None and upsample_factor(factors, module.mode,
                                                       module.align_corners) is not None

    def __init__(
        self,
        scale_factor: int,
        mode: str = "nearest",
        align_corners: bool | None = None,
        *,
        comm: Communicator,
        grid: GridSpec = None,
    ) -> None:
        super().__init__()
        self.scale_factor = check_upsample(scale_factor, mode, align_corners, "SpatialUpsample")
        self.mode = mode
        self.comm, self.grid = comm, grid_of(comm, grid)

    def forward(self, x_blk: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        if not record.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        return upsample_blocks(x_blk, self.scale_factor, self.mode, self.grid, size)

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
