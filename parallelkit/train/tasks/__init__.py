"""The tasks ``parallelkit train`` runs: classification, GAN training and segmentation.

Each is one class of the protocol in :mod:`parallelkit.train.tasks.protocol` (in
:mod:`~parallelkit.train.tasks.classify`, :mod:`~parallelkit.train.tasks.gan` and
:mod:`~parallelkit.train.tasks.segment`), registered in :data:`TASKS` under its ``train.task``
name; the loop in :mod:`parallelkit.train.loop.trainer` builds the configured one with
:func:`create` and never asks which it is. Each class also carries its name, the config
defaults that follow it and its config checks, which :mod:`parallelkit.train.config` reads.
"""

from __future__ import annotations

import torch

from parallelkit.data import Loader
from parallelkit.parallel import Grid
from parallelkit.train.schema import Config
from parallelkit.train.tasks.classify import Classify
from parallelkit.train.tasks.gan import Gan
from parallelkit.train.tasks.protocol import Task
from parallelkit.train.tasks.segment import Segment

__all__ = ["TASKS", "Classify", "Gan", "Segment", "Task", "create"]

TASKS: dict[str, type[Task]] = {t.name: t for t in (Classify, Gan, Segment)}
"""``train.task`` -> its class; a new task is one more class here."""


def create(cfg: Config, grid: Grid, device: torch.device, train: Loader) -> Task:
    """The configured task, its networks built and parallelized over ``grid``."""
    return TASKS[cfg.train.task](cfg, grid, device, train)
