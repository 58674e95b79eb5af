"""Rank-side cases for adaptive maximum pooling on blocks
(``parallelkit.spatial.adaptive_max``): the function on each rank's block against
``F.adaptive_max_pool*d`` on the whole input (output, indices, the block's input gradient),
on inputs full of ties and NaNs; a small CNN through ``pk.parallelize`` against the dense
one; and a record of the largest tensor each rank creates, with the warnings.

Every case returns (label, got, expected, assert_close options) quadruples.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.spatial import adaptive_max as sam
from parallelkit.spatial import grid_of

POOLS = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
GRID = ("depth", "rows", "cols")

# name -> (the sample shape (C, *spatial), the output size, the grid, the input's kind)
# Kinds: "ties" integers in [-1, 2], many equal maxima per bin; "relu" a ReLU'd normal (zeros
# tie); "nan" ties with a few NaNs (two in some bins) and -inf; "float32" ties in float32.
CASES = {
    2: {
        "rows: 7x9 to 3x5": ((3, 7, 9), (3, 5), dict(rows=2), "ties"),
        "cols: 8x9 to 5x7 (overlapping bins)": ((3, 8, 9), (5, 7), dict(cols=2), "relu"),
        "rows: 5x4 to 10x8 (larger than the input)": ((2, 5, 4), (10, 8), dict(rows=2), "ties"),
        "rows: NaNs and -inf, 6x6 to 4x4": ((2, 6, 6), (4, 4), dict(rows=2), "nan"),
        "rows: float32, 9x5 to 2x3": ((3, 9, 5), (2, 3), dict(rows=2), "float32"),
        "signal: 11 to 4": ((3, 11), (4,), dict(rows=2), "ties"),
        "rows: to 1x1": ((3, 6, 5), (1, 1), dict(rows=2), "relu"),
    },
    3: {
        "rows: 3 over 7 rows, 7x6 to 5x3": ((2, 7, 6), (5, 3), dict(rows=3), "ties"),
        "rows: 3 over 2 rows (an empty block)": ((2, 2, 6), (3, 4), dict(rows=3), "ties"),
        "rows: None keeps W, 8x9 to 3xW": ((3, 8, 9), (3, None), dict(rows=3), "relu"),
        "rows: NaNs, 9x4 to 7x3": ((2, 9, 4), (7, 3), dict(rows=3), "nan"),
        "volume, depth: 5x6x4 to 3x4x3": ((2, 5, 6, 4), (3, 4, 3), dict(depth=3), "ties"),
        "volume, cols: 4x5x7 to 2x3x5": ((2, 4, 5, 7), (2, 3, 5), dict(cols=3), "nan"),
        "signal: 7 to 5": ((3, 7), (5,), dict(rows=3), "relu"),
    },
    4: {
        "2x2: 9x11 to 3x5": ((3, 9, 11), (3, 5), dict(rows=2, cols=2), "ties"),
        "2x2: 7x7 to 6x6 (overlapping bins)": ((2, 7, 7), (6, 6), dict(rows=2, cols=2), "relu"),
        "2x2: 3x3 to 7x5 (larger)": ((2, 3, 3), (7, 5), dict(rows=2, cols=2), "ties"),
        "2x2: NaNs, 8x6 to 3x4": ((2, 8, 6), (3, 4), dict(rows=2, cols=2), "nan"),
        "rows: 4 over 3 rows (an empty block), to 2x3": ((2, 3, 5), (2, 3), dict(rows=4), "ties"),
        "volume, 2x2x1: 6x5x4 to 4x3x2": ((2, 6, 5, 4), (4, 3, 2), dict(depth=2, rows=2), "ties"),
        "volume, 1x2x2: 3x7x5 to 2x3x4": ((2, 3, 7, 5), (2, 3, 4), dict(rows=2, cols=2), "nan"),
        "signal: 4 over 3 (an empty block), 3 to 2": ((2, 3), (2,), dict(rows=4), "ties"),
    },
}


def sample(shape: tuple, kind: str, batch: int = 2) -> torch.Tensor:
    """The whole input, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    if kind == "relu":
        return torch.randn(batch, *shape, dtype=torch.float64, generator=gen).relu()
    x = torch.randint(-1, 3, (batch, *shape), generator=gen).to(torch.float64)
    if kind == "nan":
        where = torch.rand(x.shape, generator=gen)
        x[where < 0.12] = math.nan
        x[where > 0.9] = -math.inf
    return x.float() if kind == "float32" else x


def _last_maximum(v, q, dim):  # type: ignore[no-untyped-def]
    """A tie-breaking rule that keeps the last maximum instead of the first (a negative
    control's defect)."""
    value, kept = _first(v, torch.where(q == sam.LOSES, sam.LOSES, -q), dim)
    return value, torch.where(kept == sam.LOSES, sam.LOSES, -kept)


