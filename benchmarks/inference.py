"""Whole-volume inference: parallelkit's prediction on blocks against MONAI's sliding window.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/inference.py --run RUN   # ~10 min, 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/inference.py --run RUN --side 64 --quick

RUN is a trained ``parallelkit train`` run of MONAI's 3-D U-Net (the volume example's:
``examples/segmentation_volumes``); its newest checkpoint is applied to one generated ``--side``
cube (``examples/common/shapes_store.py``, the example's data at another size, written once
under ``--store-dir``), float32, one thread per process.

    dense       the plain network on the whole volume, one process: the reference
    sliding     MONAI's ``sliding_window_inference`` on one process, the whole volume in and
                out, tiles of the ROI that holds 1/P of the volume (P = 2, 4, 8: the memory per
                rank that parallelkit on P ranks needs), overlap 0.25 and 0.5, blending
                "gaussian" and "constant", ``sw_batch_size`` 1
    parallelkit ``pk.Predictor`` on P = 2, 4, 8 ranks (gloo; depth, then rows, then cols
                split in two): each rank reads its block of the volume from the zarr store,
                runs it and keeps its block of the logits; no rank holds the whole volume

Each configuration runs in fresh processes (``parallelkit.testing.Ranks``), with glibc's mmap
threshold fixed at 128 KiB so that a process's resident set follows its live tensors (as in
``examples/common/block_measure.py``). Per configuration:

    max |logit diff|    the largest difference from the dense logits, over every voxel
    class differs       the share of voxels whose argmax differs from the dense prediction's
    wall (s)            the prediction alone (reading included), the slowest rank's
    CPU us/voxel        CPU time of every process (``time.process_time``), summed, per voxel
    peak MiB / rank     the peak resident set (VmHWM, reset before the prediction) minus the
                        resident set before it (after a warm-up prediction of a small volume):
                        the largest rank's
    vs ideal            that, over the dense run's peak divided by P (the ideal split)

Results: ``benchmarks/results/inference.md``, ``.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "common"))

from shapes_store import write_store  # noqa: E402

import parallelkit as pk  # noqa: E402
from parallelkit.data.readers import SampleReader  # noqa: E402
from parallelkit.testing import Ranks  # noqa: E402
from parallelkit.train.config import load  # noqa: E402
from parallelkit.train.predict.command import load_model, normalization  # noqa: E402

from _common import environment, library_state, save  # noqa: E402

MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
GRIDS = {2: dict(depth=2), 4: dict(depth=2, rows=2), 8: dict(depth=2, rows=2, cols=2)}


@dataclass
class Config:
    run: str
    side: int
    ranks: tuple[int, ...]
    overlaps: tuple[float, ...]
    modes: tuple[str, ...]
    store_dir: str
    out_dir: str
    timeout: float


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def start_peak() -> int:
    """The resident set now, with the peak (VmHWM) reset to it (``/proc/self/clear_refs``).

    Why not ``ru_maxrss``: Linux keeps a process's maximum resident set across ``execve``, and
    a spawned rank was, until its exec, a fork of this parent, whose resident set (the dense
    logits it holds) would set a floor under every rank's ``ru_maxrss``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def _model(cfg_path: str):
    cfg = load(cfg_path)
    dense, _ = load_model(cfg, report=False)
    return cfg, dense.eval(), normalization(cfg)


def _read_whole(sample: SampleReader, normalize) -> torch.Tensor:
    x = sample.read().astype(np.float32)
    mean, std = (np.asarray(v, np.float32).reshape(-1, 1, 1, 1) for v in normalize)
    return torch.from_numpy((x - mean) / np.where(std > 0, std, 1))[None]


