"""parallelkit's SyncBatchNorm in a PyTorch Lightning DDP run on CPUs.

    python examples/lightning/train.py                   # 2 processes, parallelkit SyncBatchNorm
    python examples/lightning/train.py --devices 1 --bn plain   # the 1-process reference
    python examples/lightning/train.py --bn torch        # torch.nn.SyncBatchNorm: ValueError
    python examples/lightning/train.py --bn plain        # BatchNorm2d, statistics per process

A plain Lightning script with each changed line marked ``# parallelkit:``. Lightning's own
``sync_batchnorm=True`` swaps in ``torch.nn.SyncBatchNorm``, which trains on GPUs only: on CPUs
DDP refuses to wrap it (``ValueError``), and so does its forward pass without DDP.
``parallelkit.nn.SyncBatchNorm`` works over any communicator. Lightning creates the default
torch.distributed process group before it calls ``configure_model``, and ``pk.init`` joins an
existing default group instead of creating one, so the communicator is built there, over
Lightning's own processes.

Every process reads its rows of each global batch (a ``DistributedSampler`` seeded like the
1-process run's), so with synchronized statistics the 2-process run computes what the
1-process run computes, step for step. Data: scikit-learn's 1,797 8x8 digits (no download).
"""

from __future__ import annotations

import argparse
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import parallelkit as pk
from parallelkit.nn import convert_sync_batchnorm


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): the fixed 80/20 split of examples/digits_allreduce, pixels in [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N 1 8 8
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2),  # 64 x 4 x 4
        nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


class DigitsClassifier(L.LightningModule):
    def __init__(self, data: TensorDataset, batch_size: int, lr: float, batch_norm: str) -> None:
        super().__init__()
        self.data, self.batch_size, self.lr, self.batch_norm = data, batch_size, lr, batch_norm
        self.net = cnn()

    def configure_model(self) -> None:
        # Called once the process group exists and before DDP wraps the model.
        if self.batch_norm == "parallelkit":
            backend = dist.get_backend() if dist.is_initialized() else "local"
            comm = pk.init(backend)  # parallelkit: joins Lightning's process group
            convert_sync_batchnorm(self.net, comm)  # parallelkit: statistics over all processes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        # Process r of R reads rows r, r + R, ... of each global batch of one permutation, so
        # the R processes' batches together are the 1-process batch. Lightning calls
        # set_epoch on the sampler, which reshuffles.
        size, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, size, rank, seed=0, drop_last=True)
        return DataLoader(self.data, self.batch_size // size, sampler=sampler, drop_last=True)


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """On the whole test set, in this process (eval mode: running statistics, no collectives)."""
    model.eval()
    x, y = data.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU processes per node")
    parser.add_argument("--nodes", type=int, default=1, help="e.g. under srun")
    parser.add_argument(
        "--bn",
        choices=["parallelkit", "torch", "plain"],
        default="parallelkit",
        help="parallelkit.nn.SyncBatchNorm, torch.nn.SyncBatchNorm (Lightning's "
        "sync_batchnorm=True) or plain BatchNorm2d (statistics of each process's rows)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global, over all processes")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    L.seed_everything(0, verbose=False)
    train, test = digits()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy="ddp" if args.devices * args.nodes > 1 else "auto",
        sync_batchnorm=args.bn == "torch",  # torch.nn.SyncBatchNorm
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # train_dataloader's, also on one process
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = DigitsClassifier(train, args.batch_size, args.lr, args.bn)
    start = time.perf_counter()
    trainer.fit(model)
    seconds = time.perf_counter() - start

    if trainer.is_global_zero:
        loss = trainer.callback_metrics["train_loss"].item()
        kind = type(next(m for m in model.modules() if "BatchNorm" in type(m).__name__))
        print(f"\nbatch norm layers: {kind.__module__}.{kind.__name__}")
        print("| processes | batch norm | epochs | train loss | test accuracy | time (s) |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {trainer.world_size} | {args.bn} | {args.epochs} | {loss:.4f} "
            f"| {accuracy(model, test):.2%} | {seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
