"""``parallelkit predict``: a trained segmentation run applied to whole samples, on any grid.

    parallelkit predict train.run_dir=RUN predict.output=OUT [data.name=FORMAT:DIR]
                        [predict.input=PATH] [parallel.ranks=8 parallel.depth=2 ...]

On every rank:

    config      the run's ``config.yaml``, then the command line's keys (the grid may differ
                from training's: train on 2 ranks, predict on 8)
    model       the dense network with the newest checkpoint that verifies (its SHA-256s),
                channel shards put together; in eval mode (BatchNorm's running statistics)
    samples     every image of ``predict.split`` of ``data.name``, or ``predict.input``; data
                rank ``d`` of ``D`` takes samples ``d, d + D, ...``, and its spatial group
                splits each one (:class:`parallelkit.inference.Predictor`)
    output      per sample, each rank writes its block into a temporary file; when all have,
                the file is renamed into place: a name in ``OUT`` is a whole prediction.
                ``OUT`` is predict's own (:mod:`parallelkit.inference.record`): rank 0 locks
                it, every sample's files are recorded before they are made, and only
                recorded files are ever replaced; ``predict.resume=true`` skips the samples
                recorded as done with the same settings and redoes the rest. Names are unique
                (:mod:`parallelkit.inference.names`). A write error
                ends the run in one line naming the file, none of that sample's files left
    end         a table on rank 0 (samples, voxels/s, peak memory per rank, output folder;
                mIoU and pixel accuracy where the samples have masks), and ``OUT/predict.json``

The launcher's checks (:func:`check`) come first, each a one-line error and exit status 2.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import parallelkit as pk
from parallelkit.data import datalist
from parallelkit.data.blockset import cached_stats, pairs
from parallelkit.data.intensity import Normalizer
from parallelkit.data.loader import normalizer
from parallelkit.data.readers import SampleReader
from parallelkit.inference import Predictor, Result, dice, outputs, record
from parallelkit.inference.names import output_names
from parallelkit.inference.predictor import fitting_multiple, sample_paths
from parallelkit.parallel import Grid
from parallelkit.train.config import Config, grid_dims
from parallelkit.train.loop.allocator import keep_freed_memory
from parallelkit.train.loop.monitor import table
from parallelkit.train.predict import level as predict_level
from parallelkit.train.predict.folder import (
    finals_of,
    output_plan,
    settings,
    take_output,
    write_summaries,
)
from parallelkit.train.predict.sample import Sample, dims_of, image_reader
from parallelkit.train.ranks.agree import agree, same_everywhere
from parallelkit.train.ranks.devices import device_for, peak_memory_mib, requested_device
from parallelkit.train.store import checkpoint
from parallelkit.train.store.rundir import NORMALIZATION
from parallelkit.train.tasks.segment import Segment
from parallelkit.train.tasks.segmetrics import score_block

SUMMARY = record.SUMMARY
DTYPES = ("float16", "float32")


# ------------------------------------------------------------------------- what to predict
def samples(cfg: Config) -> list[Sample]:
    """``predict.input`` (a file or a folder of them), else ``predict.split`` of
    ``data.name=FORMAT:DIR``, with its masks; each with its own output name
    (:func:`~parallelkit.inference.names.output_names`)."""
    p = cfg.predict
    if p.input:
        where = Path(p.input)
        if not where.exists():
            raise ValueError(f"predict.input={p.input} does not exist")
        found: list[tuple[Path, Path | None]] = [(f, None) for f in sample_paths(where)]
        if not found:
            raise ValueError(f"predict.input={p.input}: no zarr, TIFF, NIfTI or npy samples in it")
    elif not cfg.data.source.is_block_folder:
        raise ValueError(
            f"parallelkit predict reads samples by blocks: give predict.input=PATH, or "
            f"data.name=FORMAT:DIR (zarr, tiff, nifti, npy), not data.name={cfg.data.name}"
        )
    else:
        found = split_pairs(cfg.data.source.root, p.split)
    names = output_names([i for i, _ in found])
    return [Sample(n, i, m) for n, (i, m) in zip(names, found, strict=True)]


def split_pairs(root: str, split: str) -> list[tuple[Path, Path | None]]:
    """``(image, mask or None)`` of a split of a block folder. A Decathlon folder
    (``dataset.json``): ``test`` is its own test cases (``imagesTs``, labels from
    ``labelsTs`` where there) where it has any, else the cases training held out;
    ``validation`` is always the cases training held out (and scored)."""
    listing = datalist.find(root)
    if listing is not None and split == "test" and (tests := datalist.test_images(listing)):
        return tests
    return list(pairs(root, "test" if listing is not None and split == "validation" else split))


def normalization(cfg: Config) -> Normalizer | None:
    """What the run normalized with: its ``normalization.json``, else the statistics of its
    training data (runs from before that file)."""
    saved = Path(cfg.train.run_dir) / NORMALIZATION
    if saved.is_file():
        return Normalizer.from_spec(json.loads(saved.read_text()))
    if cfg.data.normalize != "zscore":
        return normalizer(cfg.data)
    root = cfg.data.source.root
    readers = [image_reader(cfg, i) for i, _ in pairs(root, "train")]
    mean, std = cached_stats(readers, Path(root) / "channel_stats.json")
    return Normalizer("zscore", tuple(mean), tuple(std))


# ------------------------------------------------------------------------------ the model
def dense_weights(folder: Path, dense: nn.Module) -> dict[str, torch.Tensor]:
    """The dense state dict in checkpoint ``folder``: every shard's SHA-256 checked; spatial
    shards hold it whole (under ``module.``), channel shards their slices, put together along
    the dimension where they differ from the dense shape."""
    manifest = checkpoint.read_manifest(folder)
    shards = [checkpoint.load_shard(folder, manifest, name)["task"]["model"]
              for name in manifest["shards"]]
    shards = [{k.removeprefix("module."): v for k, v in s.items()} for s in shards]
    out = {}
    for key, want in dense.state_dict().items():
        parts = [s.get(key) for s in shards]
        if any(p is None for p in parts):
            raise checkpoint.Unreadable(f"checkpoint {folder} has no {key} for this model")
        if all(p.shape == want.shape for p in parts):
            out[key] = parts[0]
            continue
        split = [d for d in range(want.dim()) if parts[0].shape[d] != want.shape[d]]
        joined = torch.cat(parts, split[0]) if len(split) == 1 else None
        if joined is None or joined.shape != want.shape:
            raise checkpoint.Unreadable(
                f"checkpoint {folder}: {key} is {[tuple(p.shape) for p in parts]} over its "
                f"shards, which do not make the model's {tuple(want.shape)}"
            )
        out[key] = joined
    return out


def load_model(cfg: Config, report: bool = True) -> tuple[nn.Module, Path]:
    """The run's network with the newest checkpoint that can be used (older ones are tried,
    each failure said once), and that checkpoint's folder."""
    run_dir = Path(cfg.train.run_dir)
    found = checkpoint.complete(run_dir)
    if not found:
        raise ValueError(f"train.run_dir={run_dir} holds no checkpoint to predict with")
    torch.manual_seed(0)
    dense = Segment.dense_model(cfg, cfg.data.num_classes, cfg.data.channels)
    problems = []
    for folder in reversed(found):
        try:
            dense.load_state_dict(dense_weights(folder, dense))
        except (checkpoint.Unreadable, RuntimeError) as e:
            problems.append(str(e).splitlines()[0])
            if report:
                print(f"parallelkit predict: {problems[-1]}; trying the next older checkpoint",
                      file=sys.stderr, flush=True)
            continue
        return dense.eval(), folder
    raise ValueError(f"no usable checkpoint in {run_dir}: {problems[-1]}")


