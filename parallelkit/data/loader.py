"""``build_loader``: one data-parallel rank's batches of a split, for the training loop.

    loader = build_loader(cfg.data, "train", rank=grid.data_comm.rank,
                          size=grid.data_comm.size, batch_size=32, seed=cfg.seed)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch, start_batch=step_in_epoch if epoch == start_epoch else 0)
        for images, labels in loader: ...

``rank``/``size`` are the *data-parallel* coordinates: the ranks of one spatial or channel
group pass the same data rank and so read the same batches, which is what those layers need.

Two rules, one per value of ``drop_last`` (default: True for "train", False for "test"):

- ``drop_last=True`` (training): ``len(loader)`` is the same on every rank and every batch is
  full, computed without communication from what every rank knows (the dataset length, or the
  shard manifest). A rank with one batch more would wait forever in the gradient all-reduce.
  The epoch's order is a pure function of ``(seed, epoch)`` and the loader's geometry.
- ``drop_last=False`` (evaluation): every sample is read by exactly one rank, once, so summed
  counts give exact global metrics. The last batch of a rank may be partial and ranks may
  have one batch more or fewer, so **the evaluation loop must not run a collective over the
  data-parallel group per batch**: accumulate ``(correct, count)`` locally and all-reduce
  once after the loop. (Spatial and channel groups are fine: their ranks share a data rank
  and so have the same batches.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from parallelkit.data import userdata
from parallelkit.data.arrays import format_of
from parallelkit.data.blockset import (
    STATS_FILE,
    BlockDataset,
    cached_stats,
    file_stats,
    pairs,
    saved_stats,
    stats_key,
)
from parallelkit.data.config import DataConfig, check_config, crop_key, crop_shape
from parallelkit.data.datasets import open_dataset
from parallelkit.data.errors import CropError
from parallelkit.data.intensity import Normalizer
from parallelkit.data.readers import SampleReader
from parallelkit.data.sampler import RankSampler
from parallelkit.data.shardio import check_shards, load_split
from parallelkit.data.shardstream import ShardStream
from parallelkit.data.source import Source, parse_source
from parallelkit.geometry import BlockLayout


def block_layout(cfg: DataConfig, grid: Sequence[int], coords: Sequence[int]) -> BlockLayout:
    """The :class:`BlockLayout` of ``cfg``'s samples held by the rank at ``coords`` ``(z, row,
    col)`` of a ``(depth, rows, cols)`` spatial ``grid``: a volume's (D, H, W) split along all
    three, an image's (H, W) along rows and columns, as ``pk.spatial.scatter`` splits them. A
    depth split of images is a ``ValueError`` naming the key."""
    source = parse_source(cfg.name, cfg.dims)
    if not source.is_volume and grid[0] > 1:
        raise ValueError(
            f"parallel.depth={grid[0]} splits the D of volumes, and this data set has "
            "images (volumes: data.name=shapes3d or segfolder3d)"
        )
    return BlockLayout.of_grid(grid, coords, source.dims)


class Loader:
    """Iterable of ``(images (N, C, S, S) float32 in about [-1, 1], targets)``: ``labels (N,)
    int64``, or with ``masks`` true, ``(N, h, w)`` int64 masks (this rank's block of them when
    the loader was built with a ``block``). With ``blocks`` true (``data.name=FORMAT:DIR``)
    the images too are this rank's blocks, as ``pk.spatial.scatter`` cuts them. ``dims``: 2
    for images, 3 for volumes. ``shape``: a whole sample's spatial size, ``(H, W)`` or
    ``(D, H, W)`` (the crop, for ``FORMAT:DIR``); ``image_size`` is ``data.image_size`` as
    given (an integer, or for ``FORMAT:DIR`` possibly a list).

    ``len(loader)`` is the number of batches of a whole epoch on this rank, whatever
    ``set_epoch``'s ``start_batch`` (an epoch resumed at batch k yields ``len(loader) - k``).
    ``num_samples`` is the split's global size, over all ranks.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        batches: int,
        batch_size: int,
        num_classes: int,
        channels: int,
        image_size: int | Sequence[int],
        num_samples: int,
        masks: bool = False,
        blocks: bool = False,
        dims: int = 2,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.dataloader, self.masks, self.blocks, self.dims = dataloader, masks, blocks, dims
        self.shape = shape or (image_size,) * dims  # type: ignore[operator]
        self.batches, self.batch_size = batches, batch_size
        self.num_classes, self.channels = num_classes, channels
        self.image_size, self.num_samples = image_size, num_samples
        self.epoch, self.start_batch = 0, 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.dataloader)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate epoch ``epoch``'s order from its batch ``start_batch`` on.

        Holds until the next call. Skipping happens before any image is decoded (at the
        sampler, or by reading past shard members), and the batches yielded are exactly those
        an uninterrupted epoch yields from ``start_batch`` on.
        """
        if not 0 <= start_batch <= self.batches:
            raise ValueError(
                f"set_epoch: start_batch={start_batch} must lie in [0, {self.batches}] "
                "(the batches of one epoch on this rank)"
            )
        if epoch < 0:
            raise ValueError(f"set_epoch: epoch={epoch} must be >= 0")
        self.epoch, self.start_batch = epoch, start_batch
        source = self.dataloader.sampler if self._map_style else self.dataloader.dataset
        source.set_epoch(epoch, start_batch)  # type: ignore[attr-defined]
        if isinstance(self.dataloader.dataset, BlockDataset):  # its crops and flips
            self.dataloader.dataset.set_epoch(epoch)

    @property
    def _map_style(self) -> bool:
        return isinstance(self.dataloader.sampler, RankSampler)

    def __repr__(self) -> str:
        return (
            f"Loader({len(self)} batches of {self.batch_size}, {self.num_samples} samples, "
            f"{'x'.join(map(str, (self.channels, *self.shape)))}, {self.num_classes} classes)"
        )


def build_loader(
    cfg: DataConfig,
    split: str,
    *,
    rank: int,
    size: int,
    batch_size: int,
    seed: int = 0,
    drop_last: bool | None = None,
    shuffle_buffer: int = 512,
    block: BlockLayout | None = None,
    measure: bool = True,
) -> Loader:
    """Data rank ``rank`` of ``size``'s loader of ``split``, ``batch_size`` images per batch.

    Shuffles (``cfg.shuffle``) only the "train" split. ``shuffle_buffer`` is how many samples
    a WebDataset worker holds (compressed) to shuffle within; map-style datasets shuffle
    globally. ``block``: under spatial parallelism, this rank's :class:`BlockLayout`
    (:func:`block_layout`); sources with masks then yield only this rank's block of each mask
    (images stay whole), block folders this rank's block of the images too. Raises
    ``ValueError`` when the arguments or the data cannot work, e.g. a training split too small
    to give every rank one full batch. ``measure=False``: a block folder's headers only
    (:class:`BlockDataset`'s ``measure``), for checks that must not read the data.
    """
    source = check_config(cfg, split)
    shape = crop_shape(cfg)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"build_loader: rank={rank} must lie in [0, size={size})")
    if batch_size < 1:
        raise ValueError(f"build_loader: batch_size={batch_size} must be >= 1")
    if seed < 0:
        raise ValueError(f"build_loader: seed={seed} must be >= 0")
    drop_last = split == "train" if drop_last is None else drop_last
    shuffle = bool(cfg.shuffle) and split == "train"
    # A private generator: iterating must not draw from the global RNG (model init, dropout).
    generator = torch.Generator().manual_seed(seed)
    # The mask's slices this rank keeps; None where nothing is split (the whole mask).
    crop = block.slices(*shape) if block is not None and block.split else None
    if source.is_shards:
        shards = load_split(str(cfg.root), split)
        check_shards(shards)
        stream = ShardStream(
            shards,
            rank=rank,
            size=size,
            batch_size=batch_size,
            image_size=cfg.image_size,
            channels=cfg.channels,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            buffer=shuffle_buffer,
            window=crop,
        )
        dataloader = DataLoader(
            stream, batch_size=None, num_workers=cfg.workers, generator=generator
        )
        batches, num_samples, num_classes = len(stream), shards.num_samples, shards.num_classes
        masks = shards.masks
    else:
        if source.is_users_class:  # its items say whether they hold masks
            dataset = userdata.user_dataset(cfg, split, crop)
            masks = userdata.has_masks(dataset)
        else:
            dataset = (
                block_dataset(cfg, source, shape, split, block, seed, measure)
                if source.is_block_folder else open_dataset(cfg, split, crop)
            )  # fmt: skip
            masks = source.has_masks
        sampler = RankSampler(
            dataset,  # type: ignore[arg-type]
            rank=rank,
            size=size,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=cfg.workers,
            drop_last=drop_last,
            generator=generator,
        )
        n = sampler.num_samples
        batches = n // batch_size if drop_last else -(-n // batch_size)
        num_samples = len(dataset)  # type: ignore[arg-type]
        num_classes = int(getattr(dataset, "num_classes", cfg.num_classes))
    if drop_last and batches == 0:
        raise ValueError(
            f"build_loader: the {split} split of {cfg.name!r} has {num_samples} samples, too "
            f"few for one full batch of {batch_size} on each of {size} data-parallel ranks; "
            "lower the batch size or use more data"
        )
    return Loader(
        dataloader,
        blocks=source.is_block_folder,
        dims=source.dims,
        batches=batches,
        batch_size=batch_size,
        num_classes=num_classes,
        channels=cfg.channels,
        image_size=cfg.image_size,
        shape=shape,
        num_samples=num_samples,
        masks=masks,
    )


def block_dataset(
    cfg: DataConfig,
    source: Source,
    crop: tuple[int, ...],
    split: str,
    block: BlockLayout | None,
    seed: int,
    measure: bool = True,
) -> BlockDataset:
    """``data.name=FORMAT:DIR`` (``source``): this rank's blocks of ``crop`` sized crops
    (:func:`crop_shape`) of the folder's samples, masks too; the folder must hold that format,
    and every image ``data.channels`` channels (from the headers: nothing is decoded)."""
    try:
        data = BlockDataset(
            source.root, split, block=block, dims=source.dims, crop=crop, flip=tuple(cfg.flips),
            rotate=tuple(cfg.rotate), normalize=normalizer(cfg), num_classes=cfg.num_classes,
            seed=seed, level=cfg.level, foreground=cfg.foreground, channels=cfg.channels,
            layout=cfg.layout or None, measure=measure, crops=cfg.crops_per_sample,
        )  # fmt: skip
    except CropError as e:  # name the key that set the crop
        raise CropError(f"{crop_key(cfg)}: {e}") from e
    if (found := format_of(data.images[0].path)) != source.format:
        raise ValueError(
            f"data.name={source.name!r}: {data.images[0].path} is {found}, not {source.format}"
        )
    return data


def normalizer(cfg: DataConfig) -> Normalizer | None:
    """``data.normalize`` and its keys as a :class:`Normalizer` (None for ``none``); the
    training statistics of ``zscore`` are filled in by :class:`BlockDataset`."""
    if cfg.normalize == "none":
        return None
    window = (float(cfg.window[0]), float(cfg.window[1])) if cfg.normalize == "window" else None
    low, high = (float(p) for p in cfg.percentiles)
    return Normalizer(cfg.normalize, window=window, percentiles=(low, high))


def share_statistics(
    cfg: DataConfig, rank: int, size: int, total: Callable[[np.ndarray], np.ndarray]
) -> None:
    """The training images' channel statistics (``data.normalize=zscore`` of a block folder),
    computed once over ``size`` ranks: rank ``rank`` streams every ``size``-th file, ``total``
    sums an array over the ranks (one all-reduce), and every rank merges the files' summaries
    in file order, the numbers :class:`BlockDataset` then finds in memory, and rank 0 keeps in
    the folder's cache. A collective: every rank calls it, and all agree first whether the
    statistics are known already (one more sum), so none waits alone. Otherwise a no-op."""
    source = parse_source(cfg.name, cfg.dims)
    if not source.is_block_folder or cfg.normalize != "zscore":
        return
    root = Path(source.root)
    readers = [SampleReader(p, source.dims, cfg.layout or None, level=cfg.level,
                            channels=cfg.channels)
               for p, _ in pairs(root, "train")]  # fmt: skip
    key = stats_key(readers)
    known = saved_stats(key, root / STATS_FILE) is not None
    if total(np.array([float(not known)]))[0] == 0:
        return

    def mine() -> np.ndarray:
        rows = np.zeros((len(readers), 1 + 2 * readers[0].channels))
        for i in range(rank, len(readers), size):
            rows[i] = file_stats(readers[i])
        return total(rows)

    cached_stats(readers, root / STATS_FILE if rank == 0 else None, compute=mine)
