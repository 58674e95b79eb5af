"""Differentiable collectives under mpiexec: the gloo tier's adjoint, double-backward and halo
cases, with the global sums taken by the MPI communicator itself."""

from __future__ import annotations

import pytest
import torch

from functional_cases import (
    PRIMITIVES,
    adjoint_products,
    double_backward,
    gather_rows_values,
    halo_values,
)


@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_adjoint(comm, name):
    lhs, rhs = comm.all_reduce(torch.tensor(adjoint_products(comm, name), dtype=torch.float64))
    assert abs(float(lhs)) > 1e-3
    assert float(lhs) == pytest.approx(float(rhs), rel=1e-12)


@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_double_backward(comm, name):
    got, expected = double_backward(comm, name)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize(("total", "dim", "lo", "hi"), [(9, 0, 1, 1), (10, 1, 2, 1), (9, 2, 0, 2)])
def test_halo_exchange_values(comm, total, dim, lo, hi, periodic):
    got, expected = halo_values(comm, total, dim, lo, hi, periodic)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gather_rows_values(comm):
    got, expected = gather_rows_values(comm, float("-inf"))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
