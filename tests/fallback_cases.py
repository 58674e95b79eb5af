"""Rank-side cases for ``fallback="gather"``: a hybrid network whose attention and
space-to-depth modules the spatial rules refuse, trained against the dense model.

``Hybrid`` has what real hybrids have: global self-attention over the H x W tokens (a flatten
that merges H and W, a BatchNorm inside, a 1x1 convolution that was swapped for a spatial
one), a space-to-depth step (``F.pixel_unshuffle``, which has no rule) and dropout before
them, whose masks must not be drawn twice when a forward starts again.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.spatial import fallback as spatial_fallback

from network_cases import Triple, _grads


class TokenMixer(nn.Module):
    """Causal linear attention over the H x W tokens of a feature map in raster order, with a
    residual: each token reads the running sums of the tokens before it (a scan across split
    tokens has no rule: the module is refused)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.BatchNorm2d(c), nn.Conv2d(c, 3 * c, 1), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).flatten(2).chunk(3, dim=1)  # (N, C, HW) each
        kv = (k.sigmoid() * v).cumsum(2)  # (N, C, HW): the sums over the tokens so far
        y = self.proj((q.sigmoid() * kv / (h * w)).transpose(1, 2))  # (N, HW, C)
        return x + y.transpose(1, 2).reshape(n, c, h, w)


class SpaceToDepth(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(x, 2)


class Hybrid(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(dropout)
        )
        self.mixer = TokenMixer(8)
        self.down = SpaceToDepth()
        self.body = nn.Sequential(nn.Conv2d(32, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.down(self.mixer(self.stem(x))))
        return self.head(x.mean((2, 3)))


class WindowMixer(nn.Module):
    """Attention inside ``p`` x ``p`` windows, as Swin's and MaxViT's: its forward asserts that
    the window divides the height and width it reads (the whole samples', on blocks too)."""

    def __init__(self, c: int, p: int = 4) -> None:
        super().__init__()
        self.qkv, self.p = nn.Conv2d(c, 3 * c, 1), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (n, c, h, w), p = x.shape, self.p
        assert h % p == 0 and w % p == 0, f"height ({h}) must be divisible by window ({p})"

        def windows(t: torch.Tensor) -> torch.Tensor:  # (N * windows, p * p, C)
            t = t.view(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
            return t.reshape(-1, p * p, c)

        q, k, v = self.qkv(x).chunk(3, dim=1)
        attn = (windows(q) @ windows(k).transpose(1, 2)).softmax(-1)
        y = (attn @ windows(v)).view(n, h // p, w // p, p, p, c)
        return x + y.permute(0, 5, 1, 3, 2, 4).reshape(n, c, h, w)


class WindowNet(nn.Module):
    def __init__(self, dropout: float = 0.0, p: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.mixer = WindowMixer(4, p)
        self.head = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.stem(x)))


class Partition(nn.Module):
    """MaxViT's window partition: (N, C, H, W) -> (N, windows, P * P, C), a 4-D tensor that is
    not an image, though it may have an image's shape."""

    def forward(self, x: torch.Tensor, p: int) -> torch.Tensor:
        n, c, h, w = x.shape
        x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(n, (h // p) * (w // p), p * p, c)


class Departition(nn.Module):
    """Its inverse, to a window grid fixed when the network was built (the whole image's): on
    a block, torch itself rejects the reshape."""

    def forward(self, x: torch.Tensor, p: int, gh: int, gw: int) -> torch.Tensor:
        n, _, _, c = x.shape
        return x.reshape(n, gh, gw, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(n, c, gh * p, gw * p)


class PartitionMixer(nn.Module):
    def __init__(self, c: int, size: tuple[int, int], p: int) -> None:
        super().__init__()
        self.partition, self.mix, self.departition = Partition(), nn.Linear(c, c), Departition()
        self.p, self.grid = p, (size[0] // p, size[1] // p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partition(x, self.p)
        return x + self.departition(y + self.mix(y), self.p, *self.grid)


class PartitionNet(nn.Module):
    """4 channels, 4 x 4 images, 2 x 2 windows: the partitioned tensor (N, 4 windows, 4, 4
    channels) has the image's very shape, so no shape tells the two apart (torchvision's
    MaxViT on small images)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.mixer = PartitionMixer(4, (4, 4), 2)
        self.head = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.stem(x)))


# name -> (network, input shape without the batch)
NETS = {
    "hybrid": (Hybrid, (3, 12, 10)),
    "windows": (WindowNet, (3, 16, 12)),
    "windows of 5": (lambda: WindowNet(p=5), (3, 16, 12)),  # 5 does not divide 16
    "windows of 8": (lambda dropout=0.0: WindowNet(dropout, p=8), (3, 16, 16)),  # 2 along H
    "partitions": (PartitionNet, (3, 4, 4)),
}


def hybrid_parity(
    comm: Communicator, grid: dict, steps: int = 2, restore: bool = True, net: str = "hybrid"
) -> tuple[list[Triple], list[str]]:
    """The network under ``fallback="gather"`` against the dense model over SGD steps, and
    the fallback warnings raised. ``restore=False`` (a negative control) leaves the buffers
    and random generators as the abandoned first forwards left them."""
    torch.manual_seed(0)
    g = pk.Grid(comm, **grid)
    build, shape = NETS[net]
    dense = build(dropout=0.0 if g.data > 1 else 0.3).double()
    model = pk.parallelize(copy.deepcopy(dense), g, g, fallback="gather")
    rows = torch.arange(4).tensor_split(g.data)[g.coords[0]]
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    snapshot = spatial_fallback._snapshot
    if not restore:
        spatial_fallback._snapshot = lambda model: lambda: None
    triples: list[Triple] = []
    with warnings.catch_warnings(record=True) as caught, _finally(snapshot):
        warnings.simplefilter("always")
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(4, *shape, generator=gen, dtype=torch.float64).requires_grad_()
            rng = torch.get_rng_state()
            out = dense(x)
            (out.square().sum() / 4).backward()
            torch.set_rng_state(rng)
            x_mine = x.detach()[rows].clone().requires_grad_()
            out_mine = model(x_mine)
            (out_mine.square().sum() * g.data / 4).backward()
            at = f"step {step}"
            triples.append((f"{at} output", out_mine.detach(), out.detach()[rows]))
            # The loss is scaled by the data dimension for DataParallel's mean; undo it here.
            triples.append((f"{at} input grad", x_mine.grad / g.data, x.grad[rows]))
            triples += _grads(at, model, dense)
            opt_dense.step()
            opt.step()
            opt_dense.zero_grad()
            opt.zero_grad()
            now = pk.to_dense(model).state_dict()
            want = dense.state_dict()
            triples += [(f"{at} {k}", now[k].clone(), v.clone()) for k, v in want.items()]
    return triples, [str(w.message) for w in caught if "fallback='gather'" in str(w.message)]


@contextlib.contextmanager
def _finally(snapshot):  # the rank process serves later cases: put the function back
    try:
        yield
    finally:
        spatial_fallback._snapshot = snapshot


def hybrid_refused(comm: Communicator, net: str = "hybrid") -> str:
    """The refusal under the default fallback, on every rank."""
    g = pk.Grid(comm, rows=comm.size)
    build, shape = NETS[net]
    model = pk.parallelize(build().double(), g, g)
    try:
        model(torch.randn(2, *shape, dtype=torch.float64))
    except ValueError as e:
        comm.barrier()  # every rank got here: nobody waits in a collective
        return str(e)
    return "no error"
