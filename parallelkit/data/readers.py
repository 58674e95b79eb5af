"""Block readers: this rank's block of an array on disk, without reading the rest.

    from parallelkit.data.readers import SampleReader
    sample = SampleReader("scan.ome.zarr", dims=2)        # headers only: nothing decoded yet
    sample.channels, sample.size, sample.dtype            # 3, (40000, 40000), uint8
    x = sample.read(grid.block(*sample.size))             # (C, h, w): this rank's block only

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

Channel layout. A sample is read as ``(C, *spatial)``, ``dims`` spatial dimensions (2 for
images, 3 for volumes); spatial axes keep their stored order, only the channel axis moves to
the front. A ``layout`` string names each stored axis: ``C`` channels, ``T`` an axis of size 1
that is dropped (time, an OME-Zarr ``t`` or a NIfTI 5th-dimension placeholder), any other
letter a spatial axis. Without ``layout=`` the format's own axis names decide where it has
them:

    TIFF        the series axes of tifffile: ``YX``, ``YXS`` (RGB, interleaved), ``SYX``
                (planar), ``CYX``, ``ZCYX`` (ImageJ) ...; S and C are channels
    OME-Zarr    ``multiscales[0].axes`` (type ``channel``, ``time``, ``space``); leading spatial
                axes of size 1 are dropped for 2-D samples (``tczyx`` with z = 1)
    NIfTI       ``(X, Y, Z)`` or ``(X, Y, Z, C)`` (a 4th dimension is the channels, as MONAI
                reads it; ``(X, Y, Z, 1, C)`` too): (D, H, W) = (X, Y, Z), not reoriented

and otherwise (npy, a plain zarr array, a TIFF of unnamed pages ``Q``) the number of
dimensions: ``dims`` of them are spatial with no channel; one more is a channel axis first
``(C, H, W)`` if the first axis has at most 4 entries and the last more, last ``(H, W, C)`` in
the opposite case; when both or neither are small, the end whose length is the ``channels``
expected (``data.channels``) where one alone is, and a ``ValueError`` asking for ``layout=``
otherwise.
A mask is read the same way and must have one channel (or none).

Pyramid levels. ``level`` > 0 reads a lower resolution of an OME-Zarr group or a pyramidal
(OME-)TIFF, SVS or NDPI file; a file without that level (npy, NIfTI, a plain zarr array, a TIFF
of fewer levels) is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import contextlib
import gzip
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.data.errors import DataError

Block = tuple[slice, ...]
SMALL = 4
"""At most this many entries along an axis make it a channel axis when guessing the layout."""
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

    ``axes``: the format's own name of each axis (one letter each, see the module's
    docstring), or None where the format has none. ``index`` holds a slice or an int per axis.
    Use as a context manager: it closes file handles (open one per read in each process, so
    DataLoader workers never share one).
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


@dataclass(frozen=True)
class Layout:
    """Where a stored array's channel, dropped and spatial axes are (see the module's docs)."""

    channel: int | None
    spatial: tuple[int, ...]
    dropped: tuple[int, ...] = ()

    @classmethod
    def resolve(
        cls,
        shape: Sequence[int],
        dims: int,
        axes: str | None = None,
        layout: str | None = None,
        where: str = "array",
        channels: int | None = None,
    ) -> Layout:
        """The layout given, else the format's ``axes``, else one guessed from ``shape`` (and
        the expected ``channels``, where the shape alone cannot tell)."""
        letters = layout or axes or _guess(shape, dims, where, channels)
        if len(letters) != len(shape) or letters.upper().count("C") > 1:
            raise ValueError(
                f"{where}: layout {letters!r} does not fit its shape {tuple(shape)}: give one "
                "letter per axis, at most one C (channels), T for axes of size 1 to drop"
            )
        letters = letters.upper()
        channel = letters.index("C") if "C" in letters else None
        dropped = [i for i, a in enumerate(letters) if a == "T"]
        spatial = [i for i, a in enumerate(letters) if a not in "CT"]
        while len(spatial) > dims and shape[spatial[0]] == 1 and layout is None:
            dropped.append(spatial.pop(0))  # a 2-D image stored with z = 1
        if len(spatial) != dims or any(shape[i] != 1 for i in dropped):
            raise ValueError(
                f"{where}: layout {letters!r} of shape {tuple(shape)} does not give {dims} "
                f"spatial dimensions (axes T must have size 1); pass layout= naming each axis"
            )
        return cls(channel, tuple(spatial), tuple(sorted(dropped)))

    def size(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape[i] for i in self.spatial)

    def channels(self, shape: Sequence[int]) -> int:
        return 1 if self.channel is None else shape[self.channel]

    def index(self, block: Block) -> tuple[slice | int, ...]:
        """The stored array's index of a spatial block: every channel, dropped axes at 0."""
        out: list[slice | int] = [slice(None)] * (
            len(self.spatial) + len(self.dropped) + (self.channel is not None)
        )
        for i in self.dropped:
            out[i] = 0
        for i, s in zip(self.spatial, block, strict=True):
            out[i] = s
        return tuple(out)

    def to_channels_first(self, data: np.ndarray) -> np.ndarray:
        """A read block (stored axis order, dropped axes gone) as ``(C, *spatial)``."""
        if self.channel is None:
            return data[None]
        return np.moveaxis(data, self.channel - sum(i < self.channel for i in self.dropped), 0)


