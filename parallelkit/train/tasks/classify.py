"""Classification, the default task: ResNets (or a zoo network) with cross-entropy.

Exactness across rank counts rests on two facts. The loader gives data rank ``r`` of ``D`` the
batch rows ``r, r + D, r + 2D, ...`` of the global batch, so the union of the ranks' batches
(and of their contiguous micro-batches under accumulation) is the 1-process batch. And each
rank's loss is the mean over its rows, which DataParallel averages over equal-sized ranks
into the global mean.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.data import Loader
from parallelkit.parallel import Grid
from parallelkit.train.schema import Config
from parallelkit.train.tasks.protocol import Losses, Metrics, Task, network, no_sync


class Classify(Task):
    """Cross-entropy classification; evaluation reports global loss and accuracy."""

    name = "classify"
    defaults: ClassVar[dict[str, Any]] = {
        "model.name": "resnet18", "model.width": 64,
        "data.name": "digits", "data.num_classes": 10, "data.image_size": 32,
    }  # fmt: skip
    networks = ("resnet18", "resnet34", "resnet50")
    trains = "resnet18/34/50, torchvision:NAME or timm:NAME"

    @classmethod
    def dense_networks(cls, cfg: Config, train: Loader) -> dict[str, nn.Module]:
        w = cfg.model.width
        dense = network(
            cfg, train.num_classes, train.channels, stem=cfg.model.stem,
            widths=(w, 2 * w, 4 * w, 8 * w),
        )  # fmt: skip
        return {"model": dense}

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, train: Loader) -> None:
        super().__init__(cfg, grid, device, train)
        self.model = self.add("model", self.dense_networks(cfg, train)["model"])

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> Losses:
        acc = self.cfg.train.accumulate
        total = torch.zeros((), device=self.device)
        # Contiguous micro-batches: over the ranks they are the 1-process micro-batches.
        for j, (xm, ym) in enumerate(zip(x.chunk(acc), y.chunk(acc), strict=True)):
            with no_sync(self.model, j < acc - 1), self.autocast:
                loss = F.cross_entropy(self.model(xm), ym) / acc
            loss.backward()
            total += loss.detach()
        self.update("model")
        return {"loss": total}

    @torch.no_grad()
    def evaluate(self, loader: Loader) -> Metrics:
        """Loss and accuracy over the whole test split. Each data rank holds different samples
        and every sample is on exactly one rank; the sums are reduced once over the data
        group (not the world: ranks of one model replica saw the same samples)."""
        self.model.eval()
        sums = torch.zeros(3, device=self.device)  # loss sum, correct, count
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                out = self.model(x)
            loss = F.cross_entropy(out.float(), y, reduction="sum")
            correct = (out.argmax(1) == y).sum()
            sums += torch.stack([loss, correct.to(loss.dtype), loss.new_tensor(len(y))])
        self.model.train()
        # On the device: NCCL and XLA reduce device tensors only. Float32 counts are exact
        # up to 2**24 images per evaluation.
        loss, correct, count = self.grid.data_comm.all_reduce(sums).tolist()
        return {
            "loss": loss / max(count, 1),
            "accuracy": correct / max(count, 1),
            "count": int(count),
        }

    def report(self, evals: Metrics) -> str:
        return (
            f"test loss {evals['loss']:.4f}, accuracy {100 * evals['accuracy']:.2f}% "
            f"({evals['count']} images)"
        )

    def headline(self, evals: Metrics) -> dict[str, float]:
        return {"test_acc": evals["accuracy"]} if evals else {}

    def summary(self, evals: Metrics) -> list[tuple[str, str]]:
        if not evals:
            return []
        return [
            ("test loss", f"{evals['loss']:.4f}"),
            ("test accuracy", f"{100 * evals['accuracy']:.2f}%"),
        ]
