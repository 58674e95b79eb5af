"""A segmentation data set read by blocks: each spatial rank reads only its block.

    root/train/images/<name>.<ext>     root/train/masks/<name>.<ext>
    root/test/images/...  (or val)     root/test/masks/...

``<ext>``: any format of :mod:`parallelkit.data.readers` (.zarr, .ome.zarr, .tif, .tiff, .nii,
.nii.gz, .npy), one sample per file (or per zarr group); a mask pairs with the image of the same
name, in any of them. A folder with the Medical Segmentation Decathlon's layout
(``imagesTr/``, ``labelsTr/`` and ``dataset.json`` listing the pairs) is read from its list
instead (:mod:`parallelkit.data.datalist`).

    grid = pk.spatial.grid_of(spatial_comm, (rows, cols))
    data = BlockDataset(root, "train", block=grid.block_layout(2), crop=(512, 512),
                        flip=(0, 1), rotate=(0, 1))
    data.set_epoch(epoch)
    image, mask = data[i]    # (C, *block) float32 and (*block) int64: this rank's block only

What every rank of a spatial group agrees on, so that their blocks tile the same sample:

- **Crops** are drawn from a generator seeded by ``(seed, epoch, index)``, never by rank: the
  same position on every rank. Outside training (``augment=False``) the crop is centred.
  With ``foreground`` > 0, that share of the crops is centred on a labelled voxel of the
  mask, also drawn from that generator (:mod:`parallelkit.data.foreground`).
- **Flips and 90° rotations** are drawn the same way. A rank's block of a flipped or rotated
  crop is another block of the sample, reversed or transposed: it reads only those rows
  (:meth:`View.source`). A rotation by an odd number of turns transposes the crop's extent in
  its plane, so a crop that is not square there reads a region of the swapped shape.
- **Normalization** (:mod:`parallelkit.data.intensity`): by default ``(x - mean[c]) / std[c]``
  with per-channel statistics of the training images, computed once by streaming slabs of
  each file (:func:`channel_stats`) and kept in ``root/channel_stats.json`` (or in memory where
  root is read-only), keyed by the files' names, shapes and modification times; or an
  intensity window, or each sample's own percentiles (computed from the whole file, the same
  on every rank), or none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from parallelkit.data import datalist, samplecache
from parallelkit.data.arrays import format_of, stem_of
from parallelkit.data.axes import Block
from parallelkit.data.errors import CropError, DataError
from parallelkit.data.foreground import MOST, centred_start, foreground_positions
from parallelkit.data.intensity import SAMPLE_STATS_FILE, Intensity, Normalizer
from parallelkit.data.readers import SampleReader, slab_blocks
from parallelkit.data.samplecache import per_sample
from parallelkit.data.segfolder import check_labels
from parallelkit.geometry import BlockLayout

Normalize = str | tuple[Sequence[float], Sequence[float]] | Normalizer | None
"""What ``BlockDataset(normalize=)`` takes: ``"stats"``, ``(mean, std)``, a Normalizer, None."""
STATS_FILE = "channel_stats.json"
FOREGROUND_FILE = "foreground.json"
_STATS: dict[str, tuple[list[float], list[float]]] = {}  # in memory, by the files' key


@dataclass(frozen=True)
class View:
    """The part of a sample that the model sees, of ``size``: the region of the sample at
    ``start`` whose axis ``axes[d]`` is the view's axis ``d``, reversed where ``flips[d]``.
    Every flip and 90° rotation of a crop is such a view."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    flips: tuple[bool, ...]
    axes: tuple[int, ...] = ()  # () for the identity

    @classmethod
    def whole(cls, size: Sequence[int]) -> View:
        return cls((0,) * len(size), tuple(size), (False,) * len(size))

    @property
    def order(self) -> tuple[int, ...]:
        """The sample's axis that each axis of the view shows."""
        return self.axes or tuple(range(len(self.size)))

    def source(self, block: Block) -> Block:
        """The sample's rows that ``block`` of this view shows, in the sample's axis order:
        rows ``[a, b)`` of a view axis of length ``n`` showing the sample's axis ``s`` are
        ``[start[s] + a, start[s] + b)``, or ``[start[s] + n - b, start[s] + n - a)`` if flipped."""
        out = [slice(0)] * len(block)
        for s, axis, n, flip in zip(block, self.order, self.size, self.flips, strict=True):
            a, b = (n - s.stop, n - s.start) if flip else (s.start, s.stop)
            out[axis] = slice(self.start[axis] + a, self.start[axis] + b)
        return tuple(out)

    def read(self, reader: SampleReader, block: Block) -> np.ndarray:
        """``block`` of this view of ``reader``'s sample, ``(C, *block)``."""
        data = reader.read(self.source(block))
        if self.axes:
            data = data.transpose(0, *(1 + a for a in self.axes))
        flipped = tuple(1 + d for d, flip in enumerate(self.flips) if flip)
        return np.flip(data, flipped) if flipped else data


