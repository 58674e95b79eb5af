"""Which tensors are blocks of split images: the record a spatial region keeps while it runs.

Inside :class:`parallelkit.spatial.region.SpatialRegion` a guard (``parallelkit.spatial.
guard``) follows every operation and records which tensors are this rank's block of
images split over the grid, and which are whole (replicated on every rank: a pooled vector,
an SE gate, a parameter). A spatial layer asks :func:`is_split` about its input: a whole input
(a 1x1 convolution on an SE block's pooled vector) runs the plain dense operation. Outside any
region a spatial layer is used directly, on blocks, and every input counts as split.

Gradients of whole tensors come in two conventions, and :func:`replicated` and :func:`summed`
follow the region's:

- *full* (outside a region, and a region made with ``shares=False``): every rank holds the
  dense gradient of a whole tensor. A whole tensor acting on blocks (a parameter, an SE gate)
  has its per-rank gradients summed where it meets them (``copy_to_group``, one blocking
  all-reduce per use), and a sum over the blocks passes the gradient through as it is.
- *shares* (``pk.parallelize``): each rank holds a share of it, and the shares add up to the
  dense gradient. A whole tensor meeting blocks needs no communication at all, and a sum over
  the blocks is an all-reduce both ways (its true adjoint). Parameters' gradients are then
  shares too, summed once after backward in DataParallel's bucketed all-reduces over the data x
  spatial group, overlapped with the rest of backward.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

import parallelkit.functional as pkf
from parallelkit.comm import Communicator


class SplitRecord(Protocol):
    shares: bool

    def is_split(self, t: torch.Tensor) -> bool: ...

    def size_of(self, t: torch.Tensor) -> tuple[int, int] | None: ...

    def batched(self, t: torch.Tensor) -> bool: ...

    def tokens(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None: ...

    def trailing(self, t: torch.Tensor) -> int: ...


_active = threading.local()


def is_split(t: torch.Tensor) -> bool:
    """Whether ``t`` is a block of split images (always, outside a spatial region)."""
    records = getattr(_active, "records", None)
    return not records or records[-1].is_split(t)


def batched(t: torch.Tensor) -> bool:
    """Whether block ``t`` holds all its spatial dimensions folded into its batch dimension
    (TNT's patches in the batch, each patch's own pixels after the channels): a layer's window
    over the dimensions after the channels then reads nothing of another rank's."""
    records = getattr(_active, "records", None)
    return bool(records) and records[-1].batched(t)


def tokens(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """For block ``t`` whose last dimension holds all its spatial dimensions (the flattened
    tokens of a map, ``x.flatten(2)``): the whole token indices of its tokens, in its order,
    and the whole token count; None otherwise (and outside a region)."""
    records = getattr(_active, "records", None)
    return records[-1].tokens(t) if records else None


def trailing(t: torch.Tensor) -> int:
    """How many dimensions follow block ``t``'s spatial ones, which come right after (N, C)
    (LambdaNet's values, (N, 1, H, W, V), for a Conv3d whose window is 1 along V); 0 for none,
    and for any other layout."""
    records = getattr(_active, "records", None)
    return records[-1].trailing(t) if records else 0


def size_of(t: torch.Tensor) -> tuple[int, int] | None:
    """The whole images' (H, W) of block ``t`` where the region's record knows it (it follows
    every block from the scattered input through the layers' geometry), else None."""
    records = getattr(_active, "records", None)
    return records[-1].size_of(t) if records else None


def shares() -> bool:
    """Whether whole tensors' gradients are per-rank shares here (see the module docstring)."""
    records = getattr(_active, "records", None)
    return bool(records) and records[-1].shares


def replicated(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """A whole tensor about to act on blocks: ``copy_to_group`` (gradient summed over the
    group), or itself where gradients are shares."""
    return t if shares() else pkf.copy_to_group(t, comm)


def summed(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The sum over the group of per-block partial sums, whole on every rank: backward passes
    the dense gradient through (``reduce_from_group``), or sums the shares (all-reduce)."""
    return pkf.all_reduce(t, comm) if shares() else pkf.reduce_from_group(t, comm)


def records() -> list[SplitRecord]:
    """The records of the regions running now on this thread, outermost first."""
    return getattr(_active, "records", [])


def push(record: SplitRecord) -> None:
    _active.records = [*getattr(_active, "records", []), record]


def pop() -> None:
    _active.records = _active.records[:-1]
