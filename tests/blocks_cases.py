"""Rank-side cases for ``spatial_input="blocks"``: every rank passes only its block of the
input, and no rank ever holds a whole sample.

``largest_tensor`` runs a network of constant width (so that a whole sample and a whole
activation have the same size) on this rank's block under a torch dispatch mode that records
the largest tensor any operation creates, forward and backward: it must stay below one whole
sample. ``Plain`` and ``PlainVolume`` hold what a segmentation network's blocks go through:
"same" and strided convolutions, BatchNorm, pooling, a transposed convolution, upsampling and
a skip connection.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.spatial import grid_of


def _plain(conv: type, bn: type, pool: type, up: type, mode: str, c: int = 4) -> nn.Module:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(conv(c, c, 3, padding=1), bn(c), nn.ReLU())
            self.down = nn.Sequential(conv(c, c, 3, stride=2, padding=1), nn.ReLU(), pool(2))
            self.up = nn.Sequential(up(c, c, 2, stride=2), nn.Upsample(scale_factor=2, mode=mode))
            self.head = conv(2 * c, c, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.a(x)
            return self.head(torch.cat([a, self.up(self.down(a))], 1))

    return Plain()


CONVS = {2: nn.Conv2d, 3: nn.Conv3d}
NETS = {
    "image": (lambda: _plain(nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.ConvTranspose2d,
                             "bilinear"), (4, 32, 24)),
    "volume": (lambda: _plain(nn.Conv3d, nn.BatchNorm3d, nn.MaxPool3d, nn.ConvTranspose3d,
                              "trilinear"), (4, 16, 16, 8)),
}  # fmt: skip


def _parallel(comm: Communicator, grid: dict, net: str, gathers: bool = False, **kw) -> tuple:
    """(dense, its parallel copy taking blocks, the process grid, the spatial grid, the sample
    shape). ``gathers``: a last 1x1 convolution kept dense (``keep_dense``), which runs on the
    gathered whole samples (a negative control)."""
    torch.manual_seed(0)
    build, shape = NETS[net]
    dense = build().double()
    if gathers:
        dense = nn.Sequential(dense, CONVS[len(shape) - 1](shape[0], shape[0], 1).double())
        kw = {**kw, "keep_dense": ["1"]}
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(
        copy.deepcopy(dense), g, g, spatial_input="blocks", spatial_output="blocks", **kw
    )
    return dense, model, g, grid_of(g.spatial_comm, g.spatial), shape


def blocks_parity(comm: Communicator, net: str, grid: dict, sized: bool) -> list:
    """Blocks in, blocks out, against the dense model on the whole batch: the output block,
    the input block's gradient, every parameter gradient and the BatchNorm statistics.
    ``sized``: the whole size given as ``spatial_size`` instead of all-gathered."""
    extra = {"spatial_size": NETS[net][1][1:]} if sized else {}
    dense, model, g, blocks, shape = _parallel(comm, grid, net, **extra)
    x = torch.randn(4, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows = torch.arange(4).tensor_split(g.data)[g.coords[0]]  # this data rank's samples
    cut = (rows, slice(None), *blocks.block(*shape[1:]))
    x = x.requires_grad_()
    y = dense(x)
    y.square().sum().backward()
    x_blk = x.detach()[cut].clone().requires_grad_()
    y_blk = model(x_blk)
    (y_blk.square().sum() * g.data).backward()  # DataParallel averages over the data ranks
    out = [("output block", y_blk.detach(), y.detach()[cut]),
           ("input block grad", x_blk.grad / g.data, x.grad[cut])]  # fmt: skip
    params = dict(dense.named_parameters())
    for name, p in pk.to_dense(model).named_parameters():
        out.append((f"{name} grad", p.grad, params[name].grad))
    state = dense.state_dict()
    out += [(k, v, state[k]) for k, v in pk.to_dense(model).state_dict().items()]
    return out


class _Largest(TorchDispatchMode):
    """The largest tensor (in elements) that any operation creates while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def largest_tensor(
    comm: Communicator, net: str, grid: dict, gathers: bool = False
) -> tuple[int, str, int]:
    """(the largest tensor this rank's forward and backward create, the operation that made
    it, one whole sample's elements), on a batch of one sample."""
    size = NETS[net][1][1:]
    _, model, _, blocks, shape = _parallel(comm, grid, net, gathers, spatial_size=size)
    sizes = [s.stop - s.start for s in blocks.block(*shape[1:])]
    x_blk = torch.randn(1, shape[0], *sizes, dtype=torch.float64, requires_grad=True)
    with _Largest() as seen:
        model(x_blk).square().sum().backward()
    return seen.largest, seen.op, math.prod(shape)


def wrong_block(comm: Communicator) -> str:
    """A block that is not this rank's part of a sample of ``spatial_size``."""
    _, model, *_ = _parallel(comm, dict(rows=comm.size), "image", spatial_size=(32, 24))
    try:
        model(torch.zeros(1, 4, 32, 24, dtype=torch.float64))
    except ValueError as e:
        return str(e)
    return "no error"
