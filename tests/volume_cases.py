"""Rank-side cases for signals (N, C, L) and volumes (N, C, D, H, W) under the spatial strategy:
small networks holding every layer the N-D path swaps or rules on, trained against the dense
model.

``Volume`` has a 3-D U-Net's parts: "same" convolutions (the edge path, with faces, edges and
corners on 2-D and 3-D grids), a strided and an anisotropic convolution (the halo fetch),
BatchNorm3d, GroupNorm and InstanceNorm3d (running statistics too), max and average pooling
(``count_include_pad=False``), a transposed convolution, trilinear upsampling, dropout3d, a
circular-padded convolution (``F.pad``'s rule, then the convolution's), a skip connection
joined along channels and a global mean. ``Signal`` has the 1-D ones, reflect padding too.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.spatial import edges as spatial_edges

from network_cases import Triple, _grads


class Volume(nn.Module):
    def __init__(self, dropout: float = 0.0, running: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
            nn.Conv3d(4, 4, 3, padding=1, padding_mode="circular"),
        )  # fmt: skip
        self.down = nn.Sequential(
            nn.Conv3d(4, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.ReLU()
        )
        self.pool = nn.MaxPool3d(2)
        self.aniso = nn.Conv3d(4, 4, (3, 1, 3), padding=(2, 0, 1), dilation=(2, 1, 1))
        self.up = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.up2 = nn.Upsample(scale_factor=2, mode="trilinear")
        self.norm = nn.InstanceNorm3d(4, affine=True, track_running_stats=running)
        self.drop = nn.Dropout3d(dropout)
        self.head = nn.Conv3d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self.stem(x)
        y = self.up2(self.up(self.aniso(self.pool(self.down(skip)))))
        y = self.norm(y) + F.avg_pool3d(y, 3, 1, 1, count_include_pad=False)
        y = torch.cat([skip, self.drop(y)], 1)
        return self.head(y), y.mean((2, 3, 4))


class Signal(nn.Module):
    def __init__(self, dropout: float = 0.0, running: bool = True) -> None:
        super().__init__()
        self.a = nn.Sequential(
            nn.Conv1d(2, 4, 5, padding=2), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2)
        )
        self.b = nn.Sequential(
            nn.Conv1d(4, 4, 3, padding="same", dilation=2), nn.ReLU(), nn.Dropout1d(dropout),
            nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect"),
            nn.AvgPool1d(3, 1, 1, count_include_pad=False),
        )  # fmt: skip
        self.pool = nn.AvgPool1d(2)  # DenseNet's transition: no padding, a signal's own
        self.up = nn.Upsample(scale_factor=2, mode="linear")
        self.head = nn.Conv1d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.avg_pool1d(self.up(self.pool(self.b(self.a(x)))), 2, 1))


# name -> (network, sample shape without the batch)
NETS = {"volume": (Volume, (2, 8, 12, 8)), "signal": (Signal, (2, 22))}


def volume_parity(
    comm: Communicator, net: str, grid: dict | None, shape: tuple | None = None, steps: int = 2,
    tamper: bool = False, device: str | None = None,
) -> list[Triple]:  # fmt: skip
    """``net`` under ``pk.parallelize`` on ``grid`` (None: the plain communicator, which
    splits the first spatial dimension) against the dense model over SGD steps: outputs,
    input and parameter gradients, and every parameter and buffer after each step.
    ``tamper`` (a negative control) leaves the halo terms out of the edge path. ``device``:
    where the parallel network trains (the dense one stays on the CPU)."""
    torch.manual_seed(0)
    g = pk.Grid(comm, **grid) if grid else None
    data = g.data if g else 1
    build, default = NETS[net]
    # InstanceNorm's running statistics follow each data replica's samples (as under DDP, which
    # does not merge buffers): checked without a data dimension.
    # Dropout masks come from the CPU generator, which a device's does not follow.
    dropout = 0.3 if data == 1 and device is None else 0.0
    dense = build(dropout=dropout, running=data == 1).double()
    model = pk.parallelize(copy.deepcopy(dense).to(device), g or comm, g or "spatial")
    rows = torch.arange(4).tensor_split(data)[g.coords[0] if g else 0]
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    add_halo_terms = spatial_edges.add_halo_terms
    if tamper:
        spatial_edges.add_halo_terms = lambda y, *_: y
    triples: list[Triple] = []
    try:
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(4, *(shape or default), generator=gen, dtype=torch.float64)
            x = x.requires_grad_()
            rng = torch.get_rng_state()
            out = dense(x)
            out = out if isinstance(out, tuple) else (out,)
            scale = 1 / (4 * x[0].numel())  # a mean over the samples' values: no runaway steps
            (sum(o.square().sum() for o in out) * scale).backward()
            torch.set_rng_state(rng)
            x_mine = x.detach()[rows].clone().to(device).requires_grad_()
            mine = model(x_mine)
            mine = mine if isinstance(mine, tuple) else (mine,)
            (sum(o.square().sum() for o in mine) * data * scale).backward()
            at = f"step {step}"
            for i, (o, d) in enumerate(zip(mine, out, strict=True)):
                triples.append((f"{at} output {i}", o.detach(), d.detach()[rows]))
            triples.append((f"{at} input grad", x_mine.grad / data, x.grad[rows]))
            triples += _grads(at, model, dense)
            opt_dense.step()
            opt.step()
            opt_dense.zero_grad()
            opt.zero_grad()
            now = pk.to_dense(model).state_dict()
            want = dense.state_dict()
            triples += [(f"{at} {k}", now[k].clone(), v.clone()) for k, v in want.items()]
    finally:
        spatial_edges.add_halo_terms = add_halo_terms
    return triples


def refused_grid(comm: Communicator, net: str, grid: dict) -> str:
    """The error of a grid that cannot split this network's samples, on every rank."""
    build, shape = NETS[net]
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(build().double(), g, g)
    try:
        model(torch.randn(2, *shape, dtype=torch.float64))
    except ValueError as e:
        return str(e)
    return "no error"
