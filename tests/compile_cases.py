"""Rank-side cases for ``torch.compile`` of a parallelized model: the graphs dynamo makes and
the compiled numbers against the eager ones (float64)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.models import resnet18


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(widths=(4, 8, 8, 8), num_classes=5).double()


def _small() -> nn.Module:
    """Convolutions, a norm and a pooled head: enough for a halo exchange to matter."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5)).double()  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 20, 20, generator=g, dtype=torch.float64),
            torch.tensor([1, 3]))  # fmt: skip


def ddp_graphs(comm: Communicator) -> int:
    """The graphs ``torch._dynamo.explain`` finds in the forward of torch's DDP of the ResNet:
    the reference count for data and channel."""
    import torch._dynamo
    import torch.distributed as dist

    x, _ = _batch()
    torch._dynamo.reset()
    ddp = nn.parallel.DistributedDataParallel(_resnet(), process_group=dist.group.WORLD)
    return torch._dynamo.explain(ddp)(x).graph_count


def compiled_against_eager(
    comm: Communicator, strategy: str, model: str = "resnet18", drop_halos: bool = False
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], int]:
    """Two SGD steps of the parallelized model, eager and compiled (aot_eager): the outputs,
    every parameter's gradient and the BatchNorm running statistics, as (label, compiled,
    eager); and the graphs dynamo made in the first compiled forward. ``drop_halos``: the
    compiled halo exchange receives zeros (a negative control)."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd  # noqa: F401 (registers aot_eager)
    from torch._dynamo.backends.registry import lookup_backend

    base = _resnet() if model == "resnet18" else _small()
    x, labels = _batch()
    eager = pk.parallelize(copy.deepcopy(base), comm, strategy)
    graphs: list[int] = []
    aot_eager = lookup_backend("aot_eager")

    def counted(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        graphs.append(len(graphs))
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    runs = {"eager": eager, "compiled": torch.compile(pk.parallelize(base, comm, strategy),
                                                      backend=counted)}  # fmt: skip
    kind = type(comm)
    exchange = kind.neighbor_exchange

    def dropped(self, send, recv):  # type: ignore[no-untyped-def]
        return [buf.zero_() for buf in exchange(self, send, recv)]

    out: dict[str, list[torch.Tensor]] = {}
    first_forward = 0
    for name, run in runs.items():
        if drop_halos and name == "compiled":
            kind.neighbor_exchange = dropped
        try:
            opt = torch.optim.SGD(run.parameters(), lr=0.1)
            got = []
            for step in range(2):
                opt.zero_grad()
                y = run(x)
                if name == "compiled" and step == 0:
                    first_forward = len(graphs)
                F.cross_entropy(y, labels).backward()
                got += [y.detach(), *(p.grad.clone() for p in run.parameters())]
                opt.step()
            got += [b.clone() for b in run.buffers() if b.is_floating_point()]
            out[name] = got
        finally:
            kind.neighbor_exchange = exchange
    pairs = zip(out["compiled"], out["eager"], strict=True)
    triples = [(f"{strategy} #{i}", c, e) for i, (c, e) in enumerate(pairs)]
    return triples, first_forward
