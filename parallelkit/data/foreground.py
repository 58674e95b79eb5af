"""Foreground oversampling (``data.foreground``): a share of the training crops centred on a
labelled voxel, as nnU-Net draws them, so that small structures in large samples are seen.

A labelled voxel is one whose mask value is neither 0 (background) nor 255 (ignored). Each
mask's labelled voxels are found once, by streaming slabs of the whole mask (two passes: count
them, then keep every s-th in C order, at most ``most``), and kept per file
(:mod:`parallelkit.data.samplecache`): a short list of flat indices, the same on every rank.
Which crops are centred, and on which of those voxels, is drawn from the sample's generator of
``(seed, epoch, index)`` (:meth:`parallelkit.data.blockset.BlockDataset.view`), never from the
rank: every rank of a sample cuts the same crop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from parallelkit.data.readers import SampleReader, slab_blocks

IGNORE = 255
MOST = 10_000
"""Labelled positions kept per sample, at most (evenly spaced in C order)."""


def foreground_positions(mask: SampleReader, most: int = MOST) -> list[int]:
    """Flat (C-order) indices into ``mask.size`` of at most ``most`` of its labelled voxels:
    every s-th of them in C order, ``s`` the smallest step that keeps at most ``most``."""
    slabs = slab_blocks(mask.size, 1, 1 << 22)
    total = sum(int(_labelled(mask.read(b)).sum()) for b in slabs)
    step, seen, kept = max(1, math.ceil(total / most)), 0, []
    row = math.prod(mask.size[1:])
    for block in slabs:
        flat = np.flatnonzero(_labelled(mask.read(block)))
        chosen = flat[(seen + np.arange(len(flat))) % step == 0]
        kept.extend((block[0].start * row + chosen).tolist())
        seen += len(flat)
    return kept


def centred_start(position: int, size: Sequence[int], crop: Sequence[int]) -> tuple[int, ...]:
    """The start of a ``crop`` of a sample of ``size`` centred on the voxel at flat index
    ``position``, moved inside the sample where the voxel is near an edge."""
    centre = np.unravel_index(position, tuple(size))
    return tuple(min(max(int(c) - k // 2, 0), n - k)
                 for c, k, n in zip(centre, crop, size, strict=True))  # fmt: skip


def _labelled(x: np.ndarray) -> np.ndarray:
    return (x != 0) & (x != IGNORE)
