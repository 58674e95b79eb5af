"""Trace, without running, multi-replica steps on 4 XLA CPU devices; write their collectives.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/trace_replicas.py OUT.json

``xmp.spawn`` starts one thread per device, each a replica with its own communicator. Each
replica traces every scenario (forward, backward, optimizer step) and keeps, from the HLO
of the tensors the step produces (``torch_xla._XLAC._get_xla_tensors_hlo``), the lines of
the collective operations. Nothing is executed: collectives between CPU replicas cannot run
(pytorch/xla#9089), and the script records torch_xla's execution counter to show none did.
OUT.json: {scenario: {rank: [collective lines]}, "executions": {rank: count}}. (The replicas
are threads of a process that xmp.spawn starts: each writes OUT.<rank>, the parent merges.)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.xla_multiprocessing as xmp
from torch import nn

import parallelkit as pk
from parallelkit.comm.xla import XlaCommunicator
from parallelkit.nn import SpatialParallelConv2d, SyncBatchNorm
from parallelkit.parallel import DataParallel

COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute)\(")


def collectives(tensors: list[torch.Tensor]) -> list[str]:
    """The collective operations in the graph that computes ``tensors``.

    torch_xla orders a replica's collectives by threading a token through them, so a graph
    reaches back to every earlier scenario's collectives; the token is reset after each
    scenario to keep them apart (in training, ``torch_xla.sync()`` ends the chain).
    """
    text = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
    _, context = xm._get_all_reduce_token()
    torch_xla._XLAC._set_all_reduce_token(context.device, None)
    return [line.strip() for line in text.splitlines() if COLLECTIVE.search(line)]


def _input(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return x.to(torch_xla.device()).requires_grad_()


def spatial(comm: XlaCommunicator, grid: tuple[int, int]) -> list[str]:
    """A spatial convolution's forward and backward (halo exchange, parameter-grad sums)."""
    torch.manual_seed(0)
    layer = SpatialParallelConv2d(3, 4, 3, padding=1, comm=comm, grid=grid).to(comm.device)
    x = _input(2, 3, 8, 6)
    y = layer(pk.spatial.scatter(x, comm, grid))
    y.square().sum().backward()
    return collectives([y, layer.weight.grad, layer.bias.grad, x.grad])


def sync_batchnorm(comm: XlaCommunicator) -> list[str]:
    """A SyncBatchNorm step: statistics gathered forward, two sums all-reduced backward."""
    bn = SyncBatchNorm(3, comm=comm).to(comm.device)
    x = _input(2, 3, 4, 4)
    y = bn(x)
    (y * y).sum().backward()
    return collectives([y, x.grad, bn.weight.grad, bn.running_mean, bn.running_var])


def data_parallel(comm: XlaCommunicator) -> list[str]:
    """A DataParallel training step: forward, backward (gradient all-reduce), SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    dp = DataParallel(model.to(comm.device), comm)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    dp(_input(2, 3, 6, 6)).square().sum().backward()
    opt.step()
    return collectives(list(model.parameters()))


def operations(comm: XlaCommunicator) -> list[str]:
    """The primitives once each, with uneven blocks (padded to the largest)."""
    x = torch.ones(3 if comm.rank == 0 else 2, 5, device=comm.device)
    full = torch.ones(6, 5, device=comm.device)
    return collectives([
        comm.all_reduce(full, "max"),
        comm.all_gather(x, sizes=[3, 2] if comm.size == 2 else None),
        comm.reduce_scatter(full, sizes=[4, 2]),
        comm.broadcast(full, src=1),
    ])  # fmt: skip


def dense(comm: XlaCommunicator) -> list[str]:
    """Negative control: a plain convolution, no collective."""
    conv = nn.Conv2d(3, 4, 3).to(comm.device)
    x = _input(2, 3, 6, 6)
    conv(x).sum().backward()
    return collectives([conv.weight.grad, x.grad])


def replica(index: int, out: str) -> None:
    """One replica (a thread of the process xmp.spawn starts): writes ``out.<rank>``."""
    world = pk.init("xla")
    unpinned = XlaCommunicator(pin_layout=False)  # real all-gather / reduce-scatter operations
    pairs = pk.Grid(unpinned, data=2, rows=2).spatial_comm  # groups {0,1} {2,3}
    found = {
        "spatial rows in data groups": spatial(pairs, (2, 1)),
        "spatial 2x2": spatial(world, (2, 2)),
        "sync_batchnorm world": sync_batchnorm(unpinned),
        "sync_batchnorm pairs": sync_batchnorm(pairs),
        "sync_batchnorm pinned": sync_batchnorm(world),
        "data_parallel": data_parallel(world),
        "operations pairs": operations(pairs),
        "dense": dense(world),
    }
    executed = met.metric_data("ExecuteTime")
    found["executions"] = executed[0] if executed else 0
    Path(f"{out}.{world.rank}").write_text(json.dumps(found))


if __name__ == "__main__":
    out = sys.argv[1]
    xmp.spawn(replica, args=(out,))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    merged = {name: {str(r): found[name] for r, found in enumerate(ranks)} for name in ranks[0]}
    Path(out).write_text(json.dumps(merged, indent=1))