_first = sam.best


def pool_parity(comm: Communicator, size: int, tamper: bool = False) -> list:
    """Every case of ``size`` ranks: ``adaptive_max_pool`` on this rank's block against
    torch on the whole input. ``tamper``: ties keep the last maximum (a negative control)."""
    if tamper:
        sam.best = _last_maximum
    try:
        out = []
        for name, case in CASES[size].items():
            out += [(f"{name}: {label}", *rest) for label, *rest in _one(comm, *case)]
        return out
    finally:
        sam.best = _first


def _one(comm: Communicator, shape: tuple, outs: tuple, grid: dict, kind: str) -> list:
    ndim = len(shape) - 1
    spatial = grid_of(comm, tuple(grid.get(k, 1) for k in GRID))
    x = sample(shape, kind).requires_grad_()
    y, idx = POOLS[ndim](x, outs, return_indices=True)
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2))
    (y * w).sum().backward()
    cut = (slice(None), slice(None), *spatial.block(*shape[1:]))
    x_blk = x.detach()[cut].clone().requires_grad_()
    whole = [n if m is None else m for m, n in zip(outs, shape[1:], strict=True)]
    y_blk, idx_blk = sam.adaptive_max_pool(x_blk, comm, spatial, shape[1:], whole, True)
    (y_blk * w).sum().backward()
    nan = dict(equal_nan=True, rtol=0, atol=0)
    return [
        ("output", y_blk.detach(), y.detach(), nan),
        ("indices", idx_blk, idx, {}),
        ("input grad", x_blk.grad, x.grad[cut], dict(rtol=0, atol=0)),
    ]


# ----------------------------------------------------------------------- through parallelize
class PoolNet(nn.Module):
    """A convolution and ReLU beside the integer-valued input itself (ties whose gradients
    reach different input places), adaptive maximum pooling to 3 x 5, a linear head."""

    def __init__(self, indices: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d((3, 5), return_indices=indices)
        self.head = nn.Linear(6 * 15, 4)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        y = self.pool(torch.cat([self.conv(x).relu(), x], 1))
        if isinstance(y, tuple):
            return self.head(y[0].flatten(1)), y[1]
        return self.head(y.flatten(1))


def model_parity(comm: Communicator, grid: dict, indices: bool = False) -> list:
    """PoolNet under ``pk.parallelize`` against the dense one: output (and indices), input
    gradient, parameter gradients; and the warnings the parallel run gave."""
    torch.manual_seed(0)
    dense = PoolNet(indices).double()
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(copy.deepcopy(dense), g, g)
    x = sample((3, 11, 9), "ties", batch=2)
    xd, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ym = model(xm)
        (ym[0] if indices else ym).square().sum().backward()
    (yd[0] if indices else yd).square().sum().backward()
    out = [("output", (ym[0] if indices else ym).detach(), (yd[0] if indices else yd).detach(),
            {}), ("input grad", xm.grad, xd.grad, {})]  # fmt: skip
    if indices:
        out.append(("indices", ym[1], yd[1], {}))
    params = dict(dense.named_parameters())
    for name, p in pk.to_dense(model).named_parameters():
        out.append((f"{name} grad", p.grad, params[name].grad, {}))
    return [out, [str(w.message) for w in said]]


def largest_tensor(comm: Communicator, keep_dense: bool = False) -> tuple[int, str, int, list]:
    """(the largest tensor this rank creates, forward and backward, the operation that made
    it, one whole sample's elements, the warnings): a constant-width CNN ending in
    ``nn.AdaptiveMaxPool2d((3, 5))``, blocks in, on a 2 x 2 grid. ``keep_dense``: the pool
    runs on the gathered whole tensor (a negative control)."""
    from blocks_cases import _Largest

    torch.manual_seed(0)
    c, size = 4, (32, 24)
    net = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                        nn.ReLU(), nn.AdaptiveMaxPool2d((3, 5)), nn.Flatten())  # fmt: skip
    g = pk.Grid(comm, rows=2, cols=2)
    model = pk.parallelize(
        net.double(), g, g, spatial_input="blocks", spatial_size=size,
        keep_dense=["4"] if keep_dense else (),
    )  # fmt: skip
    block = grid_of(g.spatial_comm, g.spatial).block(*size)
    x_blk = torch.randn(1, c, *[s.stop - s.start for s in block], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as said, _Largest() as seen:
        warnings.simplefilter("always")
        model(x_blk.requires_grad_()).square().sum().backward()
    return seen.largest, seen.op, c * math.prod(size), [str(w.message) for w in said]
