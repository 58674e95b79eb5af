"""Differentiable collectives on gloo, 1-4 ranks: adjoint (dot-product) tests in float64,
double backward, and halo exchange values against a NumPy-padded global tensor."""

from __future__ import annotations

import pytest
import torch

from cases import WORLD_SIZES
from functional_cases import (
    PRIMITIVES,
    adjoint_products,
    double_backward,
    gather_rows_values,
    halo_too_thin,
    halo_values,
)


@pytest.mark.parametrize("name", list(PRIMITIVES))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_adjoint(ranks, size, name):
    shares = ranks(size).run(adjoint_products, name)
    lhs, rhs = sum(s[0] for s in shares), sum(s[1] for s in shares)
    assert abs(lhs) > 1e-3  # not vacuous
    assert lhs == pytest.approx(rhs, rel=1e-12)


@pytest.mark.parametrize("size", [2, 3])
def test_adjoint_test_catches_a_slicing_backward(ranks, size):
    """Negative control: an all-gather whose backward only slices fails the dot-product test."""
    shares = ranks(size).run(adjoint_products, "all_gather dim0", wrong_adjoint=True)
    lhs, rhs = sum(s[0] for s in shares), sum(s[1] for s in shares)
    assert lhs != pytest.approx(rhs, rel=1e-6)


@pytest.mark.parametrize("name", list(PRIMITIVES))
@pytest.mark.parametrize("size", [1, 3])
def test_double_backward(ranks, size, name):
    for got, expected in ranks(size).run(double_backward, name):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize(
    ("total", "dim", "lo", "hi"), [(9, 0, 1, 1), (10, 1, 2, 1), (9, 2, 0, 2), (8, 2, 2, 0)]
)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_halo_exchange_values(ranks, size, total, dim, lo, hi, periodic):
    for got, expected in ranks(size).run(halo_values, total, dim, lo, hi, periodic):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fill", [0.0, float("-inf")])
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_gather_rows_values(ranks, size, fill):
    for got, expected in ranks(size).run(gather_rows_values, fill):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_halo_thinner_than_halo_raises_on_every_rank(ranks):
    messages = ranks(4).run(halo_too_thin)
    assert all("ranks [1, 2, 3]" in m and "at least 2 rows" in m for m in messages)
