"""Rank-side cases of the GPU tier that the CPU tiers have no use for."""

from __future__ import annotations

import torch

from parallelkit.comm import Communicator

Triple = tuple[str, torch.Tensor, torch.Tensor]


def nccl_primitives(comm: Communicator) -> list[Triple]:
    """NCCL's own primitives on CUDA tensors at world size 1, past the size-1 fast paths of
    the public methods, and the host path on its gloo half."""
    dev = comm.device
    assert dev is not None and dev.type == "cuda", dev
    x = torch.arange(12.0, device=dev).view(4, 3)
    out = lambda: torch.empty_like(x)  # noqa: E731
    row = torch.tensor([7, 8])
    return [
        ("device is LOCAL_RANK's GPU", torch.tensor(dev.index), torch.tensor(0)),
        ("_all_reduce", comm._all_reduce(x, "sum", out()), x),
        ("_all_gather", comm._all_gather(x, [4], out()), x),
        ("_reduce_scatter", comm._reduce_scatter(x, [4], "max", out()), x),
        ("_broadcast", comm._broadcast(x.clone(), 0), x),
        ("_reduce", comm._reduce(x, 0, "sum", out()), x),
        ("_host_all_gather", torch.tensor(comm._host_all_gather([7, 8])), row.view(1, 2)),
    ]


def autocast_channels_last(comm: Communicator, strategy: str) -> list[Triple]:
    """A parallelized ResNet under bf16 autocast on channels_last input, then its backward.

    bf16 rounds every layer's output, and a block or a batch shard is convolved (and summed)
    in another order than the whole input, so the split model rounds differently from the
    dense one. Both bf16 outputs are returned with the float32 dense output they approximate:
    the test asks the split model's error to be of the dense model's own size.
    """
    import copy

    import torch.nn.functional as F

    import parallelkit as pk
    from parallelkit.models import resnet18

    torch.manual_seed(0)
    dev = comm.device or torch.device("cuda", 0)
    dense = resnet18(widths=(8, 8, 16, 16), num_classes=5).to(dev)
    model = pk.parallelize(copy.deepcopy(dense), comm, strategy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (4,), generator=g).to(dev)
    # The parallel model's input: the whole batch (model parallel) or this rank's rows.
    rows = slice(None)
    if strategy == "data":
        rows = torch.arange(4).tensor_split(comm.size)[comm.rank].to(dev)
    with torch.no_grad():
        exact = dense(x)[rows]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        rounded = dense(x)[rows]
        mine = model(x[rows])
    loss = F.cross_entropy(mine.float(), y[rows])
    loss.backward()  # the backward runs (its numbers are the fp32 tests' job)
    return [
        ("split model, bf16", mine.detach().float(), exact),
        ("dense model, bf16", rounded.detach().float(), exact),
    ]
