"""The random rules (parallelkit/spatial/rules/random.py): dropout masks.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spatial.rules.rows import X, guarded, is_refused, keeps_a_block

BLOCKS = {
    "eval dropout": lambda x: F.dropout(x, 0.5, training=False),
}

REFUSED = {
    "training alpha dropout": (lambda x: F.alpha_dropout(x, 0.5, True), "draw masks exactly"),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])


def test_training_dropout_draws_the_dense_mask():
    guard, x = guarded()
    state = torch.get_rng_state()
    with guard:
        y = F.dropout(x, 0.3)
    assert guard.is_split(y)
    torch.set_rng_state(state)
    torch.testing.assert_close(y, F.dropout(X, 0.3))
