"""One stored array in each block format: its header, and any block of it read alone.

Formats, each read through its own library (``pip install 'parallelkit[data]'``):

    .zarr / .ome.zarr   zarr (v3 API; zarr format 2 and 3 stores): an array, or an OME-Zarr
                        image group whose level ``level`` (``multiscales[0].datasets[level]
                        .path``; 0, full resolution, by default) is read; only the chunks that
                        the block touches are decoded
    .tif / .tiff        tifffile: memory-mapped where the image data are contiguous and
    .svs / .ndpi        uncompressed (tifffile.memmap); otherwise through ``aszarr``, which
                        decodes only the tiles or strips the block touches; series 0 at level
                        ``level`` (whole-slide formats: series 0 is the baseline pyramid)
    .nii / .nii.gz      nibabel's array proxy (``img.dataobj[slices]``): only the block's bytes
                        are read (a .nii.gz stream is inflated up to the block's last byte)
    .npy                numpy.load(mmap_mode="r")

Pyramid levels. ``level`` > 0 reads a lower resolution of an OME-Zarr group or a pyramidal
(OME-)TIFF, SVS or NDPI file; a file without that level (npy, NIfTI, a plain zarr array, a TIFF
of fewer levels) is a ``ValueError`` naming the file.

Each reader gives the stored array as it is, with its own names of the axes where the format
has them; which axis holds the channels is :mod:`parallelkit.data.axes`'s to say, and a sample
read as ``(C, *spatial)`` blocks is :class:`parallelkit.data.readers.SampleReader`.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import Any

import numpy as np

EXTENSIONS = (
    ".ome.zarr",
    ".zarr",
    ".ome.tiff",
    ".ome.tif",
    ".tiff",
    ".tif",
    ".svs",
    ".ndpi",
    ".nii.gz",
    ".nii",
    ".npy",
)


def format_of(path: str | Path) -> str | None:
    """``zarr``, ``tiff``, ``nifti`` or ``npy`` by the file name's extension; None otherwise.
    Aperio ``.svs`` and Hamamatsu ``.ndpi`` slides are TIFF files that tifffile reads."""
    name = Path(path).name.lower()
    for ext, fmt in (
        (".zarr", "zarr"),
        (".tif", "tiff"),
        (".tiff", "tiff"),
        (".svs", "tiff"),
        (".ndpi", "tiff"),
        (".nii", "nifti"),
        (".nii.gz", "nifti"),
        (".npy", "npy"),
    ):
        if name.endswith(ext):
            return fmt
    return None


def stem_of(path: str | Path) -> str:
    """The sample's name: the file name less its (possibly double) extension."""
    name = Path(path).name
    for ext in EXTENSIONS:
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return Path(path).stem


class ArrayReader:
    """One stored array: ``shape`` and ``dtype`` from its header, ``read(index)`` a block.

    ``axes``: the format's own name of each axis (one letter each, see
    :mod:`parallelkit.data.axes`), or None where the format has none. ``index`` holds a slice
    or an int per axis. Use as a context manager: it closes file handles (open one per read in
    each process, so DataLoader workers never share one).
    """

    shape: tuple[int, ...]
    axes: str | None = None
    mode = "?"
    """How blocks are read: ``memmap``, ``chunks`` (only the touched chunks, tiles or strips)
    or ``proxy`` (nibabel's slicing of the file's bytes)."""

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    def read(self, index: tuple[slice | int, ...]) -> np.ndarray:
        return np.asarray(self._array[index])

    def check_whole(self) -> None:
        """Raise ``ValueError`` where the file is shorter than its header says (cut off),
        when that can be seen without reading its data; called once, with the header."""

    def close(self) -> None:
        pass

    def __enter__(self) -> ArrayReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NpyReader(ArrayReader):
    mode = "memmap"

    def __init__(self, path: str | Path, level: int = 0) -> None:
        _single_level(path, level, "an npy array")
        self._array = np.load(path, mmap_mode="r", allow_pickle=False)
        self.shape = tuple(self._array.shape)


class ZarrReader(ArrayReader):
    """A zarr array, or level ``level`` of an OME-Zarr image group (``path`` may be a zarr
    store)."""

    mode = "chunks"

    def __init__(self, path: Any, level: int = 0) -> None:
        zarr = _need("zarr")
        node = zarr.open(path, mode="r")
        if not isinstance(node, zarr.Group):
            _single_level(path, level, "a zarr array (not an OME-Zarr image group)")
        else:
            attrs = dict(node.attrs)
            scales = attrs.get("ome", {}).get("multiscales") or attrs.get("multiscales")
            if not scales:
                raise ValueError(
                    f"zarr group {path} has no OME-Zarr multiscales in its attributes (arrays "
                    f"in it: {sorted(node.array_keys())}); give the path of one array"
                )
            levels = scales[0]["datasets"]
            if level >= len(levels):
                raise ValueError(
                    f"{path}: has pyramid levels 0..{len(levels) - 1}, not level "
                    f"{level} (data.level)"
                )
            node = node[levels[level]["path"]]
            self.axes = _ome_axes(scales[0].get("axes"), node.ndim)
        self._array, self.shape = node, tuple(node.shape)


