"""Differentiable collectives on gloo, 1-4 ranks: adjoint (dot-product) tests in float64,
double backward, and halo exchange values against a NumPy-padded global tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import WORLD_SIZES

import parallelkit.functional as pkf
from parallelkit.comm import Communicator, tensor_split_sizes

# name -> (function of (x, comm), x shape for rank r of n, is x replicated, is F(x) replicated)
PRIMITIVES = {
    "all_gather dim0": (
        lambda x, c: pkf.all_gather(x, c, 0),
        lambda r, n: (r + 1, 3),
        False,
        False,
    ),
    "all_gather dim1": (
        lambda x, c: pkf.all_gather(x, c, 1),
        lambda r, n: (2, (r + 2) % 3),
        False,
        False,
    ),
    "reduce_scatter": (lambda x, c: pkf.reduce_scatter(x, c, 0), lambda r, n: (7, 2), False, False),
    "reduce_scatter dim1": (
        lambda x, c: pkf.reduce_scatter(x, c, 1),
        lambda r, n: (2, 5),
        False,
        False,
    ),
    "all_reduce": (pkf.all_reduce, lambda r, n: (4, 3), False, False),
    "broadcast": (lambda x, c: pkf.broadcast(x, c, c.size - 1), lambda r, n: (5,), False, False),
    "reduce": (lambda x, c: pkf.reduce(x, c, 0), lambda r, n: (5,), False, False),
    "copy_to_group": (pkf.copy_to_group, lambda r, n: (3, 2), True, False),
    "reduce_from_group": (pkf.reduce_from_group, lambda r, n: (3, 2), False, True),
    "halo": (
        lambda x, c: pkf.halo_exchange(x, c, 1, 1, 2),
        lambda r, n: (2, 3 + r % 2, 2),
        False,
        False,
    ),
    "halo periodic dim2": (
        lambda x, c: pkf.halo_exchange(x, c, 2, 2, 1, periodic=True),
        lambda r, n: (2, 2, 2 + r),
        False,
        False,
    ),
    "halo lo only": (
        lambda x, c: pkf.halo_exchange(x, c, 0, 2, 0),
        lambda r, n: (3, 2),
        False,
        False,
    ),
}


def _randn(shape, seed: int, rank: int) -> torch.Tensor:
    return torch.randn(
        shape, generator=torch.Generator().manual_seed(seed * 100 + rank), dtype=torch.float64
    )


def adjoint_products(
    comm: Communicator, name: str, wrong_adjoint: bool = False
) -> tuple[float, float]:
    """This rank's shares of ⟨F x, y⟩ and ⟨x, F* y⟩ (replicated spaces counted once overall)."""
    f, shape, x_replicated, y_replicated = PRIMITIVES[name]
    x = _randn(shape(comm.rank, comm.size), 1, 0 if x_replicated else comm.rank).requires_grad_()
    fx = f(x, comm)
    y = _randn(fx.shape, 2, 0 if y_replicated else comm.rank)
    (fty,) = torch.autograd.grad(fx, x, y)
    if wrong_adjoint:  # an all-gather whose backward only slices its own block: wrong
        start = sum(shape(r, comm.size)[0] for r in range(comm.rank))
        fty = y[start : start + x.shape[0]]
    w_y = 1 / comm.size if y_replicated else 1.0
    w_x = 1 / comm.size if x_replicated else 1.0
    return w_y * float((fx.detach() * y).sum()), w_x * float((x.detach() * fty).sum())


def double_backward(comm: Communicator, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ⟨F* y, z⟩ with respect to y is F z: F applied through double backward."""
    f, shape, x_replicated, y_replicated = PRIMITIVES[name]
    x = _randn(shape(comm.rank, comm.size), 1, 0 if x_replicated else comm.rank).requires_grad_()
    fx = f(x, comm)
    y = _randn(fx.shape, 2, 0 if y_replicated else comm.rank).requires_grad_()
    (fty,) = torch.autograd.grad(fx, x, y, create_graph=True)
    z = _randn(x.shape, 3, 0 if x_replicated else comm.rank)
    (fz,) = torch.autograd.grad(fty, y, z)
    return fz, f(z, comm)


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


# ----------------------------------------------------------------------------- halo values
def halo_values(comm: Communicator, total: int, dim: int, lo: int, hi: int, periodic: bool):
    """(this rank's halo_exchange result, the same block cut from the padded global tensor)."""
    shape = [2, 3, 4]
    shape[dim] = total
    whole = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1
    sizes = tensor_split_sizes(total, comm.size)
    start = sum(sizes[: comm.rank])
    mine = torch.from_numpy(np.take(whole, range(start, start + sizes[comm.rank]), dim).copy())
    pad = [(0, 0)] * 3
    pad[dim] = (lo, hi)
    padded = np.pad(whole, pad, mode="wrap" if periodic else "constant")
    expected = np.take(padded, range(start, start + sizes[comm.rank] + lo + hi), dim)
    got = pkf.halo_exchange(mine, comm, dim, lo, hi, periodic, sizes=sizes)
    return got, torch.from_numpy(expected.copy())


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize(
    ("total", "dim", "lo", "hi"), [(9, 0, 1, 1), (10, 1, 2, 1), (9, 2, 0, 2), (8, 2, 2, 0)]
)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_halo_exchange_values(ranks, size, total, dim, lo, hi, periodic):
    for got, expected in ranks(size).run(halo_values, total, dim, lo, hi, periodic):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def halo_too_thin(comm: Communicator) -> str:
    sizes = tensor_split_sizes(5, comm.size)  # 2 1 1 1 on four ranks
    x = torch.zeros(sizes[comm.rank], 3)
    with pytest.raises(ValueError) as info:
        pkf.halo_exchange(x, comm, 0, 2, 2, sizes=sizes)
    return str(info.value)


def test_halo_thinner_than_halo_raises_on_every_rank(ranks):
    messages = ranks(4).run(halo_too_thin)
    assert all("ranks [1, 2, 3]" in m and "at least 2 rows" in m for m in messages)
