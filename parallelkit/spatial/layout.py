"""Which tensors are blocks of split images: the record a spatial region keeps while it runs.

Inside :class:`parallelkit.parallel.SpatialRegion` a guard (``parallelkit.parallel.
spatial_guard``) follows every operation and records which tensors are this rank's block of
images split over the grid, and which are whole (replicated on every rank: a pooled vector,
an SE gate, a parameter). A spatial layer asks :func:`is_split` about its input: a whole input
(a 1x1 convolution on an SE block's pooled vector) runs the plain dense operation. Outside any
region a spatial layer is used directly, on blocks, and every input counts as split.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class SplitRecord(Protocol):
    def is_split(self, t: torch.Tensor) -> bool: ...


_active = threading.local()


def is_split(t: torch.Tensor) -> bool:
    """Whether ``t`` is a block of split images (always, outside a spatial region)."""
    records = getattr(_active, "records", None)
    return not records or records[-1].is_split(t)


def push(record: SplitRecord) -> None:
    _active.records = [*getattr(_active, "records", []), record]


def pop() -> None:
    _active.records = _active.records[:-1]
