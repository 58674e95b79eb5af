"""Parallel layers: drop-in replacements for torch.nn layers that communicate inside.

Each layer gives the dense layer's result on the whole batch or image (see DESIGN.md).
"""

from parallelkit.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
