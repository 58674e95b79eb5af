"""A user's code that makes the start-up of ``parallelkit train`` hard, for
tests/train/ranks/test_startup.py (imported by path: ``data.name=startup_code:Hangs``; the data set
that runs threads on import is tests/scripts/threaded_dataset.py).

    Random     16 random 1x16x16 images of 10 classes (the same on every rank)
    Hangs      a data set whose constructor never returns in a rank (``RANK`` set), as a
               deadlocked library or a file system that does not answer: the launcher's own
               checks pass, the ranks hang before their first collective
    failing    a network whose constructor raises on rank 1 only (a file missing on one node)
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset


class Random(Dataset):
    """Random images of 10 classes, the same on every rank."""

    num_classes = 10

    def __init__(self, split: str, size: int = 32) -> None:
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.x = torch.rand(size, 1, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


class Hangs(Random):
    def __init__(self, split: str, size: int = 32) -> None:
        super().__init__(split, size)
        while "RANK" in os.environ:
            time.sleep(1)


def failing(in_channels: int, num_classes: int) -> nn.Module:
    if os.environ.get("RANK") == "1":
        raise ValueError("the weights file /nodes/b/init.pt is missing on this node")
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))  # fmt: skip
