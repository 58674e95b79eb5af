"""Parallel layers: drop-in replacements for torch.nn layers that communicate inside.

Each layer gives the dense layer's result on the whole batch or image (see docs/design.md).
"""

from parallelkit.nn.batchnorm_subclass import convert_sync_batchnorm
from parallelkit.nn.channel_parallel import (
    ChannelParallelConv1d,
    ChannelParallelConv2d,
    ChannelParallelConv3d,
)
from parallelkit.nn.channel_transposed import (
    ChannelParallelConvTranspose1d,
    ChannelParallelConvTranspose2d,
    ChannelParallelConvTranspose3d,
)
from parallelkit.nn.parallel_conv import ParallelConv2d
from parallelkit.nn.spatial_parallel import SpatialConvTranspose2d, SpatialParallelConv2d
from parallelkit.nn.spatial_pooling import (
    SpatialAvgPool2d,
    SpatialGlobalAvgPool2d,
    SpatialMaxPool2d,
)
from parallelkit.nn.spatial_upsample import SpatialUpsample
from parallelkit.nn.sync_batchnorm import SyncBatchNorm

__all__ = [
    "ChannelParallelConv1d",
    "ChannelParallelConv2d",
    "ChannelParallelConv3d",
    "ChannelParallelConvTranspose1d",
    "ChannelParallelConvTranspose2d",
    "ChannelParallelConvTranspose3d",
    "ParallelConv2d",
    "SpatialAvgPool2d",
    "SpatialConvTranspose2d",
    "SpatialGlobalAvgPool2d",
    "SpatialMaxPool2d",
    "SpatialParallelConv2d",
    "SpatialUpsample",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
]
