"""NIfTI and npy predictions: uncompressed files that every rank maps and writes its block into.

    NAME.nii                    the class map, uint8, (X, Y, Z) (or the sample's 2 axes)
    NAME_probabilities.nii      the softmax as a vector image: (X, Y, Z, 1, K), intent code
                                ``vector`` (1007), the classes along the 5th dimension, no
                                time unit: viewers (3D Slicer, ITK-SNAP, nibabel) show K
                                components of one volume, not K time frames
    NAME.nii.gz, ...            ``predict.format=nifti.gz``: the same files, gzipped by rank 0
                                once every block is written (:func:`compress`)
    NAME.npy, NAME_probabilities.npy      ``(*spatial)`` uint8 and ``(K, *spatial)``

A NIfTI prediction of a NIfTI input keeps its geometry whole: the affine, the qform and the
sform each with its own code (an input ``sform_code`` 2, aligned, stays 2; a ``qform_code``
0 stays 0), the voxel sizes and the spatial unit. Of any other input with a known pixel size
(:mod:`parallelkit.data.physical`), the affine is that scale.

Why uncompressed while ranks write. Each rank writes its block's bytes at their offsets into
one file (memory-mapped); a gzip stream has no offsets to write at. So a ``.nii.gz`` is made
after the fact: the ranks write the uncompressed file under its temporary name, and rank 0
compresses the finished file into a second temporary name and renames that into place. Rank
0 alone does that pass (reading the file once, streaming it through gzip at level 1, as
nibabel writes): its time grows with the file and is not shared over the ranks.
"""

from __future__ import annotations

import gzip
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

Block = tuple[slice, ...]
NIFTI_OFFSET = 352
"""A single-file NIfTI-1's header (348 bytes) and its empty extension flag (4 bytes)."""
NIFTI_UNITS = {"micrometer": "micron", "millimeter": "mm", "meter": "meter"}


def probability_shape(size: tuple[int, ...], classes: int) -> tuple[int, ...]:
    """A vector image's shape: the spatial axes padded to 3, a time axis of 1, then K."""
    return (*size, *(1,) * (3 - len(size)), 1, classes)


def create_nifti(path: Path, shape: tuple[int, ...], dtype: str, reference: Any,
                 vector: bool = False) -> None:
    """An uncompressed, zero-filled NIfTI-1 of ``shape`` whose data start at
    :data:`NIFTI_OFFSET`, with the geometry of ``reference`` (the module's docstring);
    ``vector``: the softmax's intent and axes."""
    import nibabel as nib

    from parallelkit.data.arrays import format_of
    from parallelkit.data.physical import geometry

    header = nib.Nifti1Header()
    affine, qform, sform, codes, units = np.eye(4), None, None, (1, 1), ("unknown", "unknown")
    if reference is not None and format_of(reference.path) == "nifti":
        source = nib.load(str(reference.path))
        affine = source.affine
        (qform, qcode), (sform, scode) = (source.header.get_qform(coded=True),
                                          source.header.get_sform(coded=True))  # fmt: skip
        codes = (int(qcode), int(scode))
        units = (source.header.get_xyzt_units()[0], "unknown")
    elif reference is not None and (g := geometry(reference)).known and len(g.scale) <= 3:
        affine = np.diag([*g.scale, *(1.0,) * (3 - len(g.scale)), 1.0])
        units = (NIFTI_UNITS.get(g.units[0] or "", "unknown"), "unknown")
    header.set_data_shape(shape)
    header.set_data_dtype(np.dtype(dtype))
    header.set_qform(qform if qform is not None else affine, code=codes[0])
    header.set_sform(sform if sform is not None else affine, code=codes[1])
    header.set_xyzt_units(*units)  # no time unit: a 4th or 5th axis is no time
    if vector:
        header.set_intent("vector")
    header["vox_offset"] = NIFTI_OFFSET
    header["scl_slope"], header["scl_inter"] = 1.0, 0.0
    with open(path, "wb") as f:
        header.write_to(f)
        f.write(b"\x00" * (NIFTI_OFFSET - f.tell()))
        f.truncate(NIFTI_OFFSET + math.prod(shape) * np.dtype(dtype).itemsize)


class MemmapOutput:
    """npy (C order, channels first) or NIfTI (Fortran order, channels last) files, mapped;
    ``paths``: the softmax's first where there is one, the class map last."""

    chunks = None
    levels = 1

    def __init__(self, fmt: str, paths: list[Path]) -> None:
        self.fmt = fmt
        self.maps = [self._map(p) for p in paths]
        if len(self.maps) == 2 and fmt != "npy":  # (X, Y, Z, 1, K) seen as (*spatial, K)
            size = self.maps[-1].shape
            self.maps[0] = self.maps[0].reshape((*size, self.maps[0].shape[-1]), order="F")

    def _map(self, path: Path) -> np.memmap:
        if self.fmt == "npy":
            return np.load(path, mmap_mode="r+")
        import nibabel as nib

        with open(path, "rb") as f:  # by its header: a temporary name has no .nii to go by
            header = nib.Nifti1Header.from_fileobj(f)
        return np.memmap(path, dtype=header.get_data_dtype(), mode="r+", offset=NIFTI_OFFSET,
                         shape=header.get_data_shape(), order="F")

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None,
              level: int = 0) -> None:
        self.maps[-1][block] = classes
        if len(self.maps) == 2 and probabilities is not None:
            if self.fmt == "npy":
                self.maps[0][(slice(None), *block)] = probabilities
            else:  # channels last
                self.maps[0][(*block, slice(None))] = np.moveaxis(probabilities, 0, -1)
        for m in self.maps:
            m.flush()


def compress(source: Path, packing: Path, final: Path) -> None:
    """``source`` (a whole, uncompressed NIfTI) gzipped into ``packing``, flushed and renamed
    to ``final``; ``source`` removed. Rank 0, once every block is written."""
    with open(source, "rb") as f, open(packing, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) as g:
            shutil.copyfileobj(f, g, 1 << 22)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(packing, final)
    source.unlink()


__all__ = ["MemmapOutput", "compress", "create_nifti", "probability_shape"]
