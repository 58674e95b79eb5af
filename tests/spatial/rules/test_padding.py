"""The padding rules (parallelkit/spatial/rules/padding.py): pads, rolls and flips.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spatial.rules.rows import guarded, is_refused, keeps_a_block

BLOCKS = {
    "F.pad of H and W by a constant": lambda x: F.pad(x, (1, 2, 3, 0), value=0.5),
    "F.pad cropping W, padding C": lambda x: F.pad(x, (-1, 0, 0, 1, 1, 0)),
    "F.pad, reflect": lambda x: F.pad(x, (1, 2, 3, 0), mode="reflect"),
    "F.pad, replicate": lambda x: F.pad(x, (2, 1, 0, 3), mode="replicate"),
    "F.pad, circular": lambda x: F.pad(x, (1, 1, 2, 2), mode="circular"),
    "flip of the channels": lambda x: x.flip(1),
    # Sizes read from a block are the whole samples': what forward code computes from them.
    "F.pad to a multiple of 4, computed from x.shape": lambda x: F.pad(
        x, (0, -x.shape[-1] % 4, 0, -x.shape[-2] % 4)
    ),
    "slices of H: crops": lambda x: x[:, :, 1:, :] + x[:, :, :-1, :],
    "slices of H and W: a crop, channels sliced too": lambda x: x[:, 1:3, :4, 1:-1],
    "a crop of a channels-last block": lambda x: x.permute(0, 2, 3, 1)[:, 1:4, -3:],
    "F.pad of a channels-last block (Swin's pad to a window multiple)": lambda x: F.pad(
        x.permute(0, 2, 3, 1), (0, 1, 0, 2, 1, 0)
    ).permute(0, 3, 1, 2),
    "torch.roll along H and W, and C": lambda x: torch.roll(x, (2, -3, 1), (2, 3, 1)),
    "Tensor.roll along H, channels last": lambda x: (
        x.permute(0, 2, 3, 1).roll(4, 1).permute(0, 3, 1, 2)
    ),
    "F.pixel_unshuffle, F.pixel_shuffle": lambda x: F.pixel_shuffle(
        F.pixel_unshuffle(F.pad(x, (0, 0, 0, 1)), 2) * 2, 2
    ),
}

REFUSED = {
    "F.pad of a block with two dimensions before its spatial ones and C after": (
        lambda x: F.pad(x.permute(0, 2, 3, 1).unsqueeze(1), (0, 0, 1, 1)),
        "wants an (N, C, L), (N, C, H, W) or (N, C, D, H, W) block",
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])


def test_reflecting_more_rows_than_the_image_is_a_value_error():
    guard, x = guarded()
    with guard, pytest.raises(ValueError, match="needs more rows than the sample's 5"):
        F.pad(x, (0, 0, 5, 0), mode="reflect")
