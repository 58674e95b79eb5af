"""The resize rules (parallelkit/spatial/rules/resize.py): interpolation.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from spatial.rules.rows import keeps_a_block, resamples_a_block

BLOCKS = {
    "F.interpolate x2, nearest": lambda x: F.interpolate(x, scale_factor=2),
    "F.interpolate to a block's size, twice its own, bilinear": lambda x: F.interpolate(
        x, size=F.interpolate(x, scale_factor=2).shape[-2:], mode="bilinear"
    ),
    "F.interpolate to a literal size, twice the sample's": lambda x: F.interpolate(
        x, size=(10, 12)
    ),
}

RESAMPLED = {
    "F.interpolate x2, align_corners": lambda x: F.interpolate(
        x, scale_factor=2, mode="bilinear", align_corners=True
    ),
    "F.interpolate by 1.5": lambda x: F.interpolate(x, scale_factor=1.5),
    "F.interpolate to a block's size, align_corners": lambda x: F.interpolate(
        F.avg_pool2d(x, 2), size=x.shape[-2:], mode="bilinear", align_corners=True
    ),
    "F.interpolate to a block's size, bicubic": lambda x: F.interpolate(
        x, size=F.avg_pool2d(x, 2).shape[-2:], mode="bicubic"
    ),
    "F.interpolate by 0.5, antialias": lambda x: F.interpolate(
        x, scale_factor=0.5, mode="bilinear", antialias=True
    ),
    "F.interpolate by 0.7, area": lambda x: F.interpolate(x, scale_factor=0.7, mode="area"),
    "F.interpolate to a size computed from x.shape, bicubic": lambda x: F.interpolate(
        x, size=(x.shape[-2] + 1, 7), mode="bicubic"
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(RESAMPLED))
def test_resamples_a_block(name):
    resamples_a_block(RESAMPLED[name])
