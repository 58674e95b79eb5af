"""Rank-side cases for the differentiable collectives, shared by the gloo and mpiexec tiers.

Adjoint (dot-product) shares, double backward, and halo exchange values against NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.geometry import tensor_split_sizes

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
    "scatter_to_group": (
        lambda x, c: pkf.scatter_to_group(x, c, 1),
        lambda r, n: (2, 7),
        True,
        False,
    ),
    "gather_from_group": (
        lambda x, c: pkf.gather_from_group(x, c, 0, [r + 1 for r in range(c.size)]),
        lambda r, n: (r + 1, 3),
        False,
        True,
    ),
    # Rows 0..9 split 4 3 2 1 (n=4); rank r wants a window reaching past both ends and past
    # its neighbours, so rows come from further ranks too.
    "gather_rows": (
        lambda x, c: pkf.gather_rows(x, c, 1, _row_sizes(c.size), _wants(c.size)),
        lambda r, n: (2, _row_sizes(n)[r], 3),
        False,
        False,
    ),
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


def _row_sizes(n: int) -> list[int]:
    return [n - r for r in range(n)]  # uneven: 4 3 2 1 on four ranks


def _wants(n: int) -> list[tuple[int, int]]:
    total = sum(_row_sizes(n))
    return [(max(r * 2 - 3, -2), min(r * 3 + 4, total + 2)) for r in range(n)]


def _randn(shape, seed: int, rank: int) -> torch.Tensor:
    return torch.randn(
        shape, generator=torch.Generator().manual_seed(seed * 100 + rank), dtype=torch.float64
    )


def adjoint_products(
    comm: Communicator, name: str, wrong_adjoint: bool = False, device: str | None = None
) -> tuple[float, float]:
    """This rank's shares of ⟨F x, y⟩ and ⟨x, F* y⟩ (replicated spaces counted once overall)."""
    f, shape, x_replicated, y_replicated = PRIMITIVES[name]
    x = _randn(shape(comm.rank, comm.size), 1, 0 if x_replicated else comm.rank)
    x = x.to(device).requires_grad_()
    fx = f(x, comm)
    y = _randn(fx.shape, 2, 0 if y_replicated else comm.rank).to(device)
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


def gather_rows_values(comm: Communicator, fill: float):
    """(this rank's gather_rows result, the same rows cut from a fill-padded global tensor)."""
    sizes, want = _row_sizes(comm.size), _wants(comm.size)
    whole = torch.arange(sum(sizes) * 2, dtype=torch.float64).reshape(-1, 2) + 1
    start = sum(sizes[: comm.rank])
    got = pkf.gather_rows(whole[start : start + sizes[comm.rank]], comm, 0, sizes, want, fill)
    lo, hi = want[comm.rank]
    padded = torch.cat([whole.new_full((2, 2), fill), whole, whole.new_full((2, 2), fill)])
    return got, padded[lo + 2 : hi + 2]


def halo_too_thin(comm: Communicator) -> str:
    sizes = tensor_split_sizes(5, comm.size)  # 2 1 1 1 on four ranks
    x = torch.zeros(sizes[comm.rank], 3)
    with pytest.raises(ValueError) as info:
        pkf.halo_exchange(x, comm, 0, 2, 2, sizes=sizes)
    return str(info.value)
