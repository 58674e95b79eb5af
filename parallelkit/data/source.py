"""What ``data.name`` says, parsed once: a :class:`Source`.

``data.name`` is a small grammar::

    digits, synthetic, ...     a built-in set by its name (DATASETS)
    webdataset                 tar shards written by ``parallelkit data shard``
    FORMAT:DIR                 a folder read by blocks, FORMAT one of BLOCK_FORMATS
    package.module:Class       the user's own data set, by import path

It is read here alone: :func:`parse_source` turns the string (and ``data.dims``, which says
whether a block folder or the user's class gives volumes) into a frozen :class:`Source`, and
every reader asks that its questions (is it read by blocks? does it hold masks? volumes?)
instead of splitting the string again. A name that fits none of the forms is a ``ValueError``
naming the key, raised by the config's check (:func:`parallelkit.data.config.check_config`)
before any file is opened.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

DATASETS: tuple[str, ...] = (
    "digits", "synthetic", "imagefolder", "cifar10", "webdataset", "shapes", "segfolder",
    "shapes3d", "segfolder3d",
)  # fmt: skip
WITH_MASKS: tuple[str, ...] = ("shapes", "segfolder", "shapes3d", "segfolder3d")
"""Sets whose samples are (image, mask); ``webdataset`` shards may hold either."""
VOLUMES: tuple[str, ...] = ("shapes3d", "segfolder3d")
"""Sets of volumes (C, D, H, W), each ``image_size`` on a side; the others give images."""
BLOCK_FORMATS: tuple[str, ...] = ("zarr", "tiff", "nifti", "npy")
"""``data.name=FORMAT:DIR``: a folder of images and masks read by blocks (see
:mod:`parallelkit.data.blockset`): under spatial parallelism each rank reads only its block
of every sample, and nothing whole is ever held."""

Kind = Literal["set", "shards", "blocks", "class"]


@dataclass(frozen=True)
class Source:
    """Where a run's samples come from, as ``data.name`` (and ``data.dims``) say.

    ``kind``: ``set`` (a built-in set, ``name`` is its name), ``shards`` (``webdataset``),
    ``blocks`` (``FORMAT:DIR``: ``format`` and ``root`` are its two halves) or ``class`` (the
    user's data set, ``name`` its import path). ``dims``: the samples' spatial dimensions, 2
    for images, 3 for volumes.
    """

    name: str
    kind: Kind
    dims: int = 2
    format: str | None = None
    root: str | None = None

    @property
    def is_block_folder(self) -> bool:
        """Read by blocks: each rank opens only its block of every sample."""
        return self.kind == "blocks"

    @property
    def is_shards(self) -> bool:
        """Streamed from tar shards, which their manifest alone describes."""
        return self.kind == "shards"

    @property
    def is_users_class(self) -> bool:
        """The user's own data set, whose items alone say what they hold."""
        return self.kind == "class"

    @property
    def is_volume(self) -> bool:
        """Samples of (C, D, H, W) rather than images (C, H, W)."""
        return self.dims == 3

    @property
    def has_masks(self) -> bool:
        """Whether the name alone says the samples are (image, mask); shards and the user's
        class say so only when read (their manifest, their first item)."""
        return self.name in WITH_MASKS or self.is_block_folder


@functools.cache
def parse_source(name: str, dims: int = 2) -> Source:
    """``data.name`` as a :class:`Source`, ``dims`` being ``data.dims`` (read by block folders
    and the user's class alone). A one-line ``ValueError`` naming the key for a name of none of
    the forms, a block folder without its directory, or ``data.dims`` neither 2 nor 3 there.
    Cached: every reader of one config gets the same object."""
    if name in DATASETS:
        kind: Kind = "shards" if name == "webdataset" else "set"
        return Source(name, kind, dims=3 if name in VOLUMES else 2)
    head, colon, tail = name.partition(":")
    if colon and head in BLOCK_FORMATS:
        if not tail or dims not in (2, 3):
            raise ValueError(
                f"data.name={name!r} needs a directory after the colon, and data.dims "
                f"(now {dims}) 2 for images or 3 for volumes"
            )
        volume = head == "nifti" or dims == 3  # NIfTI files are volumes whatever dims says
        return Source(name, "blocks", dims=3 if volume else 2, format=head, root=tail)
    if colon and tail and "/" not in name:
        return Source(name, "class", dims=3 if dims == 3 else 2)
    raise ValueError(
        f"data.name={name!r} is not one of {', '.join(DATASETS)}, or FORMAT:DIR with "
        f"FORMAT one of {', '.join(BLOCK_FORMATS)}, or your own package.module:Class"
    )