def extent(crop: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The region a view of ``crop`` whose axis ``d`` shows the sample's axis ``axes[d]``
    reads, in the sample's axis order (a crop turned an odd number of quarter turns reads its
    extent in the plane swapped)."""
    out = list(crop)
    for d, axis in enumerate(axes):
        out[axis] = crop[d]
    return tuple(out)


def turned(dims: int, plane: Sequence[int], turns: int) -> tuple[tuple[int, ...], set[int]]:
    """``np.rot90(x, turns, plane)`` as a view: the sample's axis that each axis shows, and the
    view's axes that are reversed."""
    a, b = plane
    axes = list(range(dims))
    if turns % 2:
        axes[a], axes[b] = b, a
    reversed_ = {0: set(), 1: {a}, 2: {a, b}, 3: {b}}[turns % 4]
    return tuple(axes), reversed_


def draw_view(
    size: Sequence[int],
    crop: Sequence[int] | None,
    flip: Sequence[int],
    rng: np.random.Generator | None,
    centre: int | None = None,
    rotate: Sequence[int] = (),
) -> View:
    """A crop of ``crop`` (the whole sample if None), flipped along each axis of ``flip`` with
    probability 1/2, then turned by 0-3 quarter turns in the plane of the two axes of
    ``rotate``: drawn from ``rng``, or centred, unflipped and unturned if ``rng`` is None.
    ``centre``: the flat index of a voxel to centre the crop on (the flips are still drawn)."""
    size = tuple(size)
    crop = size if crop is None else tuple(int(c) for c in crop)
    if len(crop) != len(size) or any(not 0 < c <= n for c, n in zip(crop, size, strict=True)):
        raise CropError(f"crop {crop} does not fit in samples of size {size}")
    if rng is None:
        return View(
            tuple((n - c) // 2 for n, c in zip(size, crop, strict=True)), crop, (False,) * len(size)
        )
    axes, reversed_ = turned(len(size), rotate, int(rng.integers(0, 4))) if rotate else ((), set())
    region = extent(crop, axes)
    if any(e > n for e, n in zip(region, size, strict=True)):
        raise CropError(
            f"crop {crop} turned in the plane of axes {tuple(rotate)} is {region}, which "
            f"does not fit in a sample of size {size}"
        )
    if centre is not None:
        start = centred_start(centre, size, region)
    else:
        start = tuple(int(rng.integers(0, n - e + 1)) for n, e in zip(size, region, strict=True))
    flips = tuple((bool(rng.integers(0, 2)) if d in flip else False) != (d in reversed_)
                  for d in range(len(size)))  # fmt: skip
    return View(start, crop, flips, axes if axes != tuple(range(len(size))) else ())


def channel_stats(
    readers: Sequence[SampleReader],
    max_elements: int = 1 << 22,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and (population) standard deviation over every value of every
    sample, streaming: slabs of at most ``max_elements`` values, merged by count (Chan)."""
    return merge_stats(np.stack([file_stats(r, max_elements) for r in readers]))


def file_stats(reader: SampleReader, max_elements: int = 1 << 22) -> np.ndarray:
    """``[n, mean (C), M2 (C)]`` of one sample's values per channel, float64, streaming."""
    count, mean, m2 = 0, np.zeros(reader.channels), np.zeros(reader.channels)
    for block in slab_blocks(reader.size, reader.channels, max_elements):
        x = reader.read(block).reshape(reader.channels, -1).astype(np.float64)
        if x.shape[1]:
            m = x.mean(1)
            count, mean, m2 = _chan(count, mean, m2, x.shape[1], m, ((x - m[:, None]) ** 2).sum(1))
    return np.concatenate([[count], mean, m2])


def merge_stats(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std from :func:`file_stats` rows ``(files, 1 + 2C)``, merged in file order."""
    c = (rows.shape[1] - 1) // 2
    count, mean, m2 = 0, np.zeros(c), np.zeros(c)
    for row in rows:
        count, mean, m2 = _chan(count, mean, m2, int(row[0]), row[1 : 1 + c], row[1 + c :])
    if count == 0:
        raise ValueError("channel_stats: no values to average")
    return mean, np.sqrt(m2 / count)


def _chan(count, mean, m2, n, mean_n, m2_n):
    """Chan et al.'s merge of two (count, mean, M2) summaries."""
    if n == 0:
        return count, mean, m2
    delta, total = mean_n - mean, count + n
    return total, mean + delta * (n / total), m2 + m2_n + delta**2 * (count * n / total)


def stats_key(readers: Sequence[SampleReader]) -> str:
    """What the statistics of ``readers`` depend on: the files' names, shapes, types, times."""
    files = [[str(r.path), list(r.shape), str(r.dtype), os.stat(r.path).st_mtime_ns]
             for r in readers]  # fmt: skip
    return hashlib.sha1(json.dumps(files).encode()).hexdigest()


def cached_stats(
    readers: Sequence[SampleReader],
    cache: Path | None,
    max_elements: int = 1 << 22,
    compute: Callable[[], np.ndarray] | None = None,
) -> tuple[list[float], list[float]]:
    """:func:`channel_stats`, computed once: kept in memory and in the JSON file ``cache``.
    ``compute``: the :func:`file_stats` rows of ``readers``, found another way, and always
    called (shared out over ranks that agreed to:
    :func:`~parallelkit.data.loader.share_statistics`)."""
    key = stats_key(readers)
    if compute is None and (known := saved_stats(key, cache)) is not None:
        return known
    rows = compute() if compute else np.stack([file_stats(r, max_elements) for r in readers])
    mean, std = merge_stats(rows)
    _STATS[key] = mean.tolist(), std.tolist()
    if cache is not None:  # a read-only data set: the statistics stay in memory
        numbers = {"key": key, "mean": _STATS[key][0], "std": _STATS[key][1]}
        samplecache.save(cache, {**numbers, "files": len(readers)})
    return _STATS[key]


def saved_stats(key: str, cache: Path | None) -> tuple[list[float], list[float]] | None:
    """The statistics of ``key`` in memory or in the file ``cache``; None where neither has them."""
    if key not in _STATS:
        try:
            saved = json.loads(cache.read_text()) if cache is not None else {}
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") != key:
            return None
        _STATS[key] = saved["mean"], saved["std"]
    return _STATS[key]


def pairs(root: str | Path, split: str) -> list[tuple[Path, Path]]:
    """``(image, mask)`` paths of ``root/<split>``, paired by name (see the module's docs), or
    from ``root/dataset.json`` (the Decathlon's layout: :mod:`parallelkit.data.datalist`)."""
    if (listing := datalist.find(root)) is not None:
        return datalist.pairs(listing, split)
    base = Path(root)
    names = ("train",) if split == "train" else ("test", "val")
    dirs = [base / n for n in names if (base / n / "images").is_dir()]
    if not dirs:
        tried = " or ".join(str(base / n / "images") for n in names)
        raise ValueError(f"block data set: no {split} images: expected {tried}")
    images = sorted(p for p in (dirs[0] / "images").iterdir() if format_of(p))
    if not images:
        raise ValueError(f"block data set: no zarr, TIFF, NIfTI or npy samples in {dirs[0]}")
    masks = {stem_of(p): p for p in (dirs[0] / "masks").glob("*") if format_of(p)}
    if missing := [p.name for p in images if stem_of(p) not in masks]:
        other = sorted((dirs[0] / "masks").glob(f"{stem_of(missing[0])}.*"))
        raise ValueError(
            f"block data set: no mask in {dirs[0] / 'masks'} for {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + (f": {other[0].name} is there, but images read by blocks need masks in a block "
               "format too (zarr, TIFF, NIfTI or npy; e.g. tifffile.imwrite(NAME.tif, "
               "imageio.imread(NAME.png)))" if other else "")
        )
    return [(p, masks[stem_of(p)]) for p in images]


class BlockDataset(Dataset):
    """This rank's block of each image ``(C, *block)`` float32 and mask ``(*block)`` int64.

    ``block``: this rank's :class:`~parallelkit.geometry.BlockLayout` (``SpatialGrid.block_layout``;
    plain numbers, so it pickles into DataLoader workers that do not fork), which cuts each
    view; None reads whole samples. ``dims``: spatial dimensions (2,
    or 3 for volumes; default 3 for NIfTI, else 2). ``crop``: the view's size (None: whole
    samples, which must then all have the same size to be batched). ``flip``: the spatial axes
    flipped at random. ``rotate``: two spatial axes, the plane of random quarter turns (the
    crop, where it is not square there, must fit the sample turned too). ``augment``: random
    crops, flips and turns (default: on the train split only).
    ``layout`` / ``mask_layout``: see :mod:`parallelkit.data.readers`. ``normalize``:
    ``"stats"`` (the training images' per-channel mean and std), ``(mean, std)``, a
    :class:`~parallelkit.data.intensity.Normalizer` (one of mode ``zscore`` without ``mean`` gets
    the training images' statistics), or None. ``level``: the pyramid level of OME-Zarr and TIFF
    files, masks read at the same level (a mask without it is refused). ``foreground``: the
    share of augmented crops centred on a labelled voxel. ``channels``: the images' channel
    count expected, where a file's shape alone cannot tell its channel axis (readers).
    ``crops``: augmented crops drawn from each sample per epoch (the items are
    ``len(images) * crops``, item ``i`` a crop of sample ``i // crops``). ``measure=False``
    reads the headers only: no statistics, no foreground positions, nothing decoded or
    written (what a dry run checks); the samples are then not normalized.

    ``normalizer`` is the normalization used (None: none), ``intensity[i]`` sample ``i``'s;
    ``mean`` and ``std`` the per-channel statistics where it is ``zscore``, else None.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        block: BlockLayout | None = None,
        dims: int | None = None,
        crop: Sequence[int] | None = None,
        flip: Sequence[int] = (),
        augment: bool | None = None,
        layout: str | None = None,
        mask_layout: str | None = None,
        normalize: Normalize = "stats",
        num_classes: int | None = None,
        seed: int = 0,
        level: int = 0,
        foreground: float = 0.0,
        channels: int | None = None,
        measure: bool = True,
        crops: int = 1,
        rotate: Sequence[int] = (),
    ) -> None:
        found = pairs(root, split)
        dims = dims or (3 if format_of(found[0][0]) == "nifti" else 2)  # the same for masks
        self.images = [SampleReader(p, dims, layout, level=level, channels=channels)
                       for p, _ in found]  # fmt: skip
        self.masks = [SampleReader(m, dims, mask_layout, mask=True, level=level)
                      for _, m in found]  # fmt: skip
        expected = channels or self.images[0].channels  # from the headers: nothing decoded
        if wrong := [r for r in self.images if r.channels != expected]:
            first, more = wrong[0], (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
            if channels:
                raise DataError(f"data.channels={channels}, but {first.path} has "
                                f"{first.channels} channels{more}")  # fmt: skip
            raise DataError(f"{first.path} has {first.channels} channels and {found[0][0]} "
                            f"{expected}{more}: every sample needs the same channels")  # fmt: skip
        for image, mask in zip(self.images, self.masks, strict=True):
            if mask.size != image.size or mask.channels != 1:
                raise DataError(
                    f"mask {mask.path} is {mask.channels} x {mask.size} but its image "
                    f"{image.path} is {image.channels} x {image.size}: a mask has one channel "
                    "and its image's spatial size"
                )
        if rotate and (len(rotate) != 2 or len(set(rotate)) != 2
                       or not all(0 <= a < dims for a in rotate)):  # fmt: skip
            raise ValueError(f"rotate={tuple(rotate)} must name two distinct spatial axes of "
                             f"the {dims}-D samples, the plane of the turns")  # fmt: skip
        if crop is not None:  # from the headers: before any sample is read
            shapes = [tuple(crop)]
            if rotate:  # the crop turned a quarter: its extent in the sample
                shapes.append(extent(crop, turned(len(crop), rotate, 1)[0]))
            small = [r for r in self.images if len(crop) != len(r.size) or any(
                c > n for s in shapes for c, n in zip(s, r.size, strict=True))]  # fmt: skip
            if small:
                turned_ = f" or turned, {shapes[-1]}," if shapes[-1] != shapes[0] else ""
                raise CropError(
                    f"crop {tuple(crop)}{turned_} does not fit in {small[0].path}, of size "
                    f"{small[0].size} ({len(small)} of the {len(self.images)} {split} samples "
                    "are smaller): choose a crop within every sample"
                )
        self.block, self.crop, self.flip = block, crop, tuple(flip)
        self.rotate = tuple(rotate)
        self.augment = split == "train" if augment is None else augment
        self.crops = crops if self.augment else 1  # items per sample and epoch
        self.num_classes, self.seed, self.epoch = num_classes, seed, 0
        if not measure:  # headers only: no value read, nothing written (preflight)
            normalize, foreground = None, 0.0
        self.normalizer = self._normalizer(normalize, root, split, dims, layout, level)
        self.intensity: list[Intensity | None] = [None] * len(self.images)
        if self.normalizer:
            self.intensity = self.normalizer.for_samples(self.images)
        self.mean, self.std = (None, None)
        if self.normalizer is not None and self.normalizer.mode == "zscore":
            self.mean = np.asarray(self.normalizer.mean, np.float32)
            self.std = np.asarray(self.normalizer.std, np.float32)
        self.foreground, self.positions = foreground, [[] for _ in self.masks]
        if foreground > 0 and self.augment:
            self.positions = per_sample(
                self.masks, ["foreground", MOST], foreground_positions, Path(root) / FOREGROUND_FILE
            )

    def _normalizer(
        self, normalize: Normalize, root: str | Path, split: str, dims: int, layout: str | None,
        level: int,
    ) -> Normalizer | None:  # fmt: skip
        """``normalize`` as a :class:`Normalizer`, the training statistics filled in."""
        if normalize is None:
            return None
        if isinstance(normalize, tuple):
            return Normalizer("zscore", tuple(normalize[0]), tuple(normalize[1]))
        given = Normalizer() if normalize == "stats" else normalize
        assert isinstance(given, Normalizer), normalize
        if given.mode == "zscore" and given.mean is None:
            train = self.images
            if split != "train":
                c = self.images[0].channels
                train = [SampleReader(p, dims, layout, level=level, channels=c)
                         for p, _ in pairs(root, "train")]  # fmt: skip
            mean, std = cached_stats(train, Path(root) / STATS_FILE)
            given = dataclasses.replace(given, mean=tuple(mean), std=tuple(std))
        if given.mode == "percentile" and given.cache is None:
            given = dataclasses.replace(given, cache=str(Path(root) / SAMPLE_STATS_FILE))
        return given

    def __len__(self) -> int:
        return len(self.images) * self.crops

    def set_epoch(self, epoch: int) -> None:
        """Crops, flips and turns are drawn anew each epoch (the same on every rank)."""
        self.epoch = epoch

    def view(self, index: int) -> View:
        """Item ``index``'s crop, flips and turns this epoch: a function of (seed, epoch,
        index). Item ``index`` is a crop of sample ``index // crops``."""
        rng = np.random.default_rng((self.seed, self.epoch, index)) if self.augment else None
        sample = index // self.crops
        centre = None
        # Drawn only with foreground > 0: without it the crops are those drawn before it was.
        centred = rng is not None and self.foreground > 0 and rng.random() < self.foreground
        if centred and (found := self.positions[sample]) and self.crop is not None:
            centre = found[int(rng.integers(len(found)))]
        return draw_view(self.images[sample].size, self.crop, self.flip, rng, centre, self.rotate)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        view, index = self.view(index), index // self.crops  # the sample's from here
        block = (self.block.slices(*view.size) if self.block
                 else tuple(slice(0, n) for n in view.size))  # fmt: skip
        image = view.read(self.images[index], block).astype(np.float32)  # a copy: ours
        if (intensity := self.intensity[index]) is not None:  # in place
            intensity(image)
        mask = view.read(self.masks[index], block)[0]
        if mask.dtype.kind == "f" and not np.array_equal(mask, np.round(mask)):
            raise DataError(f"mask {self.masks[index].path} holds non-integer values")
        labels = torch.from_numpy(np.ascontiguousarray(mask, dtype=np.int64))
        if self.num_classes is not None:
            check_labels(labels, self.num_classes, str(self.masks[index].path))
        return torch.from_numpy(np.ascontiguousarray(image)), labels
