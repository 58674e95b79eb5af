"""The activation memory of one ResNet-18 training step per rank, without allocator noise.

    python examples/spatial_large_images/activation_memory.py                 # 1 process
    torchrun --nproc-per-node 2 examples/spatial_large_images/activation_memory.py
    torchrun --nproc-per-node 4 examples/spatial_large_images/activation_memory.py

A process's peak resident set size (what ``parallelkit train`` reports on CPUs) also holds the
torch runtime, the weights and whatever the allocator keeps after a free. This counts only
the tensors that autograd saves in the forward pass for the backward pass (each storage once):
the activation memory that spatial parallelism divides over the ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import parallelkit as pk
from parallelkit import models


def saved_mib(net: torch.nn.Module, x: torch.Tensor) -> float:
    """MiB of distinct storages saved for backward by one forward pass (then backward)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(net(x), torch.zeros(len(x), dtype=torch.long))
    loss.backward()
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()

    comm = pk.init()  # gloo under torchrun, else one local process
    torch.manual_seed(0)
    net = models.create("resnet18", num_classes=10, stem="imagenet")
    if comm.size > 1:
        net = pk.parallelize(net, comm, "spatial")  # each rank: a band of rows
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    mib = comm.all_gather(torch.tensor([saved_mib(net, x)]))
    if comm.rank == 0:
        print(
            f"{comm.size} rank(s), {args.batch_size} x {args.image_size}x{args.image_size}: "
            f"saved activations per rank {mib.max():.0f} MiB (min {mib.min():.0f})"
        )


if __name__ == "__main__":
    main()
