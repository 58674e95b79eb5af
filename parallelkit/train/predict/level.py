"""At which pixel size ``parallelkit predict`` works, and how many pyramid levels it writes.

A network learns structures at the pixel size it was trained at: a model trained at level 1
of a slide (twice the baseline's pixel size) applied at level 0 sees every nucleus twice as
large. Predict compares the pixel size of the samples it predicts (:mod:`parallelkit.data
.physical`: OME-Zarr, SVS, NDPI, OME-TIFF and NIfTI metadata) with that of the run's first
training sample at the level it trained at, or, where either has no pixel size, the pyramid
levels (``data.level``). A difference is said in one line at start (:func:`resolution_note`),
and refused before start with ``predict.strict=true``.

``predict.levels`` (:func:`levels_of`): the OME-Zarr pyramid of each prediction; ``auto``
gives 2-D outputs over 4096 pixels levels down to 2048 (:func:`parallelkit.inference.zarr_out
.auto_levels`); a number is that many levels, each of which must still be split over the
grid's blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from parallelkit.data.physical import Geometry, geometry, same_pixel_size
from parallelkit.data.readers import SampleReader
from parallelkit.data.source import parse_source
from parallelkit.inference import zarr_out
from parallelkit.train.config import Config
from parallelkit.train.predict.sample import Sample, dims_of, image_reader


def levels_of(cfg: Config, size: tuple[int, ...], counts: dict[str, int] | None,
              image: Path) -> int:
    """The pyramid levels of a sample's prediction (1 for other formats than zarr); with the
    grid's ``counts`` (depth, rows, cols), a ``ValueError`` for a level too small to split."""
    p = cfg.predict
    if p.format != "zarr":
        return 1
    spec = str(p.levels).strip().lower()
    if spec == "auto":
        return zarr_out.auto_levels(size)
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"predict.levels={p.levels!r} must be auto or a number of levels, 1 "
                         "or more")
    levels = int(spec)
    if counts is not None:
        axes = ("depth", "rows", "cols")[3 - len(size):]
        last = zarr_out.level_sizes(size, levels)[-1]
        for axis, n in zip(axes, last, strict=True):
            if counts[axis] > n:
                raise ValueError(
                    f"predict.levels={levels}: level {levels - 1} of {image} is {n} long along "
                    f"{axis}, fewer than the parallel.{axis}={counts[axis]} blocks it is split "
                    "into; ask for fewer levels")
    return levels


def trained_at(cfg: Config) -> tuple[int, Geometry | None]:
    """The ``data.level`` the run trained at, and its first training sample's geometry
    there (None where the run's data cannot be read now)."""
    run = Path(cfg.train.run_dir) / "config.yaml"
    try:
        saved: dict[str, Any] = (yaml.safe_load(run.read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        saved = {}
    level, name = int(saved.get("level", 0) or 0), saved.get("name", cfg.data.name)
    try:
        source = parse_source(name) if isinstance(name, str) else None
    except ValueError:  # a name of no form: nothing to compare with
        source = None
    if source is None or not source.is_block_folder:
        return level, None
    from parallelkit.data.blockset import pairs

    try:
        first = pairs(source.root, "train")[0][0]
        reader = SampleReader(first, dims_of(cfg), cfg.data.layout or None, level=level,
                              channels=cfg.data.channels)
    except (ValueError, OSError, IndexError):
        return level, None
    return level, geometry(reader)


def resolution_note(cfg: Config, found: list[Sample]) -> str:
    """One line where samples are predicted at another pixel size (or pyramid level) than
    the run trained at; '' where they are not, or where nothing tells."""

    level, trained = trained_at(cfg)
    other = []
    for sample in found:
        here = geometry(image_reader(cfg, sample.image))
        same = same_pixel_size(here, trained) if trained is not None else None
        if same is False or (same is None and cfg.data.level != level):
            other.append((sample, here))
    if not other:
        return ""
    sample, here = other[0]
    before = trained.said() if trained is not None and trained.known else "an unknown pixel size"
    more = f" (and {len(other) - 1} more samples)" if len(other) > 1 else ""
    return (f"{sample.image.name}{more} is predicted at {here.said()}, level "
            f"{cfg.data.level}; the run trained at {before}, level {level}: the network sees "
            f"its structures at another size (data.level={level} predicts at the training "
            "level where the sample has it)")