def whole(comm: pk.Communicator, cfg_path: str, image: str, out: str, how: dict) -> dict:
    """One process: the dense network (``how["kind"] == "dense"``) or MONAI's sliding window
    on the whole volume; the logits saved to ``out``."""
    _, dense, normalize = _model(cfg_path)
    sample = SampleReader(image, dims=3)
    small = SampleReader(str(Path(image).parents[2] / "warm.npy"), dims=3)

    def run(s: SampleReader) -> torch.Tensor:
        x = _read_whole(s, normalize)
        with torch.no_grad():
            if how["kind"] == "dense":
                return dense(x)
            from monai.inferers import sliding_window_inference

            roi = [min(r, n) for r, n in zip(how["roi"], s.size, strict=True)]
            return sliding_window_inference(x, roi, 1, dense, overlap=how["overlap"],
                                            mode=how["mode"])

    run(small)  # warm-up: kernels and libraries, the same code path
    before = start_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    y = run(sample)[0]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = status_kib("VmHWM")
    np.save(out, y.numpy())
    return {"wall": wall, "cpu": cpu, "peak_mib": (peak - before) / 1024}


def blocks(comm: pk.Communicator, cfg_path: str, image: str, out: str, grid: dict) -> dict:
    """One rank of parallelkit's prediction: its block of the logits saved to ``out``."""
    _, dense, normalize = _model(cfg_path)
    g = pk.Grid(comm, **grid)
    predictor = pk.Predictor(dense, g, normalize)
    sample = SampleReader(image, dims=3)
    predictor(SampleReader(str(Path(image).parents[2] / "warm.npy"), dims=3))  # warm-up
    predictor.padded(sample.size, sample.channels)
    comm.barrier()
    before = start_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    result = predictor(sample)
    comm.barrier()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = status_kib("VmHWM")
    np.save(f"{out}-{comm.rank}.npy", result.logits.numpy())
    return {"wall": wall, "cpu": cpu, "peak_mib": (peak - before) / 1024,
            "block": [(s.start, s.stop) for s in result.block]}


def in_pool(n: int, fn, *args, timeout: float) -> list[dict]:
    os.environ[MMAP_THRESHOLD] = str(128 * 1024)
    try:
        with Ranks(n, backend="gloo" if n > 1 else "local", comm_timeout=timeout) as pool:
            return pool.run(fn, *args, timeout=timeout)
    finally:
        os.environ.pop(MMAP_THRESHOLD, None)


def compare(logits: np.ndarray, reference: np.ndarray) -> dict:
    return {
        "max_logit_diff": float(np.abs(logits - reference).max()),
        "class_differs": float((logits.argmax(0) != reference.argmax(0)).mean()),
    }


