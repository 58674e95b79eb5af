"""Whole-sample prediction on blocks: every rank reads, runs and writes only its block.

    predictor = Predictor(model, grid, normalize="runs/ct")     # dense, trained; made once;
                                                                # the run's normalizer
    result = predictor(SampleReader("scan.nii.gz"), out)       # collective over the sample's
                                                                # spatial group
    pk.predict(model, sample, grid, out)                        # the same, in one call

Why this is the whole-sample prediction, not a tiled one. The model is parallelized over the
grid's spatial group with blocks in and blocks out (``pk.parallelize(spatial_input="blocks",
spatial_output="blocks")``): each convolution, pooling and upsampling fetches the rows it
needs from the neighbouring blocks, so the output block is exactly the dense model's output
on the whole sample, restricted to the block. There are no tiles, no overlaps and no blending;
the receptive field is never cut. MONAI's ``sliding_window_inference`` runs each tile alone,
so its result depends on the tile size, the overlap and the blending.

Eval mode: BatchNorm uses its running statistics, so nothing is reduced over the spatial
group; the only communication is the halo exchange of each layer (and, per sample, one small
all-gather of the blocks' sizes, which checks their layout). Nothing keeps activations for a
backward pass, so a rank holds its block of one layer's input and output at a time.

Legend: ``_blk`` is this rank's block, ``size`` a whole sample's spatial size, ``K`` classes.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from parallelkit.data.axes import Block
from parallelkit.data.intensity import Normalizer
from parallelkit.data.readers import SampleReader
from parallelkit.inference.outputs import Output
from parallelkit.inference.turns import write_in_turns
from parallelkit.inference.zarr_out import write_levels
from parallelkit.parallel import Grid, parallelize
from parallelkit.spatial import grid_of


@dataclass
class Result:
    """What one sample's prediction did on this rank."""

    size: tuple[int, ...]
    block: Block  # this rank's block of the sample
    seconds: float
    logits: torch.Tensor = field(repr=False)  # (K, *block): for scoring against a mask

    @property
    def voxels(self) -> int:
        return math.prod(s.stop - s.start for s in self.block)