# ------------------------------------------------------------------------- before the ranks
def check(cfg: Config, world: int) -> None:
    """What ``parallelkit predict`` checks before any rank starts (each a one-line ValueError):
    the run, its checkpoint, the output, the samples against the model and the grid."""
    p = cfg.predict
    if cfg.train.task != "segment":
        raise ValueError(f"parallelkit predict applies segmentation runs; {cfg.train.run_dir} "
                         f"is a train.task={cfg.train.task} run")
    if not p.output:
        raise ValueError("predict.output=DIR is missing: the folder to write predictions into")
    if p.format not in outputs.FORMATS:
        raise ValueError(f"predict.format={p.format!r} must be one of {outputs.FORMATS}")
    if p.dtype not in DTYPES:
        raise ValueError(f"predict.dtype={p.dtype!r} must be one of {DTYPES}")
    dims = grid_dims(cfg.parallel, world)
    if dims["channel"] > 1:
        raise ValueError("parallelkit predict splits samples (parallel.depth/rows/cols) and "
                         "hands them to data ranks; parallel.channel must be 1")
    found = samples(cfg)
    dense, folder = load_model(cfg, report=False)
    counts = {"depth": dims["depth"], "rows": dims["rows"], "cols": dims["cols"]}
    sizes = [check_sample(cfg, sample, dense, counts) for sample in found]
    for sample, size in zip(found, sizes, strict=True):
        predict_level.levels_of(cfg, size, counts, sample.image)
    if p.strict and (note := predict_level.resolution_note(cfg, found)):
        raise ValueError(f"{note}; predict.strict=true refuses it")
    output_plan(cfg, found, sizes, folder)


