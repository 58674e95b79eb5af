"""The checks that the rules' tests (tests/spatial/rules/test_<family>.py) make of one
operation at a time, on a guard over a one-rank group.

A guard over one rank follows blocks exactly as over many (its collectives are then copies):
each allowed operation must keep the result a block (or make it whole, for sums and means
over H and W) with the dense value, and each operation without an exact rule must raise the
guard's ValueError before it runs. Whole networks under the guard, on 2-4 ranks, are in
tests/parallel/test_parallelize.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial.guard import SpatialGuard

X = torch.randn(2, 4, 5, 6)

Op = Callable[[torch.Tensor], torch.Tensor]


def guarded() -> tuple[SpatialGuard, torch.Tensor]:
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = X.clone().requires_grad_()
    guard.mark(x, size=(5, 6))  # the whole size, as a region records it
    return guard, x


def keeps_a_block(op: Op) -> None:
    guard, x = guarded()
    with guard:
        y = op(x)
    assert guard.is_split(y)
    torch.testing.assert_close(y, op(X.clone().requires_grad_()))


def makes_a_whole_tensor(case: tuple[Op, object]) -> None:
    """Sums and means over H and W: whole on every rank, with the dense value and gradient."""
    op, _ = case
    guard, x = guarded()
    with guard:
        y = op(x)
    assert not guard.is_split(y)
    torch.testing.assert_close(y, op(X))
    y.sum().backward()
    x_dense = X.clone().requires_grad_()
    op(x_dense).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad)


def is_refused(case: tuple[Op, str]) -> None:
    """Refused before it runs, saying why and how to keep the module dense."""
    op, why = case
    guard, x = guarded()
    with guard, pytest.raises(ValueError, match="spatial parallelism: ") as info:
        op(x)
    assert why in str(info.value)
    assert "keep_dense=[" in str(info.value)


def resamples_a_block(op: Op) -> None:
    """Interpolation the upsampling layer does not cover: torch's own weights per dimension,
    applied to the rows each block reads; nothing gathered, so nothing warned."""
    guard, x = guarded()
    with guard, warnings.catch_warnings():
        warnings.simplefilter("error")
        y = op(x)
    assert guard.is_split(y)
    torch.testing.assert_close(y, op(X))
