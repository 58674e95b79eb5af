"""OME-Zarr predictions: the class map (and softmax) as an OME-NGFF 0.5 image, at the
input's true geometry, as a multiscale pyramid where asked.

    NAME.zarr (NAME.ome.zarr for an .ome.zarr input)        zarr format 3
        zarr.json            ome.multiscales[0]: axes (names, type, unit), one dataset per
                             level, each with its scale and translation
        0, 1, ...            the class map, uint8, (*spatial): level 0 full size, level l
                             halved l times (rounded up)
        probabilities/       with predict.probabilities: the softmax, (K, *spatial), the same
                             levels, a channel axis first

Geometry (:mod:`parallelkit.data.physical`): level 0 carries the scale and translation of the
level and region that were read (a level-1 prediction of a slide has twice level 0's pixel
size), in the input's units. Level ``l`` halves every spatial axis: its pixel size is twice
level ``l - 1``'s, and as its pixel ``i`` covers pixels ``2i`` and ``2i + 1`` of level
``l - 1``, its first pixel's centre lies half a pixel of level ``l - 1`` further on
(translation + scale / 2): every level lies over the same tissue in a viewer.

Lower levels (:func:`write_levels`) are made block-wise, as level 0 is: each rank of the
sample's group reads the part of level ``l - 1`` under its own block of level ``l`` (twice its
side), reduces it (class maps by the most frequent class, ties to the lowest; probabilities
by the mean) and writes its block; no rank holds a whole level. Windows are aligned to even
indices of the whole level, so the pyramid is the same on any grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.data.physical import Geometry
from parallelkit.inference.turns import write_in_turns

Block = tuple[slice, ...]


def level_sizes(size: Sequence[int], levels: int) -> list[tuple[int, ...]]:
    """The spatial size of each level: level 0 ``size``, each next one halved, rounded up."""
    out = [tuple(size)]
    for _ in range(levels - 1):
        out.append(tuple(-(-n // 2) for n in out[-1]))
    return out


def auto_levels(size: Sequence[int], largest: int = 2048, threshold: int = 4096) -> int:
    """``predict.levels=auto``: 2-D outputs with a side over ``threshold`` get levels down to
    a largest side of at most ``largest`` pixels (a 100,000-pixel slide: 7 levels); others
    one level."""
    side = max(size)
    if len(size) != 2 or side <= threshold:
        return 1
    return 1 + math.ceil(math.log2(side / largest))


def level_transforms(geom: Geometry, levels: int) -> list[tuple[list[float], list[float]]]:
    """(scale, translation) of each level over the spatial axes (the module's docstring)."""
    scale, shift = list(geom.scale), list(geom.translation)
    out = []
    for _ in range(levels):
        out.append((list(scale), list(shift)))
        shift = [t + s / 2 for t, s in zip(shift, scale, strict=True)]
        scale = [2 * s for s in scale]
    return out


def multiscales(name: str, geom: Geometry, levels: int, channel: bool = False) -> dict:
    """The group's ``ome`` attributes: axes with units, one dataset per level."""
    axes: list[dict[str, Any]] = [{"name": "c", "type": "channel"}] if channel else []
    for n, u in zip(geom.names, geom.units, strict=True):
        axes.append({"name": n, "type": "space", **({"unit": u} if u else {})})
    datasets = []
    for level, (scale, shift) in enumerate(level_transforms(geom, levels)):
        pre = [1.0] if channel else []
        transforms = [{"type": "scale", "scale": [*pre, *scale]}]
        if any(shift):
            transforms.append({"type": "translation", "translation": [*([0.0] if channel else []),
                                                                       *shift]})
        datasets.append({"path": str(level), "coordinateTransformations": transforms})
    return {"ome": {"version": "0.5", "multiscales": [
        {"name": name, "axes": axes, "datasets": datasets}]}}  # fmt: skip


def create(path: Path, size: tuple[int, ...], classes: int, probabilities: str | None,
           geom: Geometry, chunks: Sequence[tuple[int, ...]]) -> None:
    """An empty OME-Zarr prediction of ``len(chunks)`` levels (``chunks[l]``: level l's)."""
    import zarr

    levels = len(chunks)
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs.update(multiscales("classes", geom, levels))
    for level, (shape, c) in enumerate(zip(level_sizes(size, levels), chunks, strict=True)):
        root.create_array(str(level), shape=shape, chunks=c, dtype="uint8", fill_value=0)
    if probabilities:
        group = root.create_group("probabilities")
        group.attrs.update(multiscales("probabilities", geom, levels, channel=True))
        for level, (shape, c) in enumerate(zip(level_sizes(size, levels), chunks, strict=True)):
            group.create_array(str(level), shape=(classes, *shape), chunks=(classes, *c),
                               dtype=probabilities, fill_value=0)


class ZarrLevels:
    """The levels of a prediction made by :func:`create`, opened for reading and writing."""

    def __init__(self, path: Path) -> None:
        import zarr

        root = zarr.open_group(str(path), mode="r+")
        self.levels = len(root.attrs["ome"]["multiscales"][0]["datasets"])
        self.classes = [root[str(i)] for i in range(self.levels)]
        self.probabilities = ([root[f"probabilities/{i}"] for i in range(self.levels)]
                              if "probabilities" in root else None)  # fmt: skip

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None,
              level: int = 0) -> None:
        self.classes[level][block] = classes
        if self.probabilities is not None and probabilities is not None:
            self.probabilities[level][(slice(None), *block)] = probabilities

    def read(self, block: Block, level: int) -> tuple[np.ndarray, np.ndarray | None]:
        classes = np.asarray(self.classes[level][block])
        if self.probabilities is None:
            return classes, None
        return classes, np.asarray(self.probabilities[level][(slice(None), *block)])