def roi_for(side: int, p: int) -> list[int]:
    """The cube (multiple of 8) whose volume is about 1/p of the sample's."""
    r = round(side / p ** (1 / 3) / 8) * 8
    return [max(8, min(r, side))] * 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a trained volume run (monai:UNet)")
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--quick", action="store_true", help="one overlap and mode, 2 ranks")
    parser.add_argument("--store-dir", default="runs/stores")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    cfg = Config(args.run, args.side, tuple(args.ranks) if not args.quick else (2,),
                 (0.25, 0.5) if not args.quick else (0.25,),
                 ("gaussian", "constant") if not args.quick else ("gaussian",),
                 args.store_dir, args.out_dir, args.timeout)
    run_cfg = load(str(Path(cfg.run) / "config.yaml"))
    root = Path(cfg.store_dir) / f"inference-{cfg.side}-c{run_cfg.data.channels}"
    if not (root / "test" / "images" / "s0000.zarr").exists():
        write_store(root, 3, cfg.side, train=1, test=1, classes=run_cfg.data.num_classes,
                    channels=run_cfg.data.channels)
    np.save(root / "warm.npy", np.zeros((run_cfg.data.channels, 16, 16, 16), np.uint8))
    image = str(root / "test" / "images" / "s0000.zarr")
    scratch = root / "logits"
    scratch.mkdir(exist_ok=True)
    cfg_path = str(Path(cfg.run) / "config.yaml")
    voxels = cfg.side**3
    rows: list[dict] = []

    print(f"dense, {cfg.side}^3 ...", flush=True)
    dense = in_pool(1, whole, cfg_path, image, str(scratch / "dense.npy"), {"kind": "dense"},
                    timeout=cfg.timeout)[0]
    reference = np.load(scratch / "dense.npy")
    rows.append({"method": "dense (1 process, whole volume)", "ranks": 1, **dense,
                 **compare(reference, reference), "peak_vs_ideal": 1.0})
    for p in cfg.ranks:
        roi = roi_for(cfg.side, p)
        for overlap in cfg.overlaps:
            for mode in cfg.modes:
                print(f"sliding window, roi {roi[0]}^3, overlap {overlap}, {mode} ...",
                      flush=True)
                how = {"kind": "sliding", "roi": roi, "overlap": overlap, "mode": mode}
                r = in_pool(1, whole, cfg_path, image, str(scratch / "sw.npy"), how,
                            timeout=cfg.timeout)[0]
                rows.append({"method": f"MONAI sliding window, roi {roi[0]}^3 (1/{p}), overlap "
                             f"{overlap}, {mode}", "ranks": 1, "p": p, **r,
                             **compare(np.load(scratch / "sw.npy"), reference),
                             "peak_vs_ideal": r["peak_mib"] / (dense["peak_mib"] / p)})
        print(f"parallelkit, {p} ranks ...", flush=True)
        per_rank = in_pool(p, blocks, cfg_path, image, str(scratch / "pk"), GRIDS[p],
                           timeout=cfg.timeout)
        logits = np.empty_like(reference)
        for rank, r in enumerate(per_rank):
            logits[(slice(None), *(slice(a, b) for a, b in r["block"]))] = np.load(
                scratch / f"pk-{rank}.npy")
        peak = max(r["peak_mib"] for r in per_rank)
        rows.append({"method": f"parallelkit, {p} ranks ({' x '.join(map(str, GRIDS[p].values()))}"
                     f" {' x '.join(GRIDS[p])})", "ranks": p, "p": p,
                     "wall": max(r["wall"] for r in per_rank),
                     "cpu": sum(r["cpu"] for r in per_rank), "peak_mib": peak,
                     "peak_per_rank": [r["peak_mib"] for r in per_rank],
                     **compare(logits, reference), "peak_vs_ideal": peak / (dense["peak_mib"] / p)})
    for r in rows:
        r["cpu_us_per_voxel"] = r["cpu"] / voxels * 1e6
    env = environment(parallelkit=pk.__version__, library=library_state(),
                      monai=__import__("monai").__version__)
    markdown = report(cfg, env, rows, run_cfg)
    out = Path(cfg.out_dir) / "inference.md"
    save(out, markdown, env, cfg, rows, load_at_end=[round(v, 2) for v in os.getloadavg()])
    print(markdown)


def report(cfg: Config, env: dict, rows: list[dict], run_cfg) -> str:
    from _common import command_line

    lines = [
        "# Whole-volume inference: parallelkit on blocks vs MONAI's sliding window", "",
        f"Command: `{command_line()}`", "",
        "Machine and versions: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
        f"Model: `{run_cfg.model.name}` {dict(run_cfg.model.kwargs)}, trained run `{cfg.run}`;"
        f" one generated {cfg.side}^3 volume ({run_cfg.data.channels} channels), float32, one "
        "thread per process. Every configuration in fresh processes (benchmarks/inference.py "
        "says how each number is measured).", "",
        "| method | max \\|logit diff\\| vs dense | class differs | wall (s) | CPU us/voxel | "
        "peak MiB / rank | vs ideal (dense / P) |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['max_logit_diff']:.2e} | {100 * r['class_differs']:.4f}% | "
            f"{r['wall']:.1f} | {r['cpu_us_per_voxel']:.3f} | {r['peak_mib']:.0f} | "
            f"{r['peak_vs_ideal']:.2f} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