class TiffReader(ArrayReader):
    """Series 0 at level ``level`` of a TIFF file: memory-mapped, or decoded tile by tile."""

    def __init__(self, path: str | Path, level: int = 0) -> None:
        tifffile = _need("tifffile")
        self._path, self._level = path, level
        with tifffile.TiffFile(path) as tif:
            levels = tif.series[0].levels
            if level >= len(levels):
                raise ValueError(
                    f"{path}: has pyramid levels 0..{len(levels) - 1} in its "
                    f"series 0, not level {level} (data.level)"
                )
            series = levels[level]
            self.shape, self.axes = tuple(series.shape), _tiff_axes(series.axes)
        try:
            self._array = tifffile.memmap(path, mode="r", series=0, level=level)
            self.mode = "memmap"
        except ValueError:  # compressed or not contiguous: chunks (tiles or strips) on demand
            self._store = tifffile.imread(path, aszarr=True, series=0, level=level)
            self._array, self.mode = _need("zarr").open(self._store, mode="r"), "chunks"
        if tuple(self._array.shape) != self.shape:
            raise ValueError(
                f"TIFF {path}: image data {self._array.shape} is not series "
                f"0's shape {self.shape} at level {level}"
            )

    def check_whole(self) -> None:
        """Every strip or tile of the series' pages at this level ends inside the file."""
        tifffile = _need("tifffile")
        with tifffile.TiffFile(self._path) as tif:
            ends = [
                int(np.max(np.add(page.dataoffsets, page.databytecounts)))
                for page in tif.series[0].levels[self._level].pages
                if page is not None and len(page.dataoffsets)
            ]
            size = tif.filehandle.size
        if ends and max(ends) > size:
            raise ValueError(
                f"its image data run to byte {max(ends)}, past the end of the file ({size} "
                "bytes: a truncated file)"
            )

    def close(self) -> None:
        if (store := getattr(self, "_store", None)) is not None:
            store.close()


class NiftiReader(ArrayReader):
    """A NIfTI image's voxels through nibabel's array proxy (scaled by its slope/intercept)."""

    mode = "proxy"

    def __init__(self, path: str | Path, level: int = 0) -> None:
        _single_level(path, level, "a NIfTI image")
        image = _need("nibabel").load(str(path))
        self._array, self.shape = image.dataobj, tuple(image.shape)
        self._path, self._header = Path(path), image.header
        # (X, Y, Z), (X, Y, Z, C), (X, Y, Z, 1, C); anything else needs layout=
        named = {3: "XYZ", 4: "XYZC", 5: "XYZTC" if self.shape[3:4] == (1,) else None}
        self.axes = named.get(len(self.shape))

    @property
    def dtype(self) -> np.dtype:  # the scaled values' type: that of one voxel read
        return np.asarray(self._array[(0,) * len(self.shape)]).dtype

    def check_whole(self) -> None:
        """The voxels end where the header says: a ``.nii`` file's size; a ``.nii.gz``
        stream's length from its gzip trailer (the uncompressed size modulo 2^32), and where
        that differs (a stream of several gzip members, or one cut off) by inflating it. A
        truncated file is then refused with the header, not when a rank reaches its end."""
        h = self._header
        need = int(h.get_data_offset()) + math.prod(self.shape) * h.get_data_dtype().itemsize
        if not self._path.name.lower().endswith(".gz"):
            have = self._path.stat().st_size
        else:
            with self._path.open("rb") as f:
                f.seek(-4, 2)
                if int.from_bytes(f.read(4), "little") == need % 2**32:
                    return
            have = 0
            with gzip.open(self._path) as g:  # EOFError where the stream is cut off
                while chunk := g.read(1 << 22):
                    have += len(chunk)
        if have < need:
            raise ValueError(
                f"its voxels hold {have} bytes where its header asks for {need} (a truncated file)"
            )


def open_array(path: str | Path, level: int = 0) -> ArrayReader:
    """The reader of ``path``'s format (see :func:`format_of`), at pyramid level ``level``."""
    readers = {"zarr": ZarrReader, "tiff": TiffReader, "nifti": NiftiReader, "npy": NpyReader}
    fmt = format_of(path)
    if fmt is None:
        raise ValueError(f"{path}: not a block-readable file; expected one of {EXTENSIONS}")
    return readers[fmt](path, level)


def _single_level(path: Any, level: int, what: str) -> None:
    if level != 0:
        raise ValueError(f"{path}: {what} has one level, 0, not level {level} (data.level)")


def _tiff_axes(axes: str) -> str | None:
    """tifffile's series axes as layout letters: S and C channels; None with unnamed pages."""
    if any(a in "QI" for a in axes) or sum(a in "SC" for a in axes) > 1:
        return None
    return "".join("C" if a in "SC" else a for a in axes)


def _ome_axes(axes: list[Any] | None, ndim: int) -> str | None:
    """OME-Zarr's ``multiscales[0].axes`` (names, or dicts with name and type) as letters."""
    if axes is None:
        return "TCZYX" if ndim == 5 else None  # OME-Zarr 0.1 and 0.2: always t, c, z, y, x
    out = ""
    for a in axes:
        name, kind = (a, None) if isinstance(a, str) else (a.get("name", ""), a.get("type"))
        if kind == "channel" or name.lower() == "c":
            out += "C"
        elif kind == "time" or name.lower() == "t":
            out += "T"
        else:
            out += "S"
    return out if len(out) == ndim else None


def _need(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as err:
        raise ImportError(
            f"reading this format needs the {name} package: pip install 'parallelkit[data]'"
        ) from err
