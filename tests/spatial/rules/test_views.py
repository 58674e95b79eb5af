"""The views rules (parallelkit/spatial/rules/views.py): views, reshapes, permutes, repeats and
reads of a block's shape.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial.guard import SpatialGuard
from spatial.rules.rows import is_refused, keeps_a_block


def _flag_unset(x: torch.Tensor) -> torch.Tensor:
    y = x.detach()
    y.requires_grad = False
    return y


BLOCKS = {
    "requires_grad set on a detached block": _flag_unset,
    "view of the leading dims": lambda x: x.view(2, 2, 2, 5, 6),
    "transpose of the leading dims": lambda x: x.transpose(0, 1),
    "flatten of the leading dims": lambda x: x.flatten(0, 1),
    "a window partition folding H with N and back": lambda x: (
        x.permute(0, 2, 3, 1).reshape(10, 6, 4).relu() * torch.ones(10, 1, 1)
    ).view(2, 5, 6, 4).permute(0, 3, 1, 2),
    "repeat along channels only (MONAI's VNet)": lambda x: x.repeat(1, 2, 1, 1),
    "view to sizes read from x.shape": lambda x: x.view(*x.shape[:2], x.size(2), x.size(-1)),
    "reshape with -1 for the channels": lambda x: x.reshape(-1, 2, *x.shape[2:]),
    "unflatten the channels, view as another block": lambda x: (
        x.unflatten(1, (2, 2)).flatten(1, 2).view_as(x)
    ),
    "space to depth by 2 along W, as timm's SpaceToDepth, and back": lambda x: (
        x.view(2, 4, 5, 3, 2).permute(0, 4, 1, 2, 3).reshape(2, 8, 5, 3)
        .view(2, 2, 4, 5, 3).permute(0, 2, 3, 4, 1).reshape(2, 4, 5, 6)
    ),
    "constants of the whole shape: x.new_zeros(x.shape), torch.ones(n, c, *x.shape[2:])": (
        lambda x: x + x.new_full(x.shape, 2.0) * torch.ones(2, 4, *x.shape[2:])
        + torch.zeros_like(x) + x.new_zeros(*x.shape)
    ),
    "whole tensors of the whole size, cut to the block: a (C, H, W) map, an arange over W":
        lambda x: x * torch.ones(4).view(4, 1, 1).expand(4, 5, 6) + torch.arange(x.shape[-1]),
}

REFUSED = {
    "repeat along W": (lambda x: x.repeat(1, 1, 1, 2), "it repeats a spatial dimension"),
    "a whole tensor varying over H expanded to the block": (
        lambda x: torch.ones(1, 1, 5, 1).expand_as(x), "varies over a spatial dimension"
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])


@pytest.mark.parametrize(
    ("size", "window", "grid"),
    [((14, 7), (7, 7), (2, 1)), ((7, 14), (7, 7), (1, 2)), ((16, 4, 4), (8, 4, 4), (2, 1, 1))],
)
def test_a_window_partition_folds_the_window_grid_and_its_reverse_unfolds_it(size, window, grid):
    """Swin's partition of a channels-last map (torchvision's views and permutes, 2-D and
    3-D): the window grid, one window wide along some dimensions, is folded into the batch,
    the windows' own rows are not spatial, and the reverse gives the map back, unfolded."""
    n, c, k = 2, 3, len(size)
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = torch.randn(n, *size, c)
    guard.mark(x, places=tuple(range(-k - 1, -1)), size=size)
    split = [v for s, w in zip(size, window, strict=True) for v in (s // w, w)]
    order = [0, *range(1, 2 * k, 2), *range(2, 2 * k + 1, 2), 2 * k + 1]
    back = [0, *(v for d in range(k) for v in (1 + d, 1 + k + d)), 2 * k + 1]
    with guard:
        y = x.view(n, *split, c).permute(order).reshape(-1, math.prod(window), c)
        assert guard.folds(y) == (((n, None), *((g, d) for d, g in enumerate(grid))),)
        assert guard.places(y) == (-3,) * k
        z = y.view(n, *grid, *window, c).permute(back).reshape(n, *size, c)
    assert guard.places(z) == tuple(range(-k - 1, -1)) and guard.folds(z) == ()
    torch.testing.assert_close(z, x)
