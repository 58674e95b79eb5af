"""The windows rules (parallelkit/spatial/rules/windows.py): functional convolution.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spatial.rules.rows import is_refused, keeps_a_block

BLOCKS = {
    "1x1 F.conv2d": lambda x: F.conv2d(x, torch.ones(3, 4, 1, 1)),
    "3x3 F.conv2d, stride 2": lambda x: F.conv2d(x, torch.ones(3, 4, 3, 3), stride=2, padding=1),
    "F.conv2d, 'same', dilated, grouped": lambda x: F.conv2d(
        x, torch.linspace(-1, 1, 2 * 2 * 4 * 3).view(2, 2, 4, 3), padding="same", dilation=2,
        groups=2,
    ),
    "a Conv2d with padding_mode='reflect'": nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect"),
}

REFUSED = {
    "F.conv2d with a split weight": (
        lambda x: F.conv2d(x, x[:, :, :2, :2]), "its weight is a block"
    ),
    "F.conv2d of a whole tensor by a block": (
        lambda x: F.conv2d(torch.ones(1, 4, 7, 8), x),
        "its weight is a block",
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])
