"""Where a stored array keeps its channels: the layout of its axes (``data.layout``).

A sample is read as ``(C, *spatial)``, ``dims`` spatial dimensions (2 for
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Block = tuple[slice, ...]
"""A block of a sample: one slice per spatial dimension."""
SMALL = 4
"""At most this many entries along an axis make it a channel axis when guessing the layout."""


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
