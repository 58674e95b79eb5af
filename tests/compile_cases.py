"""Rank-side cases for ``torch.compile`` of a parallelized model: the graphs dynamo makes and
the compiled numbers against the eager ones (float64)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.models import resnet18


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet18(widths=(4, 8, 8, 8), num_classes=5).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 20, 20, generator=g, dtype=torch.float64),
            torch.tensor([1, 3]))  # fmt: skip


def graph_counts(comm: Communicator, strategy: str) -> dict[str, int]:
    """Graphs ``torch._dynamo.explain`` finds in the forward of the parallelized model, and in
    torch's DDP of the same model (its reference count)."""
    import torch._dynamo
    import torch.distributed as dist

    x, _ = _batch()
    counts = {}
    models = {strategy: pk.parallelize(_base(), comm, strategy),
              "ddp": torch.nn.parallel.DistributedDataParallel(_base(), process_group=dist.group.WORLD)}  # fmt: skip  # noqa: E501
    for name, model in models.items():
        torch._dynamo.reset()
        counts[name] = torch._dynamo.explain(model)(x).graph_count
    return counts


def compiled_against_eager(comm: Communicator, strategy: str, drop_halos: bool = False,
                           ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Two SGD steps of the parallelized model, eager and compiled (aot_eager): the outputs,
    every parameter's gradient and the BatchNorm running statistics, as (label, compiled,
    eager). ``drop_halos``: the compiled halo exchange receives zeros (a negative control)."""
    import torch._dynamo

    x, labels = _batch()
    eager = pk.parallelize(_base(), comm, strategy)
    compiled = pk.parallelize(copy.deepcopy(_base()), comm, strategy)
    torch._dynamo.reset()
    runs = {"eager": eager, "compiled": torch.compile(compiled, backend="aot_eager")}
    kind = type(comm)
    exchange = kind.neighbor_exchange

    def dropped(self, send, recv):  # type: ignore[no-untyped-def]
        return [buf.zero_() for buf in exchange(self, send, recv)]

    out: dict[str, list[torch.Tensor]] = {}
    for name, model in runs.items():
        if drop_halos and name == "compiled":
            kind.neighbor_exchange = dropped
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            got = []
            for _ in range(2):
                opt.zero_grad()
                y = model(x)
                F.cross_entropy(y, labels).backward()
                got += [y.detach(), *(p.grad.clone() for p in model.parameters())]
                opt.step()
            got += [b.clone() for b in model.buffers() if b.is_floating_point()]
            out[name] = got
        finally:
            kind.neighbor_exchange = exchange
    return [(f"{strategy} #{i}", c, e)
            for i, (c, e) in enumerate(zip(out["compiled"], out["eager"], strict=True))]
