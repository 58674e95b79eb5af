"""Checkpoints: one file per model shard plus a manifest, each written atomically.

Layout of ``<run_dir>/checkpoints/step-000120/``::

    shard-0.pt ... shard-{M-1}.pt   the state of the M ranks of data replica 0 (M = rows x cols
                                    x channel; 1 for pure data parallelism): model, optimizer,
                                    schedule and loop position
    manifest.json                   step, epoch, grid, shard files; written last

Data-parallel replicas hold identical state, so only replica 0 writes; on resume every rank
reads the shard of its own position in the model-parallel group. A directory without a
manifest is an interrupted write and is ignored. Every file goes to a temporary name first
and is renamed into place (``os.replace`` is atomic on POSIX), so a crash never leaves a
half-written file under a final name. Files are loaded with ``torch.load(weights_only=True)``:
plain tensors and containers, never pickled code.

The dense model (channel shards gathered, the original module tree) is exported separately
as ``<run_dir>/model.pt`` at the end of training, for use without parallelkit.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from parallelkit.parallel import Grid

MANIFEST = "manifest.json"


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def model_rank(grid: Grid) -> int:
    """This rank's position inside its model replica (same numbering in every replica)."""
    _, r, c, k = grid.coords
    return (r * grid.cols + c) * grid.channel + k


def save(run_dir: str | Path, step: int, state: dict[str, Any], grid: Grid, keep: int = 2) -> Path:
    """Write this step's checkpoint (collective over ``grid.comm``); keep the newest ``keep``."""
    folder = Path(run_dir) / "checkpoints" / f"step-{step:09d}"
    if grid.comm.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    grid.comm.barrier()
    shards = grid.rows * grid.cols * grid.channel
    if grid.coords[0] == 0:
        _atomic_write(folder / f"shard-{model_rank(grid)}.pt", lambda f: torch.save(state, f))
    grid.comm.barrier()  # every shard is in place before the manifest says so
    if grid.comm.rank == 0:
        manifest = {
            "step": step,
            "grid": {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel},
            "shards": [f"shard-{i}.pt" for i in range(shards)],
        }
        text = json.dumps(manifest, indent=2).encode()
        _atomic_write(folder / MANIFEST, lambda f: f.write(text))
        for old in complete(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    grid.comm.barrier()
    return folder


def complete(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders that have a manifest, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p.parent for p in root.glob(f"step-*/{MANIFEST}"))


def latest(run_dir: str | Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def load(folder: Path, grid: Grid) -> dict[str, Any]:
    """This rank's shard of the checkpoint in ``folder``; the grid must match the one saved."""
    manifest = json.loads((folder / MANIFEST).read_text())
    saved = manifest["grid"]
    here = {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel}
    if saved != here:
        raise ValueError(
            f"checkpoint {folder} was written by a model grid {saved}, this run has {here}; "
            "resume with the same parallel.rows/cols/channel (the data dimension may differ)"
        )
    path = folder / manifest["shards"][model_rank(grid)]
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        raise ValueError(f"checkpoint shard {path} cannot be read: {e}") from None
