"""Checkpoints: one file per model shard plus a manifest, each written atomically and checked.

Layout of ``<run_dir>/checkpoints/step-000120/``::

    shard-0.pt ... shard-{M-1}.pt   the state of the M ranks of data replica 0 (M = rows x cols
                                    x channel; 1 for pure data parallelism): model, optimizer,
                                    schedule and loop position
    manifest.json                   step, grid, shard files with their SHA-256, and the run's
                                    identity (run id, config hash, config); written last

Data-parallel replicas hold identical state, so only replica 0 writes; on resume every rank
reads the shard of its own position in the model-parallel group, and checks its SHA-256
against the manifest before unpickling anything. A directory without a manifest is an
interrupted write and is ignored. Every file goes to a temporary name first and is renamed
into place (:mod:`parallelkit.train.files`), so a crash never leaves a half-written file under
a final name. Files are loaded with ``torch.load(weights_only=True)``: plain tensors and
containers, never pickled code.

On resume, a checkpoint that cannot be used on some rank (missing or damaged shard, a
checksum that does not match) is reported, and the next older complete one is tried
(``train.resume_fallback``). Pruning removes only older checkpoints of the same run.

The dense model (channel shards gathered, the original module tree) is exported separately
as ``<run_dir>/model.pt`` at the end of training, for use without parallelkit.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from parallelkit.parallel import Grid
from parallelkit.train.files import atomic_text, atomic_torch_save, sha256

MANIFEST = "manifest.json"
DIGEST = ".sha256"  # sidecar of a shard until the manifest holds its checksum


class Unreadable(ValueError):
    """A checkpoint that cannot be used: missing, truncated, or not what its manifest says."""


def model_rank(grid: Grid) -> int:
    """This rank's position inside its model replica (same numbering in every replica)."""
    return grid.model_rank


def save(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    grid: Grid,
    keep: int = 2,
    identity: dict[str, Any] | None = None,
) -> Path:
    """Write this step's checkpoint (collective over ``grid.comm``); keep the newest ``keep``
    of this run (``identity["run_id"]``)."""
    folder = Path(run_dir) / "checkpoints" / f"step-{step:09d}"
    if grid.comm.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    grid.comm.barrier()
    shards = [f"shard-{i}.pt" for i in range(grid.dims.model)]
    if grid.coords[0] == 0:
        name = shards[model_rank(grid)]
        digest = atomic_torch_save(folder / name, state)
        atomic_text(folder / (name + DIGEST), digest)
    grid.comm.barrier()  # every shard is in place before the manifest says so
    if grid.comm.rank == 0:
        manifest = {
            "step": step,
            "grid": {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel},
            "shards": shards,
            "sha256": {s: (folder / (s + DIGEST)).read_text().strip() for s in shards},
            **(identity or {}),
        }
        atomic_text(folder / MANIFEST, json.dumps(manifest, indent=2))
        for s in shards:
            (folder / (s + DIGEST)).unlink(missing_ok=True)
        run_id = (identity or {}).get("run_id")
        for old in [p for p in complete(run_dir) if _run_id(p) == run_id][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    grid.comm.barrier()
    return folder


def complete(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders that have a manifest, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p.parent for p in root.glob(f"step-*/{MANIFEST}"))


def remove_incomplete(run_dir: str | Path) -> list[Path]:
    """Remove checkpoint folders without a manifest: writes a killed run left unfinished.
    Only while no other process writes there (the run directory's lock is held)."""
    root = Path(run_dir) / "checkpoints"
    stale = [p for p in root.glob("step-*") if p.is_dir() and not (p / MANIFEST).is_file()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def latest(run_dir: str | Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if not all(k in manifest for k in ("step", "shards", "grid")):
            raise ValueError("step, shards or grid missing")
    except (OSError, ValueError, TypeError) as e:
        raise Unreadable(f"checkpoint {folder}: manifest cannot be read ({e})") from None
    return manifest


def read_manifest_or_none(folder: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(folder)
    except Unreadable:
        return None


def describe(folder: Path) -> str:
    """``run <id>, step N`` for messages."""
    manifest = read_manifest_or_none(folder) or {}
    return f"run {manifest.get('run_id', '(no id)')}, newest {folder.name}"


def _run_id(folder: Path) -> str | None:
    return (read_manifest_or_none(folder) or {}).get("run_id")


def load(folder: Path, grid: Grid) -> dict[str, Any]:
    """This rank's shard of the checkpoint in ``folder``, its checksum verified; the grid must
    match the one saved (``ValueError``), the files must be intact (:class:`Unreadable`)."""
    manifest = read_manifest(folder)
    saved = manifest["grid"]
    here = {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel}
    if saved != here:
        raise ValueError(
            f"checkpoint {folder} was written by a model grid {saved}, this run has {here}; "
            "resume with the same parallel.rows/cols/channel (the data dimension may differ)"
        )
    name = manifest["shards"][model_rank(grid)]
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"checkpoint shard {path} cannot be read: {e}") from None
    want = manifest.get("sha256", {}).get(name)
    if want is not None and sha256(data) != want:
        raise Unreadable(f"checkpoint shard {path} is damaged: its SHA-256 is not the manifest's")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means the same: not usable
        raise Unreadable(f"checkpoint shard {path} cannot be read: {e}") from None
    if not isinstance(state, dict) or "step" not in state or "task" not in state:
        raise ValueError(
            f"checkpoint shard {path} is not a parallelkit train checkpoint "
            "(it has no 'step' and 'task' entries)"
        )
    return state


def load_newest_usable(
    run_dir: Path, grid: Grid, device: torch.device, fallback: bool
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint every rank can read, and this rank's state from it (collective).

    The ranks agree with one all-reduce per checkpoint tried; the rank that cannot read its
    shard says why, and with ``fallback`` the next older one is tried. None when ``run_dir``
    has no checkpoint.
    """
    found = complete(run_dir)
    for folder in reversed(found):
        problem, state = "", None
        try:
            state = load(folder, grid)
        except Unreadable as e:
            problem = str(e)
            print(f"parallelkit train: {problem}", file=sys.stderr, flush=True)
        failed = torch.tensor([1.0 if problem else 0.0], device=device)
        if grid.comm.all_reduce(failed, "max").item() == 0:
            return folder, state
        if not fallback:
            raise ValueError(
                f"checkpoint {folder} cannot be used (see above); train.resume_fallback=true "
                "resumes from the next older one"
            )
        if grid.comm.rank == 0:
            print(
                f"parallelkit train: checkpoint {folder.name} is unusable; trying the next "
                "older one",
                file=sys.stderr,
                flush=True,
            )
    if found:
        raise ValueError(f"no usable checkpoint in {run_dir} (every one failed, see above)")
    return None
