"""Rank side of spatial/test_outputs.py: outputs that are not (N, C, *spatial) come back whole.

A segmentation network's output need not be (N, C, D, H, W): deep supervision stacks its heads
(MONAI's DynUNet: (N, heads, C, D, H, W)), and a channels-last head puts C after the spatial
dimensions. The spatial region gathers each output along wherever its spatial dimensions are.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator


class Heads(nn.Module):
    """Two heads at two scales, the coarse one interpolated up and stacked with the fine one,
    and a channels-last copy of the fine head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 3, 3, padding=1)
        self.down = nn.Conv3d(3, 3, 3, stride=2, padding=1)
        self.fine, self.coarse = nn.Conv3d(3, 2, 1), nn.Conv3d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.stem(x)
        fine = self.fine(y)
        coarse = F.interpolate(self.coarse(self.down(y)), size=fine.shape[2:])
        return torch.stack([fine, coarse], 1), fine.permute(0, 2, 3, 4, 1)


def outputs(comm: Communicator, dims: dict) -> list[tuple[str, float]]:
    """(label, largest difference) of the outputs and the input gradient against the dense
    model, on this rank."""
    torch.manual_seed(0)
    dense = Heads().double()
    grid = pk.Grid(comm, **dims)
    model = pk.parallelize(copy.deepcopy(dense), grid, grid)
    x = torch.randn(2, 1, 6, 8, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_dense, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = dense(x_dense), model(x_mine)
    sum(y.square().sum() for y in want).backward()
    sum(y.square().sum() for y in got).backward()
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same = g.shape == w.shape
        diff = (g - w).abs().max().item() if same else float("inf")
        out.append((f"output {i} {tuple(g.shape)}", diff))
    out.append(("input grad", (x_mine.grad - x_dense.grad).abs().max().item()))
    return out