def check_sample(cfg: Config, sample: Sample, dense: nn.Module, counts: dict[str, int],
                 ) -> tuple[int, ...]:
    """The sample opens, has the model's channels and dimensions, splits over the grid, and
    the dense model takes its whole size, padded to a multiple where it must be (tried on the
    meta device: no memory, no time); its spatial size."""
    dims = dims_of(cfg)
    try:
        reader = image_reader(cfg, sample.image)
        mask = SampleReader(sample.mask, dims, mask=True,
                            level=cfg.data.level) if sample.mask else None
    except (ValueError, OSError, EOFError, RuntimeError) as e:
        raise ValueError(f"{sample.image}: cannot be read: {' '.join(str(e).split())[:300]}"
                         ) from None
    if reader.channels != cfg.data.channels:
        raise ValueError(f"{sample.image} has {reader.channels} channels; the model of "
                         f"{cfg.train.run_dir} takes {cfg.data.channels}")
    if mask is not None and mask.size != reader.size:
        raise ValueError(f"mask {mask.path} is {mask.size}, its image {reader.size}")
    split = dict(zip(("depth", "rows", "cols")[3 - dims:], reader.size, strict=True))
    if dims == 2 and counts["depth"] > 1:
        raise ValueError(f"parallel.depth={counts['depth']} splits volumes; {sample.image} is 2-D")
    for axis, n in split.items():
        if counts[axis] > n:
            raise ValueError(f"{sample.image} is {n} long along {axis}, fewer than the "
                             f"parallel.{axis}={counts[axis]} blocks it would be split into")
    try:
        fitting_multiple(dense, reader.channels, reader.size)
    except ValueError as e:
        raise ValueError(f"{cfg.model.name} cannot take {sample.image}: {e}") from None
    return tuple(reader.size)