class Predictor:
    """``model`` (dense, trained) run over the spatial group of ``grid`` on whole samples.

    ``grid``: a :class:`~parallelkit.Grid` whose spatial group (depth x rows x cols) splits a
    sample; its data ranks predict different samples (the caller hands them out). Channel
    parallelism is refused: prediction splits samples, not layers. ``normalize``: what
    training normalized with, applied to every block read: the run's own normalizer (a run
    directory, or its ``normalization.json``: an HU window, percentiles, z-scores, as
    ``parallelkit train`` saved them), a :class:`~parallelkit.data.intensity.Normalizer`,
    per-channel ``(mean, std)``, or None.
    ``dtype``: the dtype the model runs in (float32; float64 for exactness tests).
    ``pad``: a sample the model cannot take at its size (a U-Net that halves it four times
    needs a multiple of 16) is padded at its far end, with zeros after normalization, to a
    multiple of ``pad``; ``"auto"``: the smallest power of two that the model takes (found on
    the meta device, where nothing is computed). The padding is cut off the output.
    """

    def __init__(self, model: nn.Module, grid: Grid,
                 normalize: tuple[Sequence[float], Sequence[float]] | Normalizer | str | Path
                 | None = None,
                 dtype: torch.dtype = torch.float32, fallback: str = "refuse",
                 pad: str | int = "auto") -> None:
        if grid.channel > 1:
            raise ValueError(
                f"predict: the grid splits channels over {grid.channel} ranks; prediction splits "
                "samples (parallel.depth/rows/cols) and hands samples to data ranks"
            )
        self.grid, self.dtype, self.pad = grid, dtype, pad
        self._meta = copy.deepcopy(model).to("meta")
        self._multiples: dict[tuple[int, ...], int] = {}
        self.comm = grid.spatial_comm
        self.blocks = grid_of(self.comm, grid.spatial)
        spatial = Grid(self.comm, depth=grid.depth, rows=grid.rows, cols=grid.cols)
        dense = copy.deepcopy(model).to(dtype).eval()
        self.device = next(dense.parameters(), torch.empty(0)).device  # blocks run there
        self.model = parallelize(dense, spatial, spatial, spatial_input="blocks",
                                 spatial_output="blocks", fallback=fallback).eval()
        if isinstance(normalize, tuple):  # per-channel (mean, std), as before
            normalize = Normalizer("zscore", tuple(normalize[0]), tuple(normalize[1]))
        elif isinstance(normalize, str | Path):
            normalize = run_normalizer(normalize)
        self.normalize = normalize

    def padded(self, size: Sequence[int], channels: int) -> tuple[int, ...]:
        """The size that ``size`` runs at: padded to a multiple the model takes (``pad``)."""
        size = tuple(size)
        if self.pad != "auto":
            m = int(self.pad)
        else:
            if size not in self._multiples:
                self._multiples[size] = fitting_multiple(self._meta, channels, size)
            m = self._multiples[size]
        return tuple(-(-n // m) * m for n in size)

    def block(self, size: Sequence[int]) -> Block:
        """This rank's block of a sample of ``size`` (``pk.spatial.scatter``'s layout)."""
        return self.blocks.block(*size)

    def read(self, sample: SampleReader, block: Block) -> torch.Tensor:
        """``(1, C, *block)``: this rank's block of ``sample``, normalized."""
        x = sample.read(block).astype(np.float64 if self.dtype == torch.float64 else np.float32)
        if self.normalize is not None and (intensity := self.normalize(sample)) is not None:
            intensity(x)  # the whole sample's numbers: every rank maps its block alike
        return torch.from_numpy(np.ascontiguousarray(x))[None].to(self.dtype)

    @torch.no_grad()
    def logits(self, x_blk: torch.Tensor) -> torch.Tensor:
        """The model's output block ``(1, K, *block)`` for the input block ``x_blk``."""
        out = self.model(x_blk)
        if isinstance(out, dict):  # torchvision's segmentation models: {"out", "aux"}
            out = out["out"]
        if out.shape[2:] != x_blk.shape[2:]:
            raise ValueError(
                f"predict: the model returned {tuple(out.shape)} for an input block of "
                f"{tuple(x_blk.shape)}; it must return per-voxel logits at the input's "
                "resolution"
            )
        return out

    def __call__(self, sample: SampleReader, output: Output | None = None,
                 probabilities: bool = False,
                 stage: Callable[[str], None] | None = None) -> Result:
        """Predict ``sample`` (collective over the spatial group): read this rank's block, run
        it, and write it to ``output`` (None: write nothing). ``stage`` is told "reading",
        "running" and "writing" as this rank's block enters each (a progress bar's note)."""
        stage = stage or (lambda _: None)
        started = time.perf_counter()
        size = tuple(sample.size)
        run = self.padded(size, sample.channels)
        block = self.block(run)  # of the padded sample
        inside = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(block, size,
                                                                               strict=True))
        kept = (slice(None), *(slice(0, s.stop - s.start) for s in inside))
        stage("reading")
        if run == size:
            x_blk = self.read(sample, block)
        else:  # zeros (the mean, once normalized) past the sample's far end
            x_blk = torch.zeros(1, sample.channels, *(s.stop - s.start for s in block),
                                dtype=self.dtype)
            x_blk[0][kept] = self.read(sample, inside)[0]
        stage("running")
        logits = self.logits(x_blk.to(self.device))[0][kept].cpu()  # (K, *inside): unpadded
        if output is not None:
            stage("writing")
            probs = logits.float().softmax(0).numpy() if probabilities else None
            classes = logits.argmax(0).to(torch.uint8).numpy()
            write_in_turns(self.comm, self.blocks.axes(len(size)), size, inside, output,
                           classes, probs)
            if output.levels > 1:  # the pyramid, from level 0 as written
                stage("writing levels")
                write_levels(self.comm, self.blocks, size, output, int(logits.shape[0]))
        return Result(size, inside, time.perf_counter() - started, logits)


def run_normalizer(where: str | Path) -> Normalizer:
    """The normalizer a run trained with: ``where`` is its run directory or the
    ``normalization.json`` that ``parallelkit train`` wrote there."""
    import json

    path = Path(where)
    path = path / "normalization.json" if path.is_dir() else path
    try:
        return Normalizer.from_spec(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"normalize={where}: no run normalizer to read at {path} ({e}); give "
                         "a run directory that parallelkit train wrote, a Normalizer or "
                         "(mean, std)") from None


def fitting_multiple(model: nn.Module, channels: int, size: Sequence[int],
                     largest: int = 256) -> int:
    """The smallest power of two ``m`` such that ``model`` takes a ``(1, channels, *size)``
    input padded to multiples of ``m`` and returns per-voxel outputs of the padded size (tried
    on the meta device: no memory, no time). A
    ``ValueError`` when none up to ``largest`` does; 1 when the model cannot run on meta."""
    meta = model if next(model.parameters(), torch.empty(0, device="meta")).is_meta else (
        copy.deepcopy(model).to("meta"))
    dtype = next(model.parameters(), torch.empty(0)).dtype
    m, error = 1, ""
    while m <= largest:
        shape = tuple(-(-n // m) * m for n in size)
        try:
            out = meta(torch.empty(1, channels, *shape, device="meta", dtype=dtype))
            out = out["out"] if isinstance(out, dict) else out
            out = out[0] if isinstance(out, tuple | list) else out
            if tuple(out.shape[2:]) == shape:
                return m
            error = f"it returns {tuple(out.shape)} for an input of {shape}"
        except (RuntimeError, ValueError) as e:
            error = " ".join(str(e).split())[:300]
        except Exception:
            return 1  # an operation with no meta kernel: the ranks find out for real
        m *= 2
    raise ValueError(f"the model takes no padding of a {channels} x "
                     f"{' x '.join(map(str, size))} sample to a multiple of up to {largest}: "
                     f"{error}")


def predict(model: nn.Module, sample: SampleReader, grid: Grid, output: Output | None = None,
            **kwargs) -> Result:
    """One sample predicted over ``grid``'s spatial group: :class:`Predictor` made and called
    once (make a Predictor to predict many samples)."""
    return Predictor(model, grid, **kwargs)(sample, output)


def sample_paths(where: Path) -> list[Path]:
    """The samples in a folder (sorted), or the file itself."""
    from parallelkit.data.arrays import format_of

    if where.is_dir() and format_of(where) is None:
        return sorted(p for p in where.iterdir() if format_of(p) and not p.name.startswith("."))
    return [where]


__all__ = ["Predictor", "Result", "predict", "sample_paths"]
