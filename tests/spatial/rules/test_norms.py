"""The norms rules (parallelkit/spatial/rules/norms.py): group, instance and layer norm, and
linear maps over the channels.

One operation at a time on a one-rank guard; tests/spatial/rules/rows.py says what each
check asks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spatial.rules.rows import X, guarded, is_refused, keeps_a_block

BLOCKS = {
    # ConvNeXt: channels last, LayerNorm and Linear over the channels, layer scale, and back.
    "channels-last block": lambda x: (
        torch.ones(4) * F.linear(F.layer_norm(x.permute(0, 2, 3, 1), (4,)), torch.ones(4, 4))
    ).permute(0, 3, 1, 2),
    "a channels-last block @ a matrix": lambda x: (
        x.permute(0, 2, 3, 1) @ torch.linspace(-1, 1, 12).view(4, 3)
    ).permute(0, 3, 1, 2),
    "torch.einsum over the channels": lambda x: torch.einsum(
        "nchw,dc->ndhw", x, torch.linspace(-1, 1, 12).view(3, 4)
    ),
}

REFUSED = {
    "torch.einsum summing over W": (
        lambda x: torch.einsum("nchw->nch", x), "sums over a spatial dimension"
    ),
    "matmul over W": (lambda x: x @ torch.ones(6, 2), "it contracts a spatial dimension"),
    "F.layer_norm over W only": (lambda x: F.layer_norm(x, (6,)), "does not end in the whole"),
    "F.linear over W": (lambda x: F.linear(x, torch.ones(2, 6)), "acts over a spatial dimension"),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_keeps_a_block(name):
    keeps_a_block(BLOCKS[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused(name):
    is_refused(REFUSED[name])


@pytest.mark.parametrize("training", [True, False])
def test_instance_norm_with_running_statistics(training):
    """nn.InstanceNorm2d(track_running_stats=True): the output, the gradients and, in
    training, the running statistics as torch updates them."""
    guard, x = guarded()
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double()
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.uniform_(0.5, 2)
    dense = copy.deepcopy(norm).train(training)
    x64, x_dense = x.double(), X.double().requires_grad_()
    guard.mark(x64, size=(5, 6))
    with guard:
        y = norm.train(training)(x64)
    assert guard.is_split(y)
    want = dense(x_dense)
    torch.testing.assert_close(y, want)
    (y * torch.linspace(-1, 1, 6)).sum().backward()
    (want * torch.linspace(-1, 1, 6)).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad.float())
    torch.testing.assert_close(norm.weight.grad, dense.weight.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(norm, name), getattr(dense, name))
