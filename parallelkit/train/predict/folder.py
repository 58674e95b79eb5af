"""``parallelkit predict``'s output folder: what each sample is made with, the checks before
start, taking the folder at start, and the summaries at the end.

The guarantees are those of :mod:`parallelkit.inference.record` (a marker, a lock, a record
per sample; only recorded files are ever removed; nothing written over an input). Every file
a run makes is named there before it is made and made under a temporary name: a sample's
prediction (with its pyramid levels, inside its zarr group, or its ``.nii.gz`` and the
uncompressed file it is made from), ``predict.json`` and, where the samples have labels,
``summary.json`` (per-case and mean Dice, :mod:`parallelkit.inference.dice`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parallelkit.inference import dice, outputs, record
from parallelkit.train.config import Config
from parallelkit.train.predict.sample import Sample
from parallelkit.train.store import rundir
from parallelkit.train.store.files import atomic_text


def settings(cfg: Config, folder: Path) -> dict[str, Any]:
    """What a prediction is made with, as its record keeps it: a resumed run takes a sample as
    done only when these are the same (the grid is not among them: any grid gives the same
    prediction, to roundoff)."""
    p = cfg.predict
    return {"run": os.path.realpath(cfg.train.run_dir), "checkpoint": folder.name,
            "format": p.format, "probabilities": bool(p.probabilities),
            "dtype": outputs.stored_dtype(p.format, p.dtype) if p.probabilities else None,
            "levels": str(p.levels) if p.format == "zarr" else None,
            "level": cfg.data.level}  # fmt: skip


def finals_of(cfg: Config, out: Path, sample: Sample) -> list[Path]:
    """The files a sample's prediction ends up as."""
    p = cfg.predict
    return outputs.final_paths(p.format, out / sample.name, p.probabilities,
                               outputs.is_ome(sample.image))  # fmt: skip


def output_plan(cfg: Config, found: list[Sample], sizes: list[tuple[int, ...]], folder: Path,
                locked: bool = False) -> record.Plan:
    """Read-only: the output folder is free (no other predict holds it; ``locked``: this
    process does), apart from the inputs, has nothing foreign in the way, is writable and has
    room; what the run does to it (:func:`parallelkit.inference.record.plan`). One-line
    ``ValueError`` otherwise."""
    p = cfg.predict
    out = Path(p.output)
    if os.path.lexists(out) and not out.is_dir():
        raise ValueError(f"predict.output={out} is a file, not a folder")
    if not locked and (holder := rundir.lock_holder(out / record.FOLDER)) is not None:
        raise ValueError(f"predict.output={out} is in use by another parallelkit predict (pid "
                         f"{holder}); wait for it to end or stop it, or choose another "
                         "predict.output")
    probs = outputs.stored_dtype(p.format, p.dtype) if p.probabilities else None
    targets = []
    for sample, size in zip(found, sizes, strict=True):
        finals = finals_of(cfg, out, sample)
        targets.append(record.Target(
            sample.name, Path(os.path.realpath(sample.image)), tuple(finals),
            tuple(outputs.temp_paths(p.format, finals)),
            outputs.output_bytes(size, cfg.data.num_classes, probs)))  # fmt: skip
    inputs = [q for s in found for q in (s.image, s.mask) if q is not None]
    plan = record.plan(out, targets, settings(cfg, folder), p.resume, p.overwrite, inputs)
    need = plan.need
    if p.format == "zarr":
        need = max((t.nbytes for t, d in zip(targets, plan.done, strict=True) if not d),
                   default=0)
    record.check_room(out, need, zarr=p.format == "zarr")
    return plan


def take_output(cfg: Config, found: list[Sample], sizes: list[tuple[int, ...]], folder: Path,
                ) -> tuple[record.Plan, Any]:
    """Rank 0 at start: checks the output folder (as ``check`` did), makes it, locks it,
    marks it as predict's and removes the recorded files of the samples to redo; the plan and
    the lock (held until the process ends)."""
    out = Path(cfg.predict.output)
    output_plan(cfg, found, sizes, folder)  # before anything is made
    (out / record.FOLDER).mkdir(parents=True, exist_ok=True)
    try:
        lock = rundir.Lock(out / record.FOLDER)
    except ValueError:
        raise ValueError(f"predict.output={out} is in use by another parallelkit predict (pid "
                         f"{rundir.lock_holder(out / record.FOLDER) or '?'}); wait for it to "
                         "end or stop it, or choose another predict.output") from None
    record.Record(out).claim()
    plan = output_plan(cfg, found, sizes, folder, locked=True)  # no other predict acts now
    record.remove_owned(plan.remove)
    return plan, lock


def write_summaries(cfg: Config, found: list[Sample], summary: dict[str, Any]) -> None:
    """Rank 0 at the end: ``predict.json``, and ``summary.json`` where samples have labels
    (every sample's counts, from its record: those a resumed run skipped too); each written
    whole under a temporary name, then recorded as predict's. ``OSError`` as it comes."""
    out = Path(cfg.predict.output)
    book = record.Record(out)
    atomic_text(out / record.SUMMARY, json.dumps(summary, indent=2))
    book.note_summary(record.SUMMARY)
    cases = []
    for s in found:
        entry = book.entry(s.name) or {}
        if s.mask is not None and entry.get("scores"):
            cases.append((str(finals_of(cfg, out, s)[-1]), str(s.mask), entry["scores"]))
    if cases:
        atomic_text(out / record.DICE, json.dumps(dice.summary(cases), indent=2))
        book.note_summary(record.DICE)