class SampleReader:
    """One image or mask on disk, read as ``(C, *spatial)`` blocks; ``dims`` spatial
    dimensions (default: 3 for NIfTI, 2 otherwise), ``layout`` as in the module's docs,
    ``level`` the pyramid level of OME-Zarr and TIFF files (0: full resolution). ``channels``:
    the channel count expected (``data.channels``), which places the channel axis of an
    unnamed array where the shape alone cannot (``(12, 512, 640)``: 12 channels first).

    The file is opened once here for its header (shape, dtype, axes), and again for each
    :meth:`read` (so a reader may be handed to DataLoader workers, which cannot share one open
    file handle).
    """

    def __init__(
        self,
        path: str | Path,
        dims: int | None = None,
        layout: str | None = None,
        mask: bool = False,
        level: int = 0,
        channels: int | None = None,
    ) -> None:
        self.path, self.level = path, level
        dims = dims or (3 if format_of(path) == "nifti" else 2)
        with _naming(path, "header"), open_array(path, level) as array:
            self.shape, self.dtype, self.mode = array.shape, array.dtype, array.mode
            _check_dtype(self.dtype, mask, path)
            array.check_whole()
            self.layout = Layout.resolve(array.shape, dims, array.axes, layout, str(path), channels)
        self.size = self.layout.size(self.shape)
        self.channels = self.layout.channels(self.shape)

    def __repr__(self) -> str:
        return (
            f"SampleReader({str(self.path)!r}: {self.channels} x "
            f"{' x '.join(map(str, self.size))} {self.dtype}, {self.mode})"
        )

    def read(self, block: Block | None = None) -> np.ndarray:
        """The ``(C, *block)`` block (the whole sample when ``block`` is None)."""
        block = block or tuple(slice(0, n) for n in self.size)
        if len(block) != len(self.size) or any(
            not 0 <= s.start <= s.stop <= n or s.step not in (None, 1)
            for s, n in zip(block, self.size, strict=True)
        ):
            raise ValueError(f"{self.path}: block {block} is not inside its size {self.size}")
        with _naming(self.path, "data"), open_array(self.path, self.level) as array:
            data = array.read(self.layout.index(block))
        return self.layout.to_channels_first(np.asarray(data))


@contextlib.contextmanager
def _naming(path: str | Path, what: str) -> Iterator[None]:
    """Any failure of a reading library (a truncated file, a corrupt chunk, a file of another
    format) as one ``ValueError`` naming the file, its format and the library's message."""
    try:
        yield
    except MemoryError:
        raise
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise DataError(str(e)) from None  # ours, naming the file already
        raise DataError(f"{path}: cannot read its {what} as {format_of(path)}: {e}") from None
    except Exception as e:  # every library has its own exceptions
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"{path}: cannot read its {what} as {format_of(path)}: {type(e).__name__}: {message}"
        ) from None


def _check_dtype(dtype: np.dtype, mask: bool, path: str | Path) -> None:
    """Integers of any width and floats are read; booleans as masks only. Anything else
    (complex, object, strings, records, dates) is refused, not converted: a complex image cast
    to float would lose its imaginary part without a word."""
    if dtype.kind in "iuf" or (mask and dtype.kind == "b"):
        return
    what = "a mask" if mask else "an image"
    hint = " (store its magnitude, or its real and imaginary parts as channels)" if (
        dtype.kind == "c") else ""  # fmt: skip
    raise DataError(
        f"{path}: {dtype} data cannot be read as {what}{hint}; store integers or floats"
        + ("" if mask else " (booleans only as masks)")
    )


def _guess(shape: Sequence[int], dims: int, where: str, channels: int | None = None) -> str:
    spatial = "DHW"[3 - dims :] if dims <= 3 else "S" * dims
    if len(shape) == dims:
        return spatial
    if len(shape) == dims + 1:
        first, last = shape[0] <= SMALL, shape[-1] <= SMALL
        if first == last and channels is not None:  # the shape cannot tell: the count can
            first, last = shape[0] == channels, shape[-1] == channels
        if first != last:
            return "C" + spatial if first else spatial + "C"
        raise ValueError(
            f"{where}: cannot tell whether shape {tuple(shape)} keeps its channels first or "
            f"last: pass layout='C{spatial}' or '{spatial}C'"
        )
    raise ValueError(
        f"{where}: shape {tuple(shape)} has {len(shape)} dimensions for a sample of {dims} "
        f"spatial ones: pass layout= naming each axis (C channels, T dropped, others spatial)"
    )


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


def slab_blocks(size: Sequence[int], channels: int, max_elements: int) -> list[Block]:
    """Blocks of whole trailing dimensions, slabs along the first, each of at most
    ``max_elements`` values over its ``channels`` (one row at least): a streaming pass."""
    rows = max(1, max_elements // max(1, channels * math.prod(size[1:])))
    rest = tuple(slice(0, n) for n in size[1:])
    return [(slice(a, min(a + rows, size[0])), *rest) for a in range(0, size[0], rows)]
