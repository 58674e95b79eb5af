"""How a sample's stored values become the model's input (``data.normalize``), the same way for
every block of a sample, so that blocks normalized on their own ranks tile the whole sample
normalized in one piece.

Each choice is, per sample and channel, a clip and an affine map (:class:`Intensity`):

    y = (clip(x, low, high) - shift) / scale

    zscore      low, high = -inf, inf; shift, scale = the training images' per-channel mean
                and std (:func:`parallelkit.data.blockset.channel_stats`; the default, as before)
    window      low, high = data.window (e.g. CT Hounsfield units [-1000, 400]); shift = low,
                scale = high - low: the window mapped onto [0, 1], every channel alike
    percentile  low, high = the data.percentiles (default 0.5 and 99.5) of this sample's values
                in this channel (numpy's linear interpolation); shift, scale = the mean and the
                (population) std of those values after clipping them to [low, high]
    none        the stored values as float32

A scale of 0 (a constant channel) divides by 1. ``percentile`` needs numbers of the whole
sample, which no rank holds under spatial parallelism: every rank computes them from the whole
file by the same streaming pass (:func:`sample_values`: every value where the sample has at
most ``max_values`` per channel, else a regular grid of every s-th voxel along each axis), kept
per file by :mod:`parallelkit.data.samplecache`. So every rank normalizes a sample alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.data.readers import SampleReader, slab_blocks
from parallelkit.data.samplecache import per_sample

SAMPLE_STATS_FILE = "sample_stats.json"
MAX_VALUES = 1 << 22
"""Values per channel that ``percentile`` statistics are computed from, at most."""


@dataclass(frozen=True)
class Intensity:
    """One sample's per-channel map ``(clip(x, low, high) - shift) / scale`` (float32);
    ``low`` and ``high`` None: no clipping."""

    shift: np.ndarray
    scale: np.ndarray
    low: np.ndarray | None = None
    high: np.ndarray | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x`` ``(C, *block)`` (float32 or float64, ours to change) mapped in place: no
        block-sized temporaries."""
        shape = (-1,) + (1,) * (x.ndim - 1)
        if self.low is not None and self.high is not None:
            np.clip(x, self.low.reshape(shape), self.high.reshape(shape), out=x)
        x -= self.shift.reshape(shape)
        x /= np.where(self.scale > 0, self.scale, 1).reshape(shape)
        return x

    @classmethod
    def of(cls, shift: Sequence[float], scale: Sequence[float],
           low: Sequence[float] | None = None, high: Sequence[float] | None = None,
           ) -> Intensity:  # fmt: skip
        def f32(v: Sequence[float] | None) -> np.ndarray | None:
            return None if v is None else np.asarray(v, np.float32)

        return cls(f32(shift), f32(scale), f32(low), f32(high))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Normalizer:
    """``data.normalize``: called with a sample's reader, its :class:`Intensity` (None for
    ``none``). ``mean``/``std``: the training images' statistics (``zscore``). ``cache``: the
    JSON file that keeps per-sample statistics (``percentile``; None: memory only). Plain
    values only, so that it pickles into DataLoader workers and saves as JSON (:meth:`spec`)
    beside a run's checkpoints, for ``parallelkit predict``."""

    mode: str = "zscore"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    window: tuple[float, float] | None = None
    percentiles: tuple[float, float] = (0.5, 99.5)
    max_values: int = MAX_VALUES
    cache: str | None = None

    def __call__(self, reader: SampleReader) -> Intensity | None:
        return self.for_samples([reader])[0]

    def for_samples(self, readers: Sequence[SampleReader]) -> list[Intensity | None]:
        """Every reader's :class:`Intensity` (computing the per-sample statistics once)."""
        if self.mode == "none":
            return [None] * len(readers)
        if self.mode == "zscore":
            assert self.mean is not None and self.std is not None
            return [Intensity.of(self.mean, self.std)] * len(readers)
        if self.mode == "window":
            assert self.window is not None
            low, high = self.window
            return [
                Intensity.of(
                    [low] * r.channels,
                    [high - low] * r.channels,
                    [low] * r.channels,
                    [high] * r.channels,
                )
                for r in readers
            ]
        assert self.mode == "percentile", self.mode
        params = ["percentile", list(self.percentiles), self.max_values]
        cache = Path(self.cache) if self.cache else None
        stats = per_sample(readers, params, self._percentile_stats, cache)
        return [Intensity.of(s["mean"], s["std"], s["low"], s["high"]) for s in stats]

    def _percentile_stats(self, reader: SampleReader) -> dict[str, list[float]]:
        values = sample_values(reader, self.max_values)
        low, high = np.percentile(values, self.percentiles, axis=1)
        clipped = np.clip(values, low[:, None], high[:, None])
        return {"low": low.tolist(), "high": high.tolist(),
                "mean": clipped.mean(1).tolist(), "std": clipped.std(1).tolist()}  # fmt: skip

    def spec(self) -> dict[str, Any]:
        """What :meth:`from_spec` rebuilds it from (``normalization.json`` in a run)."""
        return {"mode": self.mode, "mean": _list(self.mean), "std": _list(self.std),
                "window": _list(self.window), "percentiles": list(self.percentiles),
                "max_values": self.max_values}  # fmt: skip

    @classmethod
    def from_spec(cls, spec: dict[str, Any], cache: str | None = None) -> Normalizer:
        """From :meth:`spec`, or a run's older ``{"mean", "std"}`` (``zscore``)."""
        mode = spec.get("mode", "zscore")
        return cls(mode, _tuple(spec.get("mean")), _tuple(spec.get("std")),
                   _tuple(spec.get("window")),  # type: ignore[arg-type]
                   tuple(spec.get("percentiles", (0.5, 99.5))),  # type: ignore[arg-type]
                   int(spec.get("max_values", MAX_VALUES)), cache)  # fmt: skip


def sample_values(reader: SampleReader, max_values: int = MAX_VALUES) -> np.ndarray:
    """``(C, n)`` float64 values of the whole sample, read by slabs: every value where the
    sample has at most ``max_values`` per channel, else those of the voxels whose every
    coordinate is a multiple of ``s``, the smallest stride that leaves at most ``max_values``.
    A function of the file alone: the same on every rank."""
    size = reader.size
    stride = max(1, math.floor((math.prod(size) / max_values) ** (1 / len(size))))
    while math.prod(-(-n // stride) for n in size) > max_values:
        stride += 1
    parts = []
    for block in slab_blocks(size, reader.channels, max(max_values, 1 << 20)):
        first = block[0].start
        rows = slice((-first) % stride, None, stride)  # global rows that are multiples of s
        x = reader.read(block)[(slice(None), rows) + (slice(None, None, stride),) * (len(size) - 1)]
        parts.append(x.reshape(reader.channels, -1).astype(np.float64))
    return np.concatenate(parts, 1)


def _list(v: Sequence[float] | None) -> list[float] | None:
    return None if v is None else [float(a) for a in v]


def _tuple(v: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if v is None else tuple(float(a) for a in v)