def source_box(block: Block, size: Sequence[int]) -> Block:
    """The part of level ``l - 1`` (of ``size``) under ``block`` of level ``l``."""
    return tuple(slice(2 * s.start, min(2 * s.stop, n)) for s, n in zip(block, size, strict=True))


def _even(a: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """``a`` padded by repeating its last entry to even lengths along ``axes``: a window of
    one entry then counts it twice, which changes neither its mean nor its most frequent
    class."""
    pad = [(0, 0)] * a.ndim
    for d in axes:
        pad[d] = (0, a.shape[d] % 2)
    return np.pad(a, pad, mode="edge") if any(p[1] for p in pad) else a


def _windows(a: np.ndarray, first: int) -> np.ndarray:
    """``a`` (even along the axes from ``first``) as ``(..., n0, 2, n1, 2, ...)``."""
    shape = list(a.shape[:first])
    for n in a.shape[first:]:
        shape += [n // 2, 2]
    return a.reshape(shape)


def reduce_classes(classes: np.ndarray, count: int) -> np.ndarray:
    """The most frequent class of each 2 x 2 (x 2) window, ties to the lowest class."""
    ndim = classes.ndim
    w = _windows(_even(classes, range(ndim)), 0)
    sum_axes = tuple(range(1, 2 * ndim, 2))
    best = np.zeros(w.shape[0::2], np.uint8)
    votes = np.full(best.shape, -1, np.int16)
    for k in range(count):
        v = (w == k).sum(sum_axes, dtype=np.int16)
        better = v > votes
        best[better], votes[better] = k, v[better]
    return best


def reduce_probabilities(probs: np.ndarray) -> np.ndarray:
    """The mean of each 2 x 2 (x 2) window of ``(K, *spatial)`` probabilities."""
    ndim = probs.ndim - 1
    w = _windows(_even(probs, range(1, ndim + 1)), 1)
    return w.mean(tuple(range(2, 2 * ndim + 1, 2)), dtype=np.float32).astype(probs.dtype)


def write_levels(comm, blocks, size: Sequence[int], output, classes: int) -> None:
    """Levels 1, 2, ... of ``output`` from the level above, each rank its block (collective
    over the sample's spatial group ``comm``; ``blocks`` its :class:`SpatialGrid`)."""
    sizes = level_sizes(size, output.levels)
    axes = blocks.axes(len(size))
    for level in range(1, output.levels):
        comm.barrier()  # the level above is written whole
        block = blocks.block(*sizes[level])
        above, probs = output.read(source_box(block, sizes[level - 1]), level - 1)
        reduced = reduce_classes(above, classes)
        reduced_p = None if probs is None else reduce_probabilities(probs)
        write_in_turns(comm, axes, sizes[level], block, output.level(level), reduced, reduced_p)


__all__ = ["ZarrLevels", "auto_levels", "create", "level_sizes", "multiscales", "write_levels"]
