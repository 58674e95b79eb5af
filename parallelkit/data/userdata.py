"""A user's own data set by import path: ``data.name=package.module:Class``.

Why: data that fits none of the readers (a database, a simulation, an odd file format) should
not need a fork of parallelkit. The config names a map-style ``torch.utils.data.Dataset``
class (or a function returning one) by where it is imported from, as ``model.name`` does for
networks; it is called as ``Class(split=..., **data.kwargs)``, with ``split`` ``"train"`` or
``"test"``. Each item is ``(image, label)`` for classification, or ``(image, mask)`` for
segmentation: whole samples of ``data.image_size`` on a side (``data.dims=3``: volumes),
``data.channels`` channels, masks of class indices (255: ignored).

Under spatial parallelism each rank keeps only its block of every mask (the loss is computed
on blocks); the images stay whole, as with the generated and folder sources. The data ranks
take different items (:class:`~parallelkit.data.sampler.RankSampler`), so the class needs no
knowledge of ranks, and every rank must see the same items in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from parallelkit.data.config import DataConfig
from parallelkit.models import imported


class UserDataset(Dataset):
    """The user's items as float32 images and int64 labels or masks; masks cut to
    ``window`` (this rank's block; None: whole)."""

    def __init__(self, inner: Any, window: tuple[slice, ...] | None, num_classes: int) -> None:
        self.inner, self.window = inner, window
        self.num_classes = int(getattr(inner, "num_classes", num_classes))  # else data.num_classes

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        image, target = self.inner[index]
        image = torch.as_tensor(image, dtype=torch.float32)
        if isinstance(target, int) or torch.as_tensor(target).dim() == 0:
            return image, int(target)
        mask = torch.as_tensor(target, dtype=torch.int64)
        return image, mask[self.window] if self.window is not None else mask


def user_dataset(cfg: DataConfig, split: str, window: tuple[slice, ...] | None) -> UserDataset:
    """``data.name``'s class called for ``split`` with ``data.kwargs``."""
    make = imported.load(cfg.name, "data.name")
    try:
        inner = make(split=split, **dict(cfg.kwargs))
    except TypeError as e:
        raise ValueError(f"config: data.name={cfg.name} with data.kwargs={dict(cfg.kwargs)} "
                         f"for split={split!r}: {' '.join(str(e).split())}") from None  # fmt: skip
    if not hasattr(inner, "__getitem__") or not hasattr(inner, "__len__"):
        raise ValueError(f"config: data.name={cfg.name} gave a {type(inner).__name__}, not a "
                         "map-style Dataset (__getitem__ and __len__)")  # fmt: skip
    return UserDataset(inner, window, cfg.num_classes)


def has_masks(dataset: UserDataset) -> bool:
    """Whether the items are (image, mask): read from the first item."""
    return len(dataset) > 0 and isinstance(dataset[0][1], torch.Tensor)
