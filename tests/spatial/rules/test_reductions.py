"""The reductions rules (parallelkit/spatial/rules/reductions.py): sums, means, extremes, norms
and variances over H and W, or over others.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spatial.rules.rows import is_refused, keeps_a_block, makes_a_whole_tensor

BLOCKS = {
    "stack, then a sum over the new dimension": lambda x: torch.stack([x, x * 2]).sum(0),
    "mean over channels": lambda x: x.mean(1, keepdim=True),
    "softmax over channels": lambda x: x.softmax(1),
    "stack before C, flattened, then a softmax over it": (
        lambda x: torch.stack([x, x], 1).flatten(1).softmax(1)
    ),
    "torch.max of two blocks": lambda x: torch.max(x, x * 2),
    "max over channels, with indices": lambda x: x.max(1).values,
    "mean over channels, channels last": lambda x: x.permute(0, 2, 3, 1).mean(-1).unsqueeze(1),
    "stack after W": lambda x: torch.stack([x, 2 * x], -1).sum(-1),
    "max over channels, keepdim, values": lambda x: torch.max(x, dim=1, keepdim=True)[0],
    "min over channels, channels last": lambda x: x.permute(0, 2, 3, 1).min(-1).values.unsqueeze(1),
    "argmax over channels": lambda x: x + x.argmax(1, keepdim=True),
    "F.normalize over channels": lambda x: F.normalize(x, dim=1),
    "norm over channels": lambda x: x / x.norm(dim=1, keepdim=True),
    "repeat into a new leading dimension": lambda x: x.repeat((3, 1, 1, 1, 1)).sum(0),
    "a whole (N, C, 1, 1) gate expanded to the block (timm's ECA)": lambda x: (
        x * x.mean((2, 3), keepdim=True).sigmoid().expand_as(x)
    ),
}

WHOLE = {
    "mean over H and W": (lambda x: x.mean((2, 3)), lambda x: x.mean((2, 3))),
    "sum over N, H and W": (lambda x: x.sum((0, 2, 3), keepdim=True), None),
    "amax over H and W": (lambda x: x.amax((2, 3)), None),
    "amin over N, H and W, kept": (lambda x: x.amin((0, 2, 3), keepdim=True), None),
    "max of everything": (lambda x: x.max(), None),
    "F.layer_norm over C, H and W, then a sum": (
        lambda x: F.layer_norm(x, (4, 5, 6), torch.linspace(0, 1, 120).view(4, 5, 6),
                               torch.ones(4, 5, 6)).sum((2, 3)),
        None,
    ),
    "var over H and W": (lambda x: x.var((2, 3)), None),
    "std over N, H and W, biased, kept": (
        lambda x: x.std((0, 2, 3), correction=0, keepdim=True), None
    ),
    "amax of integers": (lambda x: (x * 10).long().amax((2, 3)) + x.mean((2, 3)), None),
    "amax with ties (ReLU's zeros)": (lambda x: (-x.abs()).relu().amax((2, 3)), None),
    "F.group_norm, then a sum": (
        lambda x: F.group_norm(x, 2, torch.linspace(1, 2, 4), torch.ones(4)).sum((2, 3)),
        None,
    ),
    "F.instance_norm, then a mean": (lambda x: F.instance_norm(x).mean((2, 3)), None),
    # ConvNeXt-V2's global response normalization: a norm over H and W, channels last.
    "GRN: torch.norm p=2 over H and W, channels last": (
        lambda x: (lambda y: (y * torch.norm(y, p=2, dim=(1, 2), keepdim=True)).sum((1, 2)))(
            x.permute(0, 2, 3, 1)
        ),
        None,
    ),
    "Tensor.norm p=1 over H and W": (lambda x: x.norm(1, dim=(2, 3)), None),
    "vector_norm inf over N, H and W, kept": (
        lambda x: torch.linalg.vector_norm(x, float("inf"), dim=(0, 2, 3), keepdim=True), None
    ),
    "vector_norm of everything": (lambda x: torch.linalg.vector_norm(x), None),
    "norm over H and W of zeros has a zero gradient": (
        lambda x: (x * 0).norm(dim=(2, 3)) + x.mean((2, 3)), None
    ),
    "sum over H and W with a dtype": (lambda x: x.sum((2, 3), dtype=torch.float64), None),
    "logsumexp over H and W": (lambda x: torch.logsumexp(x * 3, (2, 3)), None),
    "logsumexp over C, H and W, kept": (lambda x: x.logsumexp((1, 2, 3), keepdim=True), None),
    "a mean by hand: the sum over H and W over H * W read from x.shape": (
        lambda x: x.sum((2, 3)) / (x.shape[2] * x.shape[3]), None
    ),
    "F.mse_loss against a block, and F.l1_loss summed": (
        lambda x: F.mse_loss(x, x.flip(1) * 2) + F.l1_loss(x.relu(), x, reduction="sum"), None
    ),
    # A fold that holds every spatial dimension: each rank's part of it is its own.
    "view(N, -1), then a sum over it": (lambda x: x.view(2, -1).sum(1), None),
}

REFUSED = {
    # Merging spatial dimensions with others folds them: what treats the fold as a batch
    # takes it; what reads across it is refused.
    "flatten(1, 2): C with H, then a sum over it": (
        lambda x: x.flatten(1, 2).sum(1), "Tensor.sum in the model's forward touches a block of "
        "split images, and it is given a window partition",
    ),
    "max over W, with indices": (lambda x: x.max(3), "reduces over a spatial dimension"),
    "argmax over H": (lambda x: x.argmax(2), "reduces over a spatial dimension"),
    "norm over W only": (lambda x: x.norm(dim=3), "some of the spatial dimensions"),
    "norm p=3 over H and W": (lambda x: x.norm(3, dim=(2, 3)), "p=3"),
    "F.normalize over W": (lambda x: F.normalize(x, dim=-1), "normalizes over a spatial dimension"),
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
