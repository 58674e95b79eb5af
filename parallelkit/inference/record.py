"""``parallelkit predict`` owns its output folder as ``parallelkit train`` owns its run directory.

Predict used to take any file with a prediction's name as its own: ``predict.overwrite=true``
into the input folder deleted the inputs, ``predict.resume=true`` counted a foreign file (or a
prediction made with other settings) as done, and two predicts into one folder broke each
other. Now everything predict knows about a folder lives in ``OUT/.parallelkit-predict/``:

    owner.json          the marker: this folder holds parallelkit predict's outputs (and the
                        summaries ``predict.json`` and ``summary.json`` once written, by
                        identity)
    .lock               ``flock``, held by rank 0 for the whole run
                        (:class:`parallelkit.train.store.rundir.Lock`, the run directory's lock)
    samples/NAME.json   one sample's record: its input, the settings it was made with (run,
                        checkpoint, format, probabilities, dtype; the grid too, not compared:
                        predictions on any grid agree to roundoff), ``state`` (``writing``, then
                        ``done``) and its files, each by identity (inode, mtime, size) once in
                        place; where it has a label, its per-class counts (``scores``: so that
                        ``summary.json`` covers the samples a resumed run skips)

A sample's record is written before any of its files is made, so every file predict makes
is named in a record first. What predict then may remove (:func:`plan`):

- only files a record names, relative to ``OUT``, that are no symbolic link and, once done,
  still have the recorded identity (a file a user put in its place is not predict's);
- never a path that is also an input of the run;
- a file at a name predict is about to write that no record names is in the way: the run is
  refused before start, naming it, and the file is left alone.

``predict.resume=true`` takes a sample as done only when its record says ``done`` with the
same settings and input, and its files are all there; otherwise it is redone (its recorded
files removed first). ``predict.overwrite=true`` redoes every sample the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOLDER = ".parallelkit-predict"
MARKER = "owner.json"
ENTRIES = "samples"
SUMMARY = "predict.json"
DICE = "summary.json"
"""Per-case and mean Dice where the samples have labels (nnU-Net's ``summary.json``)."""
SUMMARIES = (SUMMARY, DICE)
MiB = 1 << 20
MARGIN = (0.05, 16 * MiB)
"""Free space asked for beyond the outputs' size: 5% of it and 16 MiB (file system metadata,
the records, the summary)."""


@dataclass(frozen=True)
class Target:
    """One sample's prediction: its output ``name``, ``input`` image, the files it ends up as
    (``finals``) and is written under (``temps``), and its size in bytes, uncompressed."""

    name: str
    input: Path
    finals: tuple[Path, ...]
    temps: tuple[Path, ...]
    nbytes: int


@dataclass
class Plan:
    """What a run does to ``OUT`` (:func:`plan`): the samples already done, the recorded files
    to remove before predicting, and the bytes the new files need (removals counted)."""

    done: list[bool]
    remove: list[Path] = field(default_factory=list)
    need: int = 0


class Record:
    """The records in ``out/.parallelkit-predict`` (see the module's docstring)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.folder = self.out / FOLDER

    def owned(self) -> bool:
        return (self.folder / MARKER).is_file()

    def claim(self) -> None:
        """Make the record folder and the marker (rank 0, under the lock)."""
        (self.folder / ENTRIES).mkdir(parents=True, exist_ok=True)
        if not self.owned():
            _write_json(self.folder / MARKER, {"tool": "parallelkit predict", "version": 1})

    def entry(self, name: str) -> dict[str, Any] | None:
        """The record of sample ``name``, or None (none, or one that cannot be read: its
        files are then nobody's, so nothing is removed on its word)."""
        try:
            found = json.loads((self.folder / ENTRIES / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) and isinstance(found.get("files"), dict) else None

    def begin(self, name: str, source: Path, files: Iterable[Path], settings: dict) -> None:
        """Before any file of ``name`` is made: the files it will be (and be written as)."""
        self._put(name, "writing", source, {self._rel(p): None for p in files}, settings, None)

    def finish(self, name: str, source: Path, finals: Iterable[Path], temps: Iterable[Path],
               settings: dict, grid: str, scores: dict | None = None) -> None:
        """Once the files of ``name`` are in place: each by identity (the temporary names stay
        reserved to it, by name: a killed redo leaves them); ``scores``: its counts against
        its label."""
        files = {self._rel(p): _identity(os.lstat(p)) for p in finals}
        self._put(name, "done", source, {**files, **{self._rel(p): None for p in temps}},
                  settings, grid, scores)

    def forget(self, name: str) -> None:
        (self.folder / ENTRIES / f"{name}.json").unlink(missing_ok=True)

    def ours(self, path: Path, entry: dict[str, Any] | None) -> bool:
        """``path`` is named by ``entry`` and is still what predict made there."""
        if entry is None or self._rel(path) not in entry["files"]:
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return True  # gone: nothing to remove, nothing in the way
        recorded = entry["files"][self._rel(path)]
        return not stat.S_ISLNK(st.st_mode) and recorded in (None, _identity(st))

    def summary_is_ours(self, name: str = SUMMARY) -> bool:
        try:
            marker = json.loads((self.folder / MARKER).read_text())
            return _identity(os.lstat(self.out / name)) == marker.get(name)
        except (OSError, ValueError, AttributeError):
            return False

    def note_summary(self, name: str = SUMMARY) -> None:
        """Record the summary ``name`` (in ``OUT``, just written) as predict's."""
        marker = json.loads((self.folder / MARKER).read_text())
        marker[name] = _identity(os.lstat(self.out / name))
        _write_json(self.folder / MARKER, marker)

    def _rel(self, path: Path) -> str:
        return Path(path).relative_to(self.out).as_posix()

    def _put(self, name: str, state: str, source: Path, files: dict, settings: dict,
             grid: str | None, scores: dict | None = None) -> None:
        _write_json(self.folder / ENTRIES / f"{name}.json", {
            "state": state, "input": str(source), "settings": settings, "grid": grid,
            "files": files, **({"scores": scores} if scores else {})})  # fmt: skip


def plan(out: Path, targets: Sequence[Target], settings: dict, resume: bool, overwrite: bool,
         inputs: Iterable[Path]) -> Plan:
    """Read-only: what predicting ``targets`` into ``out`` does (see the module's docstring),
    or a one-line ``ValueError`` for an output folder that must not be used as asked."""
    out, key = Path(out), f"predict.output={out}"
    record = Record(out)
    inputs = {_real(p): Path(p) for p in inputs}
    for made in (record.folder, *(out / n for n in SUMMARIES),
                 *(p for t in targets for p in (*t.finals, *t.temps))):
        if (hit := _overlap(made, inputs)) is not None:
            raise ValueError(
                f"{key}: its {made.relative_to(out)} would be written over the input {hit}; "
                "choose an output folder apart from the inputs (or another predict.format)")
    if out.is_dir() and not resume and not overwrite and any(
            p.name != FOLDER for p in out.iterdir()):
        raise ValueError(f"{key} already holds files: predict.overwrite=true replaces its "
                         "predictions, predict.resume=true finishes the ones not yet written")
    for name in SUMMARIES:
        if (out / name).exists() and not record.summary_is_ours(name):
            raise ValueError(f"{key}: {out / name} was not written by parallelkit predict and "
                             "would be replaced by its summary; move it away")
    result = Plan(done=[])
    for t in targets:
        entry = record.entry(t.name)
        for p in (*t.finals, *t.temps):
            if os.path.lexists(p) and not record.ours(p, entry):
                raise ValueError(
                    f"{key}: {p} is in the way of the prediction of {t.input}, and parallelkit "
                    f"predict did not write it (no record of it in {record.folder}); move it "
                    "away or choose another predict.output")
        done = (resume and entry is not None and entry.get("state") == "done"
                and entry.get("settings") == settings and entry.get("input") == str(t.input)
                and all(p.exists() and record.ours(p, entry) for p in t.finals))  # fmt: skip
        result.done.append(done)
        if done:
            continue
        result.need += t.nbytes
        for rel in (entry or {}).get("files", {}):
            p = out / rel
            if os.path.lexists(p) and record.ours(p, entry):
                if _real(p) in inputs:
                    raise ValueError(f"{key}: {p} is named in the record of an earlier "
                                     "prediction but is an input of this one; move it away")
                result.remove.append(p)
                result.need -= _size(p)
    return result


def check_room(out: Path, need: int, zarr: bool) -> None:
    """``out`` can be made (or is a folder) and written here, with room for ``need`` bytes
    and :data:`MARGIN`; a one-line ``ValueError`` otherwise."""
    key = f"predict.output={out}"
    existing = Path(out)
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent  # the nearest part of the path that is there
    if not existing.is_dir():
        where = "is a file" if existing == Path(out) else f"lies under {existing}, a file"
        raise ValueError(f"{key} {where}, not a folder; choose another predict.output")
    for folder in (existing, existing / FOLDER):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            what = "it" if folder == Path(out) else f"{folder}"
            why = "is on a read-only file system" if os.statvfs(folder).f_flag & os.ST_RDONLY \
                else "is not writable by this user"
            raise ValueError(f"{key}: {what} {why}; choose another predict.output")
    need = max(need, 0)
    want = int(need * (1 + MARGIN[0])) + MARGIN[1]
    free = shutil.disk_usage(existing).free
    if free < want:
        what = ("the largest prediction, uncompressed (zarr compresses: the whole cannot be "
                "known before)" if zarr else "the predictions, allocated whole")
        raise ValueError(
            f"{key}: {free / MiB:.0f} MiB free on its file system, and predicting needs about "
            f"{want / MiB:.0f} MiB ({what}, and a margin); free some space or choose another "
            "predict.output")


def remove_owned(paths: Iterable[Path]) -> None:
    """Remove files (and zarr folders) that :func:`plan` found to be predict's."""
    for p in paths:
        if Path(p).is_dir() and not Path(p).is_symlink():
            shutil.rmtree(p)
        else:
            Path(p).unlink(missing_ok=True)


def _overlap(path: Path, inputs: dict[Path, Path]) -> Path | None:
    """The input that ``path`` is, lies inside, or contains; None when none."""
    real = _real(path)
    for r, given in inputs.items():
        if real == r or r in real.parents or real in r.parents:
            return given
    return None


def _identity(st: os.stat_result) -> list[int]:
    """What tells a file predict made from one put in its place: inode, modification time
    and size (a freed inode number is soon given to the next file made)."""
    return [st.st_ino, st.st_mtime_ns, st.st_size if stat.S_ISREG(st.st_mode) else 0]


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_blocks * 512
    return 0


def _write_json(path: Path, content: dict) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(content, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        e.filename = str(path)
        raise
