"""A sample that ``parallelkit predict`` predicts, and how it is read as training read it;
the prediction's folder and pyramid-level modules share them with the command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from parallelkit.data.readers import SampleReader
from parallelkit.train.config import Config


@dataclass(frozen=True)
class Sample:
    """One sample: its output name, its image and its mask (None: unscored)."""

    name: str
    image: Path
    mask: Path | None


def image_reader(cfg: Config, path: Path) -> SampleReader:
    """A sample's reader as training read it: its dimensions, ``data.layout``, ``data.level``
    and ``data.channels``."""
    data = cfg.data
    return SampleReader(path, dims_of(cfg), data.layout or None, level=data.level,
                        channels=data.channels)  # fmt: skip


def dims_of(cfg: Config) -> int:
    """Spatial dimensions of the run's samples: 3 for volumes (NIfTI, or ``data.dims=3``)."""
    return cfg.data.source.dims
