"""Rank-side cases of the device tier: communicators declared for a device other than the host.

The ranks' communicators are declared for torch's lazy-tensor device (see
``parallelkit.testing``), so a host tensor handed to a data collective raises, as it would on
NCCL, while host metadata must take ``all_gather_ints``. The layer and network cases of the
other tiers run here with their parallel side on ``comm.device``; these are the collectives'
own cases, each against values computed on the host.
"""

from __future__ import annotations

import pytest
import torch

from parallelkit.comm import Communicator
from parallelkit.comm.torch_dist import TorchCommunicator
from parallelkit.geometry import tensor_split_sizes

Triple = tuple[str, torch.Tensor, torch.Tensor]


def _base(rank: int) -> torch.Tensor:
    return torch.arange(6.0).view(2, 3) + 10 * rank


def collectives(comm: Communicator) -> list[Triple]:
    """Every collective on device tensors, sizes learnt on the host path where not given."""
    dev, r, n = comm.device, comm.rank, comm.size
    total = sum(_base(k) for k in range(n))
    inplace = _base(r).to(dev)
    comm.all_reduce(inplace, out=inplace)
    mine = torch.full((2, r + 1), float(r))  # uneven along dim 1
    rows = 2 * n + 1
    big = torch.arange(float(rows)).view(-1, 1) * (r + 1)
    start, size = sum(tensor_split_sizes(rows, n)[:r]), tensor_split_sizes(rows, n)[r]
    ring = comm.neighbor_exchange(
        [((r + 1) % n, torch.full((3,), float(r), device=dev))],
        [((r - 1) % n, torch.empty(3, device=dev))],
    )[0]
    try:
        pair, order = comm.split(color=r // 2, key=-r), -1  # reversed order inside each pair
    except ValueError as e:  # a torch whose new_group has no sort_ranks refuses, on every member
        assert "sorts group ranks" in str(e), e
        pair, order = comm.split(color=r // 2, key=r), 1
    members = [k for k in range(n) if k // 2 == r // 2]
    return [
        ("all_reduce", comm.all_reduce(_base(r).to(dev)), total),
        ("all_reduce in place", inplace, total),
        (
            "all_reduce_async mean",
            comm.all_reduce_async(_base(r).to(dev), "mean").wait(),
            total / n,
        ),
        (
            "all_gather dim 1, sizes learnt",
            comm.all_gather(mine.to(dev), dim=1),
            torch.cat([torch.full((2, k + 1), float(k)) for k in range(n)], dim=1),
        ),
        (
            "reduce_scatter uneven",
            comm.reduce_scatter(big.to(dev)),
            (torch.arange(float(rows)).view(-1, 1) * sum(range(1, n + 1)))[start : start + size],
        ),
        ("broadcast", comm.broadcast(_base(r).to(dev), src=n - 1), _base(n - 1)),
        ("reduce", comm.reduce(_base(r).to(dev), dst=0), total if r == 0 else total * 0),
        ("neighbor_exchange ring", ring, torch.full((3,), float((r - 1) % n))),
        (
            "split pair",
            pair.all_gather(torch.tensor([r], device=dev)),
            torch.tensor(members[::order]),
        ),
        ("split keeps the device", torch.tensor(pair.device == comm.device), torch.tensor(True)),
        (
            "all_gather_ints",
            torch.tensor(comm.all_gather_ints([r, r * r])),
            torch.tensor([[k, k * k] for k in range(n)]),
        ),
    ]


def host_tensors_refused(comm: Communicator) -> list[str]:
    """The negative control: host tensors in data collectives raise, before communicating."""
    messages = []
    for call in (
        lambda: comm.all_reduce(torch.ones(2)),
        lambda: comm.all_gather(torch.ones(2, device=comm.device), out=torch.empty(2 * comm.size)),
        lambda: comm.neighbor_exchange([], [((comm.rank + 1) % comm.size, torch.empty(2))]),
    ):
        with pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value))
    comm.barrier()  # nobody entered a collective: the group still works
    return messages


def debug_mode(comm: Communicator) -> str:
    """Debug signatures travel on the host path; disagreeing shapes still raise everywhere."""
    assert isinstance(comm, TorchCommunicator)
    debug = TorchCommunicator(comm.group, debug=True, device=comm.device)
    r = comm.rank
    debug.all_gather(torch.ones(r + 1, 2, device=comm.device))  # agreeing calls pass
    with pytest.raises(ValueError) as info:
        debug.all_reduce(torch.ones(2 + (r == 0), device=comm.device))
    return str(info.value)
