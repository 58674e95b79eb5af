"""Streaming WebDataset shards: which samples each data rank and DataLoader worker reads.

The rule, computed by every rank from the manifest alone (no communication)::

    epoch order  the shards, permuted by (seed, epoch), end to end: one stream of N samples
    rank r       a contiguous range of that stream; in training (drop_last) positions
                 [r*P, (r+1)*P) with P = B*batch and B = N // (size*batch); in evaluation
                 torch.tensor_split of the N positions over the ranks
    worker w     a contiguous run of the rank's batches (tensor_split over the W workers)
    shuffling    each worker permutes its samples in blocks of ``buffer``, seeded by
                 (seed, epoch, rank, w, block)

So in training every rank yields exactly B full batches however uneven the shards are, no
sample is read by two ranks in an epoch, and the N - size*B samples left over are the tail of
that epoch's order (other samples each epoch). A rank's range is mostly whole shards; a shard
straddling two ranges is read by both, each skipping (without decoding) the other's part. With
fewer shards than ranks x workers, this splits samples instead of shards: nothing is repeated.
The order depends on (seed, epoch, size, batch size, workers, buffer), never on timing.

DataLoader workers yield whole batches and the DataLoader takes one from each worker in turn
(worker 0, 1, ..., W-1, 0, ...). Resuming at batch k therefore tells each worker how many of
its batches were already consumed, and rotates which worker plays which part so that the
round-robin restarts on the right one: the batches from k on are exactly an uninterrupted
run's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from parallelkit.data.shardio import SplitShards, decode_sample, read_samples
from parallelkit.geometry import tensor_split_sizes

Batch = tuple[torch.Tensor, torch.Tensor]
Segment = tuple[int, int, int]  # (shard index, first sample, stop sample) within that shard


def rank_range(
    total: int, rank: int, size: int, batch_size: int, drop_last: bool
) -> tuple[int, int, int]:
    """(first position, stop position, batches) of ``rank``'s part of an epoch's stream."""
    if drop_last:
        batches = total // (size * batch_size)
        per_rank = batches * batch_size
        return rank * per_rank, (rank + 1) * per_rank, batches
    sizes = tensor_split_sizes(total, size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank], -(-sizes[rank] // batch_size)


def segments(counts: Sequence[int], order: Sequence[int], start: int, stop: int) -> list[Segment]:
    """The pieces of the shards, laid end to end in ``order``, covering ``[start, stop)``."""
    pieces, pos = [], 0
    for shard in order:
        lo, hi = max(start, pos), min(stop, pos + counts[shard])
        if lo < hi:
            pieces.append((int(shard), lo - pos, hi - pos))
        pos += counts[shard]
        if pos >= stop:
            break
    return pieces


def round_robin(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(worker, batch)`` in the order a DataLoader yields them when worker w has counts[w]."""
    rounds = max(counts, default=0)
    return [(w, j) for j in range(rounds) for w in range(len(counts)) if j < counts[w]]


def resume(counts: Sequence[int], start_batch: int) -> tuple[int, list[int]]:
    """(rotation, batches already consumed per worker) to restart at output batch ``start_batch``.

    After the restart, DataLoader worker ``i`` plays worker ``(rotation + i) % W``.
    """
    workers = len(counts)
    order = round_robin(counts)
    consumed = [0] * workers
    for w, _ in order[:start_batch]:
        consumed[w] += 1
    rotation = start_batch % workers
    roles = [(rotation + i) % workers for i in range(workers)]
    left = [counts[w] - consumed[w] for w in roles]
    restarted = [(roles[i], consumed[roles[i]] + j) for i, j in round_robin(left)]
    assert restarted == order[start_batch:], "resume: round-robin rotation does not line up"
    return rotation, consumed


class ShardStream(IterableDataset):
    """One data rank's batches of a shard split; see the module docstring for the rule.

    Yields collated ``(images (N, C, S, S) float32, labels (N,) int64)`` (for shards with
    masks: ``(N, h, w)`` int64 masks, cropped to ``window`` when given); use it in a DataLoader
    with ``batch_size=None``. ``len()`` is the number of batches of a whole epoch.
    """

    def __init__(
        self,
        shards: SplitShards,
        *,
        rank: int,
        size: int,
        batch_size: int,
        image_size: int,
        channels: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        buffer: int = 512,
        window: tuple[slice, slice] | None = None,
    ) -> None:
        self.shards, self.rank, self.batch_size = shards, rank, batch_size
        self.window = window  # masks only: this rank's block of each
        self.image_size, self.channels = image_size, channels
        self.shuffle, self.seed, self.buffer = shuffle, seed, max(1, buffer)
        self.start, self.stop, self.batches = rank_range(
            shards.num_samples, rank, size, batch_size, drop_last
        )
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Read epoch ``epoch``'s order, beginning at its batch ``start_batch``."""
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.batches

    def shard_order(self) -> list[int]:
        """This epoch's shard order; the same on every rank."""
        n = len(self.shards.files)
        if not self.shuffle:
            return list(range(n))
        return np.random.default_rng([self.seed, self.epoch]).permutation(n).tolist()

    def worker_segments(self, worker: int, workers: int) -> list[Segment]:
        """The shard pieces worker ``worker`` of ``workers`` reads this epoch (before skipping)."""
        first, stop = self._worker_range(worker, workers)
        return segments(self.shards.counts, self.shard_order(), first, stop)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        counts = tensor_split_sizes(self.batches, workers)
        rotation, consumed = resume(counts, min(self.start_batch, self.batches))
        role = (rotation + me) % workers
        samples = self._samples(role, workers, skip=consumed[role] * self.batch_size)
        while True:
            raw = [s for _, s in zip(range(self.batch_size), samples, strict=False)]
            if not raw:
                return
            decoded = [
                decode_sample(s, self.shards, self.image_size, self.channels, self.window)
                for s in raw
            ]
            images = torch.stack([x for x, _ in decoded])
            if self.shards.masks:
                yield images, torch.stack([y for _, y in decoded])  # type: ignore[misc]
            else:
                yield images, torch.tensor([y for _, y in decoded], dtype=torch.int64)

    def _worker_range(self, worker: int, workers: int) -> tuple[int, int]:
        counts = tensor_split_sizes(self.batches, workers)
        first = self.start + sum(counts[:worker]) * self.batch_size
        return first, min(first + counts[worker] * self.batch_size, self.stop)

    def _samples(self, worker: int, workers: int, skip: int) -> Iterator[dict[str, Any]]:
        """The worker's raw samples in their shuffled order, the first ``skip`` left out."""
        first, stop = self._worker_range(worker, workers)
        order = self.shard_order()
        if not self.shuffle:
            yield from self._read(segments(self.shards.counts, order, first + skip, stop))
            return
        block = self.buffer
        index, drop = divmod(skip, block)  # whole blocks before the skip point are never read
        raw = self._read(segments(self.shards.counts, order, first + index * block, stop))
        while True:
            chunk = [s for _, s in zip(range(block), raw, strict=False)]
            if not chunk:
                return
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, index])
            yield from [chunk[i] for i in rng.permutation(len(chunk))][drop:]
            drop, index = 0, index + 1

    def _read(self, pieces: list[Segment]) -> Iterator[dict[str, Any]]:
        for shard, lo, hi in pieces:
            yield from read_samples(self.shards.files[shard], lo, hi)
