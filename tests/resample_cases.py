"""Rank-side cases for resampling on blocks (``parallelkit.spatial.resample``): a network
that convolves, resamples and convolves again, under ``pk.parallelize``, against the dense
model; and a record of the largest tensor each rank creates."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.spatial import resample as spatial_resample

# name -> (the operation, the sample shape)
OPS = {
    "bilinear x2, align_corners": (
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True),
        (3, 11, 9),
    ),
    "nearest x1.5": (lambda x: F.interpolate(x, scale_factor=1.5), (3, 11, 9)),
    "nearest-exact x1.7": (
        lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest-exact"), (3, 10, 9)
    ),
    "bicubic by (1.6, 0.7)": (
        lambda x: F.interpolate(x, scale_factor=(1.6, 0.7), mode="bicubic"), (3, 11, 9)
    ),
    "bilinear x0.5, antialias": (
        lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True),
        (3, 16, 12),
    ),
    "area x0.6": (lambda x: F.interpolate(x, scale_factor=0.6, mode="area"), (3, 15, 10)),
    "adaptive average to 3 x 5": (lambda x: F.adaptive_avg_pool2d(x, (3, 5)), (3, 11, 9)),
    "adaptive average to 6 (PSPNet)": (lambda x: F.adaptive_avg_pool2d(x, 6), (3, 13, 12)),
    "trilinear x1.5, align_corners": (
        lambda x: F.interpolate(x, scale_factor=1.5, mode="trilinear", align_corners=True),
        (3, 7, 6, 5),
    ),
    "adaptive average to 2 x 3 x 2": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), (3, 9, 7, 6)),
    "linear x2.5, align_corners": (
        lambda x: F.interpolate(x, scale_factor=2.5, mode="linear", align_corners=True), (3, 13)
    ),
}

CONV = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}


class Resampling(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        conv = CONV[len(OPS[op][1]) + 1]
        self.before, self.after = conv(3, 4, 3, padding=1), conv(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = OPS[self.op][0](self.before(x))
        return y if self.op.startswith("adaptive") else self.after(y)  # those end whole


class _OffByOne:
    """``parallelkit.functional`` whose ``gather_rows`` fetches every range one row later (a
    negative control's defect)."""

    @staticmethod
    def gather_rows(x, comm, dim, sizes, want, *rest):  # type: ignore[no-untyped-def]
        n = sum(sizes)
        shifted = [(min(lo + 1, n), min(hi + 1, n)) if hi > lo else (lo, hi) for lo, hi in want]
        got = pkf.gather_rows(x, comm, dim, sizes, shifted, *rest)
        rank_want = want[comm.rank]
        return F.pad(got, _pad_to(got, dim, rank_want[1] - rank_want[0]))


def _pad_to(t: torch.Tensor, dim: int, rows: int) -> list[int]:
    pads = [0] * (2 * (t.dim() - 2))
    pads[2 * (t.dim() - 1 - dim) + 1] = rows - t.shape[dim]
    return pads


def resample_parity(comm: Communicator, op: str, grid: dict, tamper: bool = False) -> list:
    """The network on ``grid`` against the dense one: output, input gradient, parameter
    gradients. ``tamper``: every fetch one row off (a negative control)."""
    if tamper:
        spatial_resample.pkf = _OffByOne
    try:
        return _parity(comm, op, grid)
    finally:
        spatial_resample.pkf = pkf


def _parity(comm: Communicator, op: str, grid: dict) -> list:
    torch.manual_seed(0)
    dense = Resampling(op).double()
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(copy.deepcopy(dense), g, g)
    shape = OPS[op][1]
    x = torch.randn(2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xd, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, ym = dense(xd), model(xm)
    yd.square().sum().backward()
    ym.square().sum().backward()
    out = [("output", ym.detach(), yd.detach()), ("input grad", xm.grad, xd.grad)]
    params = dict(dense.named_parameters())
    for name, p in pk.to_dense(model).named_parameters():
        if params[name].grad is not None or p.grad is not None:
            out.append((f"{name} grad", p.grad, params[name].grad))
    return out