# ------------------------------------------------------------------------------ the ranks
def run(cfg: Config, comm: pk.Communicator | None = None) -> dict[str, Any]:
    """Predict every sample (collective over the world); returns the summary."""
    keep_freed_memory()  # each step reuses the last one's memory: no page faults
    comm = comm or pk.init(cfg.parallel.backend, timeout=cfg.parallel.timeout,
                           device=requested_device(cfg.parallel.device))
    try:
        dims = grid_dims(cfg.parallel, comm.size)
    except ValueError as e:
        raise same_everywhere(str(e), comm) from None
    grid = Grid(comm, **dims)
    device = device_for(comm)
    lead = comm.rank == 0
    p, out = cfg.predict, Path(cfg.predict.output)
    dense, folder = load_model(cfg, report=lead)
    predictor = Predictor(dense.to(device), grid, normalization(cfg))
    found = samples(cfg)
    problem, done, lock = "", [False] * len(found), None
    if lead:
        try:
            plan, lock = take_output(cfg, found, [image_reader(cfg, s.image).size
                                                  for s in found], folder)  # fmt: skip
            done = plan.done
        except ValueError as e:
            problem = str(e)
        except OSError as e:
            problem = f"predict.output={out} cannot be used: {outputs.describe(e, out)}"
    agree(comm, problem)
    done = comm.broadcast(torch.tensor(done, dtype=torch.int32, device=device)).bool().tolist()
    todo = [i for i in range(len(found)) if not done[i]]
    mine = [i for i in todo if i % grid.data == grid.coords[0]]
    rounds = max(sum(1 for i in todo if i % grid.data == d) for d in range(grid.data))
    if lead:
        stored = "" if not p.probabilities or outputs.stored_dtype(p.format, p.dtype) == p.dtype \
            else f"; probabilities stored as float32 ({p.format} has no {p.dtype})"
        print(f"parallelkit predict: {len(found)} samples ({sum(done)} already written) from "
              f"{found[0].image.parent} with {folder}, {comm.size} ranks ({comm.backend}), "
              f"{grid}{stored}", flush=True)
        if note := predict_level.resolution_note(cfg, found):
            print(f"parallelkit predict: {note}", flush=True)
    dims_n = dims_of(cfg)
    per_sample = math.prod(predictor.blocks.counts(dims_n))  # blocks: the spatial group's ranks
    bar = _bar(lead, len(mine), per_sample)
    started, voxels, k = time.perf_counter(), 0, cfg.data.num_classes
    counts = torch.zeros(3, k, dtype=torch.float64)
    written = {"settings": settings(cfg, folder), "grid": " x ".join(
        f"{n} {a}" for n, a in zip((grid.data, grid.depth, grid.rows, grid.cols),
                                   ("data", "depth", "rows", "cols"), strict=True))}
    for j in range(rounds):  # every rank, every round: a write error stops all ranks together
        problem = ""
        if j < len(mine):
            i = mine[j]
            stage = None
            if bar is not None:
                bar.set_description(f"predict: sample {j + 1}/{len(mine)}", refresh=False)
                stage = lambda what, name=found[i].name: bar.set_postfix_str(  # noqa: E731
                    f"{name}, {what} {per_sample} blocks")
            try:
                result, scored = predict_one(cfg, predictor, found[i], out, dims_n, stage,
                                             written)  # fmt: skip
                voxels += result.voxels
                if scored is not None:
                    counts += scored
            except outputs.WriteError as e:
                problem = str(e)
            if bar is not None:
                bar.update(per_sample)  # the sample's blocks are written: its write is collective
        if problem and bar is not None:
            bar.close()  # the error on a line of its own
        agree(comm, problem)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - started
    totals = comm.all_reduce(torch.cat([torch.tensor([float(voxels)], dtype=torch.float64),
                                        counts.flatten()]))
    memory = comm.all_gather(torch.tensor([peak_memory_mib(device)], device=device)).cpu()
    summary = _summary(cfg, comm, grid, found, done, totals, seconds, memory, folder)
    problem = ""
    if lead:
        try:
            write_summaries(cfg, found, summary)
        except OSError as e:
            problem = outputs.describe(e, Path(e.filename or out / SUMMARY)).partition(";")[0]
    agree(comm, problem)
    if lead:
        rows = [(k_, str(v)) for k_, v in summary.items() if not isinstance(v, dict | list)]
        print(table(rows, "parallelkit predict: done"), flush=True)
        if lock is not None:
            lock.release()
    return summary


