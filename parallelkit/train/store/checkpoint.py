"""Checkpoints: one file per model shard plus a manifest, each written atomically and checked.

Layout of ``<run_dir>/checkpoints/step-000120/``::

    shard-0.pt ... shard-{M-1}.pt   the state of the M ranks of data replica 0 (M = rows x cols
                                    x channel; 1 for pure data parallelism): model, optimizer,
                                    schedule and loop position
    manifest.json                   step, grid, shard files with their SHA-256, and the run's
                                    identity (run id, config hash, config); written last

Data-parallel replicas hold identical state, so only replica 0 writes; on resume every rank
reads the shard of its own position in the model-parallel group, and checks its SHA-256
against the manifest before unpickling anything: a shard the manifest holds no checksum for
cannot be verified, and is not loaded. A directory without a manifest is an interrupted write
(or a checkpoint whose manifest was deleted): the next run removes it and says so. Every file
goes to a temporary name first and is renamed
into place (:mod:`parallelkit.train.store.files`), so a crash never leaves a half-written file under
a final name. Files are loaded with ``torch.load(weights_only=True)``: plain tensors and
containers, never pickled code.

On resume, a checkpoint that cannot be used on some rank (a folder that cannot be read, a
missing, damaged or unverifiable shard, a file that is no training checkpoint, a state that
does not fit the model) is reported once, and the next older one is tried
(``train.resume_fallback``); when none is left the ranks stop together with one line
(:mod:`parallelkit.train.ranks.agree`). A save that cannot be written (a full disk) stops the ranks
the same way, naming the file; the previous checkpoint stays. A save never writes into a
folder that is there already (one that resuming passed over): that one is moved aside to
``set-aside-step-N`` and named. Pruning removes only older checkpoints of the same run.

The dense model (channel shards gathered, the original module tree) is exported separately
as ``<run_dir>/model.pt`` at the end of training, for use without parallelkit.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from parallelkit.parallel import Grid
from parallelkit.train.ranks.agree import Stop, agree
from parallelkit.train.store.files import atomic_text, atomic_torch_save, sha256

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
    of this run (``identity["run_id"]``). A file that cannot be written (a full disk) stops
    every rank (:class:`Stop`, exit status 1) naming it; the previous checkpoints stay."""
    folder = Path(run_dir) / "checkpoints" / f"step-{step:09d}"
    shards = [f"shard-{i}.pt" for i in range(grid.dims.model)]
    problem = ""
    if grid.comm.rank == 0:
        problem = _written(folder, lambda: _fresh(folder))
    # Nothing of this save to remove yet: a folder there is one that resuming passed over,
    # which stays as it is when moving it aside failed.
    _agree_on_write(grid, problem, folder, remove=False)
    if grid.coords[0] == 0:
        name = shards[model_rank(grid)]

        def write_shard() -> None:
            digest = atomic_torch_save(folder / name, state)
            atomic_text(folder / (name + DIGEST), digest)

        problem = _written(folder / name, write_shard)
    _agree_on_write(grid, problem, folder)  # every shard is in place before the manifest says so
    if grid.comm.rank == 0:
        manifest = {
            "step": step,
            "grid": {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel},
            "shards": shards,
            "sha256": {s: (folder / (s + DIGEST)).read_text().strip() for s in shards},
            **(identity or {}),
        }
        text = json.dumps(manifest, indent=2)
        problem = _written(folder / MANIFEST, lambda: atomic_text(folder / MANIFEST, text))
    _agree_on_write(grid, problem, folder)
    if grid.comm.rank == 0:
        for s in shards:
            (folder / (s + DIGEST)).unlink(missing_ok=True)
        run_id = (identity or {}).get("run_id")
        for old in [p for p in complete(run_dir) if _run_id(p) == run_id][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    grid.comm.barrier()
    return folder


def _fresh(folder: Path) -> None:
    """Make ``folder`` for a new checkpoint. One that is there already is one that resuming
    passed over (it could not be read or verified): it is never written into nor deleted, but
    moved aside to ``set-aside-step-N`` (outside what resuming and pruning look at) and named."""
    if folder.exists() or folder.is_symlink():
        aside, n = folder.with_name(f"set-aside-{folder.name}"), 1
        while aside.exists() or aside.is_symlink():
            n += 1
            aside = folder.with_name(f"set-aside-{folder.name}-{n}")
        folder.rename(aside)
        print(f"parallelkit train: checkpoint {folder} was passed over on resume; it is kept as "
              f"{aside}, and this step's checkpoint is written anew", file=sys.stderr, flush=True)
    folder.mkdir(parents=True)


def _written(path: Path, write: Callable[[], None]) -> str:
    """Run ``write``; the problem in one line when the file system refuses it, else ''."""
    try:
        write()
    except OSError as e:
        return f"checkpoint file {path} could not be written: {e.strerror or e}"
    return ""


def _agree_on_write(grid: Grid, problem: str, folder: Path, remove: bool = True) -> None:
    """Where any rank failed to write, remove the unfinished checkpoint (``remove``) and stop
    every rank."""
    try:
        agree(grid.comm, problem, status=1)
    except Stop as stop:
        if grid.comm.rank == 0 and remove:
            shutil.rmtree(folder, ignore_errors=True)
        previous = [p for p in complete(folder.parent.parent) if p != folder]
        kept = f"; the previous checkpoint {previous[-1]} is kept" if previous else ""
        raise Stop(f"{stop}{kept}", stop.report, stop.status) from None


def complete(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders that have a manifest, oldest first."""
    return [p for p, kind in folders(run_dir) if kind == "complete"]


def candidates(run_dir: str | Path) -> list[Path]:
    """What ``--resume`` tries, oldest first: the complete checkpoints and the folders that
    cannot be read (reported when tried, not passed over in silence)."""
    return [p for p, kind in folders(run_dir) if kind in ("complete", "unreadable")]


def folders(run_dir: str | Path) -> list[tuple[Path, str]]:
    """Every ``step-*`` folder, oldest first, with what it is: "complete" (a manifest),
    "incomplete" (none: an interrupted write, or a deleted manifest) or "unreadable"."""
    root = Path(run_dir) / "checkpoints"
    try:
        entries = sorted(p for p in root.iterdir() if p.name.startswith("step-"))
    except OSError:  # no checkpoints yet (or the folder itself cannot be read)
        return []
    found = []
    for p in entries:
        try:
            names = os.listdir(p)
        except NotADirectoryError:
            continue
        except OSError:
            found.append((p, "unreadable"))
            continue
        found.append((p, "complete" if MANIFEST in names else "incomplete"))
    return found


def remove_incomplete(run_dir: str | Path) -> list[Path]:
    """Remove checkpoint folders without a manifest: writes a killed run left unfinished, or
    checkpoints whose manifest was deleted (unverifiable). Folders that cannot be read are
    left alone. Only while no other process writes there (the run directory's lock is held)."""
    stale = [p for p, kind in folders(run_dir) if kind == "incomplete"]
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
    match the one saved (``ValueError``); anything else that makes it unusable (a folder or
    shard that cannot be read, a checksum that is missing or does not match, a file that is
    not a training checkpoint) is :class:`Unreadable`."""
    manifest = read_manifest(folder)
    saved = manifest["grid"]
    here = {"rows": grid.rows, "cols": grid.cols, "channel": grid.channel}
    if saved != here:
        raise ValueError(
            f"checkpoint {folder} was written by a model grid {saved}, this run has {here}; "
            "resume with the same parallel.rows/cols/channel (the data dimension may differ)"
        )
    try:
        name = manifest["shards"][model_rank(grid)]
    except (IndexError, KeyError, TypeError):
        message = f"checkpoint {folder}: its manifest lists no shard for this rank"
        raise Unreadable(message) from None
    return load_shard(folder, manifest, name)


def load_shard(folder: Path, manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """The shard ``name`` of the checkpoint in ``folder``, its SHA-256 checked against
    ``manifest`` before anything is unpickled (:class:`Unreadable` otherwise)."""
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"checkpoint shard {path} cannot be read: {e.strerror or e}") from None
    sums = manifest.get("sha256")
    want = sums.get(name) if isinstance(sums, dict) else None
    if want is None:
        raise Unreadable(
            f"checkpoint shard {path} cannot be verified: its manifest holds no SHA-256 for it"
        )
    if sha256(data) != want:
        raise Unreadable(f"checkpoint shard {path} is damaged: its SHA-256 is not the manifest's")
    try:
        with warnings.catch_warnings():  # torch's notes on a pickle it refuses: the line says it
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise Unreadable(f"checkpoint shard {path} holds pickled objects other than tensors and "
                         "containers: refused, loading it could run code") from None
    except Exception as e:  # any unpickling failure means the same: not usable
        what = " ".join(str(e).split())[:300]
        raise Unreadable(f"checkpoint shard {path} cannot be read: {what}") from None
    if not isinstance(state, dict) or "step" not in state or "task" not in state:
        raise Unreadable(
            f"checkpoint shard {path} is not a parallelkit train checkpoint "
            "(it has no 'step' and 'task' entries)"
        )
    return state


def load_newest_usable(
    run_dir: Path,
    grid: Grid,
    device: torch.device,
    fallback: bool,
    apply: Callable[[Path, dict[str, Any]], None] = lambda folder, state: None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint every rank can read and ``apply`` (which raises
    :class:`Unreadable` for a state that does not fit), and this rank's state from it
    (collective). None when ``run_dir`` has no checkpoint.

    Per checkpoint tried, the first data rank that cannot use its shard says why (the other
    data ranks read the same file: it is said once), the ranks agree with one all-reduce, and
    with ``fallback`` the next older one is tried. When none is left, or without ``fallback``,
    every rank raises :class:`Stop` (one line on rank 0).
    """
    found = candidates(run_dir)
    for folder in reversed(found):
        problem, state = "", None
        try:
            state = load(folder, grid)
            apply(folder, state)
        except Unreadable as e:
            problem = str(e)
        except ValueError as e:  # another model grid: every rank reads the same manifest
            raise Stop(str(e), report=grid.comm.rank == 0) from None
        _report_once(grid, problem, device)
        failed = torch.tensor([1.0 if problem else 0.0], device=device)
        if grid.comm.all_reduce(failed, "max").item() == 0:
            return folder, state
        if not fallback:
            raise Stop(
                f"checkpoint {folder} cannot be used (see above); train.resume_fallback=true "
                "resumes from the next older one",
                report=grid.comm.rank == 0,
            )
        if grid.comm.rank == 0:
            print(
                f"parallelkit train: checkpoint {folder.name} is unusable; trying the next "
                "older one",
                file=sys.stderr,
                flush=True,
            )
    if found:
        raise Stop(
            f"no usable checkpoint in {run_dir} (each of the {len(found)} is named above); "
            "start a new run without --resume (train.overwrite=true replaces the old one's "
            "outputs), or choose another train.run_dir",
            report=grid.comm.rank == 0,
        )
    return None


def _report_once(grid: Grid, problem: str, device: torch.device) -> None:
    """Print ``problem`` on the first data rank that has it (collective over the data group:
    the ranks of one model position, which all read the same shard)."""
    data = grid.data_comm
    mine = torch.tensor([float(data.rank if problem else data.size)], device=device)
    first = int(data.all_reduce(mine, "min").item())
    if problem and data.rank == first:
        print(f"parallelkit train: {problem}", file=sys.stderr, flush=True)
