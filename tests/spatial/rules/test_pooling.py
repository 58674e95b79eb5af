"""The pooling rules (parallelkit/spatial/rules/pooling.py): functional pooling and adaptive
pooling.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

from spatial.rules.rows import is_refused, keeps_a_block, makes_a_whole_tensor

BLOCKS = {
    "F.max_pool2d": lambda x: F.max_pool2d(x, 3, 2, 1),
    "F.avg_pool2d": lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
    "F.max_pool2d, ceil_mode": lambda x: F.max_pool2d(x, 2, ceil_mode=True),
    "F.avg_pool2d, ceil_mode": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "nn.LPPool2d, p=2, ceil_mode": nn.LPPool2d(2, 3, 2, ceil_mode=True),
    "F.lp_pool2d, p=inf": lambda x: F.lp_pool2d(x, float("inf"), 2),
}

WHOLE = {
    "F.adaptive_avg_pool2d(1)": (lambda x: F.adaptive_avg_pool2d(x, 1), None),
    "F.adaptive_avg_pool2d((2, 3))": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), None),
    "F.adaptive_max_pool2d(2)": (lambda x: F.adaptive_max_pool2d(x, 2), None),
    "F.adaptive_max_pool2d(1)": (lambda x: F.adaptive_max_pool2d(x, 1), None),
}

REFUSED = {
    "channels-last block into max pooling": (
        lambda x: F.max_pool2d(x.permute(0, 2, 3, 1), 2),
        "wants an (N, C, L), (N, C, H, W) or (N, C, D, H, W) block",
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(WHOLE))
def test_makes_a_whole_tensor(name):
    makes_a_whole_tensor(WHOLE[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])
