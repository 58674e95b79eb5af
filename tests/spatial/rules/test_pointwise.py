"""The pointwise rules (parallelkit/spatial/rules/pointwise.py): activations, arithmetic, type
changes; whole tensors meeting blocks.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spatial.rules.rows import is_refused, keeps_a_block

BLOCKS = {
    "activation": lambda x: F.silu(x).relu_(),
    "arithmetic with a whole (1, C, 1, 1) tensor": lambda x: x * torch.ones(1, 4, 1, 1) + 1,
    "arithmetic with a scalar tensor": lambda x: x / torch.tensor(2.0),
    "where": lambda x: torch.where(x > 0, x, 0.1 * x),
    "dtype and memory format": lambda x: x.double().contiguous(memory_format=torch.channels_last),
}

REFUSED = {
    "a whole tensor varying over W, not of its size": (
        lambda x: x + torch.ones(5), "varies over a spatial dimension, whose whole size is 6"
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])