def predict_one(cfg: Config, predictor: Predictor, sample: Sample, out: Path, dims: int,
                stage: Callable[[str], None] | None = None,
                written: dict[str, Any] | None = None,
                ) -> tuple[Result, torch.Tensor | None]:
    """One sample over this rank's spatial group, made under temporary names and renamed
    whole; its result and, where it has a mask, this rank's block's pixel counts against it
    (``(3, K)``; None without one). ``stage`` as in ``Predictor``. ``written``: the
    settings and grid to record the sample's files with (rank 0 of the group records them
    before they are made, and again once they are in place, with the sample's counts). A
    write error: :class:`~parallelkit.inference.outputs.WriteError`."""
    p, comm = cfg.predict, predictor.comm
    reader = image_reader(cfg, sample.image)
    mask = SampleReader(sample.mask, dims, mask=True,
                        level=cfg.data.level) if sample.mask else None
    counts = predictor.blocks.counts(len(reader.size))
    levels = predict_level.levels_of(cfg, reader.size, None, sample.image)
    probabilities = p.dtype if p.probabilities else None
    book, source = record.Record(out), Path(os.path.realpath(sample.image))
    begin = None if written is None else (
        lambda files: book.begin(sample.name, source, files, written["settings"]))
    with outputs.writing(p.format, out / sample.name, reader, cfg.data.num_classes, comm, counts,
                         probabilities, begin=begin, levels=levels) as output:
        result = predictor(reader, output, probabilities=p.probabilities, stage=stage)
    scored, case = None, None
    if mask is not None:
        scored = score_block(result.logits, mask, result.block)[0]
        device = comm.device if comm.device is not None else torch.device("cpu")
        case = dice.case_counts(comm.all_reduce(scored.to(device)).cpu().tolist())
    if written is not None and comm.rank == 0:
        finals = finals_of(cfg, out, sample)
        try:
            book.finish(sample.name, source, finals, outputs.temp_paths(p.format, finals),
                        written["settings"], written["grid"], case)
        except OSError as e:
            raise outputs.WriteError(outputs.describe(e, book.folder).partition(";")[0]
                                     ) from None
    return result, scored


def _bar(lead: bool, samples: int, per_sample: int):
    """Rank 0's bar over its data group's samples, counted in blocks (``per_sample`` each);
    its note says which sample and what its blocks are doing."""
    if not lead:
        return None
    from tqdm import tqdm

    return tqdm(total=samples * per_sample, desc="predict", unit="block", file=sys.stderr,
                dynamic_ncols=True)


def _summary(cfg: Config, comm, grid: Grid, found: list[Sample], done: list[bool],
             totals: torch.Tensor, seconds: float, memory: torch.Tensor, folder: Path,
             ) -> dict[str, Any]:
    from parallelkit.train.tasks.segmetrics import scores

    voxels = totals[0].item()
    counts = totals[1:].view(3, -1)
    summary: dict[str, Any] = {
        "samples": len(found),
        "samples written now": len(found) - sum(done),
        "ranks": f"{comm.size} ({comm.backend})",
        "grid (data x depth x rows x cols)": " x ".join(
            map(str, (grid.data, grid.depth, grid.rows, grid.cols))),
        "voxels": int(voxels),
        "wall time (s)": round(seconds, 3),
        "voxels/s": round(voxels / max(seconds, 1e-9)),
        "peak memory per rank, MiB (max)": round(memory.max().item()),
        "checkpoint": str(folder),
        "output": str(cfg.predict.output),
    }
    if counts[2].sum() > 0:
        s = scores(counts)
        summary["mIoU"] = f"{100 * s['miou']:.2f}%"
        summary["pixel accuracy"] = f"{100 * s['pixel_accuracy']:.2f}%"
        summary["iou"] = s["iou"]
    return summary

