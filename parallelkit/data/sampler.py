"""Which indices of a map-style dataset each data-parallel rank reads, epoch by epoch.

torch's ``DistributedSampler`` already gives every rank an equal share of a permutation seeded
by ``seed + epoch``; what it lacks, and what this subclass adds, is

- an *exact cover* for evaluation: with ``drop_last=False`` torch pads ranks by repeating
  indices, which would count those images twice in a global accuracy. Here every index goes
  to exactly one rank (rank ``r`` gets positions ``r, r + size, ...``), so ranks may differ by
  one sample;
- a *start offset* for resuming mid-epoch: ``set_epoch(epoch, start_batch)`` skips that many
  batches at the index level, so no skipped image is loaded or decoded.

The order depends only on ``(seed, epoch, rank, size)``: the number of DataLoader workers does
not change it, since the sampler runs in the main process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class RankSampler(DistributedSampler):
    """Indices of ``dataset`` for data rank ``rank`` of ``size``.

    ``drop_last=True`` (training): every rank gets ``len(dataset) // size`` indices of the
    epoch's permutation, the leftover tail dropped (torch's rule). ``drop_last=False``
    (evaluation): every index exactly once over all ranks, no padding.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        rank: int,
        size: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]  # only len() is used
            num_replicas=size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.exact = not drop_last
        if self.exact:
            self.num_samples = len(range(rank, len(dataset), size))
            self.total_size = len(dataset)
        self.batch_size = batch_size
        self.start = 0  # indices of this epoch already consumed before a resume

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Use epoch ``epoch``'s permutation, leaving out its first ``start_batch`` batches."""
        super().set_epoch(epoch)
        self.start = min(start_batch * self.batch_size, self.num_samples)

    def __iter__(self) -> Iterator[int]:
        if self.exact:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)  # as torch does
                order = torch.randperm(n, generator=g)
            else:
                order = torch.arange(n)
            indices = order[self.rank :: self.num_replicas].tolist()
        else:
            indices = list(super().__iter__())
        assert len(indices) == self.num_samples
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start
