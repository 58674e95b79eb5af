"""``parallelkit train`` and ``parallelkit predict`` run as a user runs them (the command in a
subprocess), the records a run leaves, and the tiny runs that the end-to-end tests share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from parallelkit.data.shapes import ShapesDataset
from parallelkit.data.shapes3d import ShapesVolumeDataset

# A ResNet-18 of width 4 on 16x16 digits: every layer type, seconds per run.
TINY = [
    "model.width=4",
    "model.stem=cifar",
    "data.image_size=16",
    "data.channels=1",
    "train.batch_size=16",
    "train.max_steps=4",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",  # curves.png: drawn by test_trainer.py's bf16 run
    "parallel.timeout=120",
    "optim.lr=0.4",
]


def train(run_dir: Path, *overrides: str, ok: bool = True, timeout: float = 300, **env: str):
    """Run ``parallelkit train`` (``env``: variables added); returns the completed process
    (checked when ``ok``)."""
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", f"train.run_dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def train_all(runs: dict[str, tuple[Path, list[str]]]) -> dict:
    """``train`` each of ``runs`` (name -> (run_dir, overrides)), two at a time: 1-rank runs
    keep one core each busy, so on two cores a pair takes the time of one."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(train, d, *o) for name, (d, o) in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def records(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """The last metrics record of each step (a resumed run logs some steps twice)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def curve(run_dir: Path, key: str = "loss") -> list[float]:
    return [r[key] for _, r in sorted(records(run_dir).items())]


def assert_curves_equal(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-4, atol=1e-5)


# segment: a U-Net of width 4 on 16x16 generated shapes (4 classes): seconds per run.
SEGMENT_TINY = [
    "train.task=segment",
    "model.width=4",
    "data.image_size=16",
    "data.train_samples=32",
    "data.test_samples=12",
    "train.batch_size=8",
    "train.max_steps=4",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
    "optim.lr=0.4",
]


def predict(*overrides: str, ok: bool = True, script: list[str] | None = None,
            preexec_fn=None, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(script or ["-m", "parallelkit.cli", "predict"]), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          preexec_fn=preexec_fn)  # fmt: skip
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def refused(proc: subprocess.CompletedProcess, expected: str) -> str:
    """The run ended with exit status 2 and one error line holding ``expected``, no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    return errors[0]


BLOCKS_COMMON = [
    "train.task=segment", "data.num_classes=3", "data.channels=1", "train.batch_size=4",
    "train.max_steps=4", "train.log_every=1", "train.progress=false", "train.tensorboard=false",
    "train.plot=false", "optim.lr=0.2",
]  # fmt: skip
# a segment run on block folders (write_block_samples): 24-pixel crops, 16^3 for volumes
BLOCK_IMAGES = [*BLOCKS_COMMON, "data.image_size=24", "model.width=4"]
BLOCK_VOLUMES = [
    *BLOCKS_COMMON, "data.image_size=16", "data.dims=3", "model.name=monai:UNet",
    "model.kwargs={channels: [4, 8], strides: [2], num_res_units: 1, norm: batch}",
]  # fmt: skip


def write_block_samples(root, kind: str) -> None:
    """Generated scenes stored as files: 8 training and 4 test samples, each larger than the
    crop (28 pixels for 24-pixel crops, 20^3 voxels for 16^3), so the crops move."""
    for split, count, base in (("train", 8, 0), ("test", 4, 1000)):
        (root / split / "images").mkdir(parents=True)
        (root / split / "masks").mkdir(parents=True)
        if kind == "npy":
            data = ShapesDataset(count, image_size=28, channels=1, num_classes=3, base=base)
        else:
            data = ShapesVolumeDataset(count, image_size=20, channels=1, num_classes=3, base=base)
        for i in range(count):
            image, mask = data[i]
            name = root / split / "images" / f"s{i}", root / split / "masks" / f"s{i}"
            if kind == "npy":
                np.save(f"{name[0]}.npy", image.numpy())  # (1, H, W)
                np.save(f"{name[1]}.npy", mask.numpy().astype(np.uint8))
            else:  # NIfTI: (X, Y, Z), read as (C, D, H, W)
                volume, labels = image[0].numpy(), mask.numpy().astype(np.uint8)
                nib.save(nib.Nifti1Image(volume, np.eye(4)), f"{name[0]}.nii.gz")
                nib.save(nib.Nifti1Image(labels, np.eye(4)), f"{name[1]}.nii")
