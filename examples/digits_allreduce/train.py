"""Data-parallel training of a small CNN on scikit-learn's digits, gradients averaged by hand.

    torchrun --nproc-per-node 2 examples/digits_allreduce/train.py     # or: make run
    mpiexec -n 2 python examples/digits_allreduce/train.py

The single-device script with each changed line marked ``# parallelkit:``. It uses only the
communicator (one all-reduce of all gradients per step); DataParallel and SyncBatchNorm, which
overlap that all-reduce with backward, come with the data-parallel layer.
Data: the 1,797 8x8 digit images that install with scikit-learn (no download).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import parallelkit as pk


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); a fixed 80/20 split."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N 1 8 8
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 64 x 4 x 4
        nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    comm = pk.init()  # parallelkit: gloo under torchrun, mpi under mpiexec
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits()
    x_train, y_train = (
        x_train[comm.rank :: comm.size],
        y_train[comm.rank :: comm.size],
    )  # parallelkit: this rank's shard
    x_test, y_test = x_test[comm.rank :: comm.size], y_test[comm.rank :: comm.size]  # parallelkit
    net = model()
    for p in net.parameters():  # parallelkit: start from rank 0's weights
        p.data.copy_(comm.broadcast(p.data, src=0))
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    # Every rank takes the same number of steps (a rank with one batch fewer would wait forever).
    steps = int(
        comm.all_reduce(torch.tensor(len(y_train) // args.batch_size), "min")
    )  # parallelkit

    start = time.perf_counter()
    for epoch in range(args.epochs):
        net.train()
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss = F.cross_entropy(net(x_train[batch]), y_train[batch])
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in net.parameters()]
            flat = comm.all_reduce(torch.cat([g.flatten() for g in grads]), "mean")  # parallelkit
            for g, new in zip(
                grads, flat.split([g.numel() for g in grads]), strict=True
            ):  # parallelkit
                g.copy_(new.view_as(g))
            opt.step()
        accuracy = evaluate(net, x_test, y_test, comm)
        if comm.rank == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss.item():.4f}  test accuracy {accuracy:.2%}")
    seconds = time.perf_counter() - start

    if comm.rank == 0:
        images = args.epochs * steps * args.batch_size * comm.size
        print("\n| ranks | backend | epochs | test accuracy | time (s) | images/s |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {comm.size} | {comm.backend} | {args.epochs} | {accuracy:.2%} | {seconds:.1f} "
            f"| {images / seconds:.0f} |"
        )


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor, comm: pk.Communicator) -> float:
    """Accuracy over the whole test set: correct and total counts summed over ranks."""
    net.eval()
    correct = (net(x).argmax(1) == y).sum()
    counts = comm.all_reduce(torch.stack([correct, torch.tensor(len(y))]))  # parallelkit
    return (counts[0] / counts[1]).item()


if __name__ == "__main__":
    main()
