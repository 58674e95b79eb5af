"""The indexing rules (parallelkit/spatial/rules/indexing.py): cat, stack, split, narrow,
select, indexing and index assignment.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch

from spatial.rules.rows import is_refused, keeps_a_block, makes_a_whole_tensor

BLOCKS = {
    "channel slice": lambda x: x[:, 1:3],
    "batch index": lambda x: x[0],
    "cat along channels": lambda x: torch.cat([x, x * 2], dim=1),
    "chunk along channels": lambda x: x.chunk(2, dim=1)[1],
    "a step over W": lambda x: x[..., 1::2],
    # Spellings of channel slicing that leave H and W whole (GhostNet's x[:, :n, :, :]).
    "channel slice with full H and W slices": lambda x: x[:, :2, :, :],
    "channel slice after an ellipsis, channels last": lambda x: (
        x.permute(0, 2, 3, 1)[..., 1:3].permute(0, 3, 1, 2)
    ),
    "channel index tensor": lambda x: x[:, torch.tensor([3, 0, 2])],
    "boolean channel mask": lambda x: x[:, torch.tensor([True, False, True, True])],
    "new dimension before H": lambda x: x[:, :, None].squeeze(2),
    "narrow on C": lambda x: x.narrow(1, 1, 2),
    "index_select on C": lambda x: torch.index_select(x, 1, torch.tensor([1, 1, 0])),
    "split on C by sizes": lambda x: torch.split(x, [1, 3], dim=1)[1],
    "chunk on C, keyword dim": lambda x: torch.chunk(x, 2, dim=1)[0],
    "select a channel": lambda x: x.select(1, 2).unsqueeze(1),
    "a block expanded along a size-1 channel dimension": lambda x: (
        x[:, :1].expand_as(x) + x
    ),
    "cat with whole coordinate maps (CoordConv)": lambda x: torch.cat(
        [x, torch.linspace(-1, 1, x.shape[2]).view(1, 1, -1, 1).expand(2, 1, -1, x.shape[3])], 1
    ),
    "assignment to a channel slice (ReXNet's out[:, :c] += shortcut)": lambda x: (
        lambda y: (y.__setitem__((slice(None), slice(0, 2)), y[:, :2] + x[:, 1:3]), y)[1]
    )(x * 2),
    "a slice to the whole size is whole (Swin's unpad x[:, :H, :W, :])": lambda x: (
        x.permute(0, 2, 3, 1)[:, : x.shape[2], : x.shape[3], :].permute(0, 3, 1, 2)
    ),
}

WHOLE = {
    "a mean by hand over numel()": (lambda x: x.sum((1, 2, 3)) / x[0].numel(), None),
}

REFUSED = {
    "flatten(1, 2): C with H, then a slice of it": (
        lambda x: x.flatten(1, 2)[:, :3], "reaches into windows folded into one dimension"
    ),

    "index along W": (lambda x: x[..., 0], "reaches a spatial dimension"),
    "narrow along H": (lambda x: x.narrow(2, 0, 2), "cuts along a spatial dimension"),
    "a slice of H keeping no row": (lambda x: x[:, :, 7:], "keeps no row"),
    "cat along H": (lambda x: torch.cat([x, x], 2), "along a spatial dimension"),
    "stack before C, flattened, then a cumsum over it": (
        lambda x: torch.stack([x, x], 1).flatten(1).cumsum(1), "it is given a window partition"
    ),
    "assignment to a slice of H": (
        lambda x: x.clone().__setitem__((slice(None), slice(None), slice(0, 2)), 0.0),
        "writes to part of a spatial dimension",
    ),
    "split along W": (lambda x: x.split(3, dim=3), "cuts along a spatial dimension"),
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
