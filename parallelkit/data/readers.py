"""Block readers: this rank's block of an array on disk, without reading the rest.

    from parallelkit.data.readers import SampleReader
    sample = SampleReader("scan.ome.zarr", dims=2)        # headers only: nothing decoded yet
    sample.channels, sample.size, sample.dtype            # 3, (40000, 40000), uint8
    x = sample.read(grid.block(*sample.size))             # (C, h, w): this rank's block only

The parts, one module each: :mod:`parallelkit.data.arrays` opens the stored array of each
format (zarr and OME-Zarr, TIFF, SVS and NDPI, NIfTI, npy) at a pyramid level and reads a block
of it; :mod:`parallelkit.data.axes` says which of its axes are the channels, which spatial and
which dropped (``data.layout``); a :class:`SampleReader` puts the two together and reads
``(C, *spatial)`` blocks, naming the file in every failure. A mask is read the same way and
must have one channel (or none).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from parallelkit.data.arrays import format_of, open_array, stem_of
from parallelkit.data.axes import Block, Layout
from parallelkit.data.errors import DataError

__all__ = [  # the arrays' and axes' names that readers of samples use too
    "Block",
    "Layout",
    "SampleReader",
    "format_of",
    "open_array",
    "slab_blocks",
    "stem_of",
]


class SampleReader:
    """One image or mask on disk, read as ``(C, *spatial)`` blocks; ``dims`` spatial
    dimensions (default: 3 for NIfTI, 2 otherwise), ``layout`` as in
    :mod:`~parallelkit.data.axes`, ``level`` the pyramid level of OME-Zarr and TIFF files (0:
    full resolution). ``channels``: the channel count expected (``data.channels``), which
    places the channel axis of an unnamed array where the shape alone cannot
    (``(12, 512, 640)``: 12 channels first).

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


def slab_blocks(size: Sequence[int], channels: int, max_elements: int) -> list[Block]:
    """Blocks of whole trailing dimensions, slabs along the first, each of at most
    ``max_elements`` values over its ``channels`` (one row at least): a streaming pass."""
    rows = max(1, max_elements // max(1, channels * math.prod(size[1:])))
    rest = tuple(slice(0, n) for n in size[1:])
    return [(slice(a, min(a + rows, size[0])), *rest) for a in range(0, size[0], rows)]
