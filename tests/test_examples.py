"""The examples, run the way their README says (shorter)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from parallelkit import models
from parallelkit.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1")
QUIET = ["train.progress=false", "train.tensorboard=false", "parallel.timeout=120"]


def test_digits_allreduce_learns_on_two_ranks():
    pytest.importorskip("sklearn")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(ROOT / "examples/digits_allreduce/train.py"),
        "--epochs", "4",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    row = re.search(r"\| 2 \| gloo \| 4 \| ([\d.]+)% \|", proc.stdout)
    assert row, proc.stdout
    assert float(row.group(1)) > 90.0


def train_example(name: str, run_dir: Path, *overrides: str) -> dict[str, str]:
    """``parallelkit train --config examples/<name>/config.yaml`` plus ``overrides``, run from
    the repository root as the README says; returns the final table as {row: value}."""
    config = EXAMPLES / name / "config.yaml"
    assert f"--config examples/{name}/config.yaml" in (EXAMPLES / name / "README.md").read_text()
    cmd = [
        sys.executable, "-m", "parallelkit.cli", "train", "--config", str(config),
        f"train.run_dir={run_dir}", *QUIET, *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = re.findall(r"^\| (.+?) +\| +(.+?) \|$", proc.stdout, re.MULTILINE)
    assert rows, proc.stdout
    return dict(rows)


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_resnet_digits(tmp_path):
    pytest.importorskip("sklearn")
    table = train_example(
        "resnet_digits", tmp_path, "model.width=8", "data.image_size=16", "train.max_steps=2"
    )
    assert table["ranks"] == "2 (gloo)"
    assert table["grid (data x rows x cols x channel)"] == "2 x 1 x 1 x 1"
    assert table["steps"] == "2" and table["test accuracy"].endswith("%")
    assert [r["count"] for r in records(tmp_path, "eval")] == [359]  # every test image once
    assert {"model.pt", "config.yaml", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}


def test_spatial_large_images(tmp_path):
    # 64x64 instead of 512x512: 4 rows per rank at the last stage.
    table = train_example(
        "spatial_large_images", tmp_path, "model.width=8", "data.image_size=64",
        "train.max_steps=2",
    )  # fmt: skip
    assert table["grid (data x rows x cols x channel)"] == "1 x 2 x 1 x 1"
    assert float(table["peak memory per rank, MiB (max)"]) > 0
    assert len(records(tmp_path, "train")) == 2


def test_channel_parallel(tmp_path):
    pytest.importorskip("sklearn")
    table = train_example(
        "channel_parallel", tmp_path, "model.width=16", "data.image_size=16", "train.max_steps=2"
    )
    assert table["grid (data x rows x cols x channel)"] == "1 x 1 x 1 x 2"
    assert table["test accuracy"].endswith("%")
    # The export is the whole (gathered) network: it loads into the plain ResNet-18.
    plain = models.create(
        "resnet18", num_classes=10, in_channels=1, stem="imagenet", widths=(16, 32, 64, 128)
    )
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))


def test_dcgan(tmp_path):
    pytest.importorskip("sklearn")
    table = train_example("dcgan", tmp_path, "model.width=8", "train.max_steps=2")
    assert table["ranks"] == "2 (gloo)" and "train loss_g" in table
    with Image.open(tmp_path / "samples" / "epoch-001.png") as grid:
        assert grid.size == (8 * 32, 8 * 32)  # 8x8 samples of 32x32
    # The grid the README shows is in the folder.
    shown = re.findall(r"\]\((\S+\.png)\)", (EXAMPLES / "dcgan" / "README.md").read_text())
    assert shown and all((EXAMPLES / "dcgan" / p).is_file() for p in shown)


@pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="lightning is not installed (pip install lightning)",
)
def test_lightning_trains_with_parallelkit_sync_batchnorm():
    pytest.importorskip("sklearn")
    cmd = [sys.executable, str(EXAMPLES / "lightning/train.py"), "--epochs", "3"]
    env = {k: v for k, v in ENV.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "batch norm layers: parallelkit.nn.sync_batchnorm.SyncBatchNorm" in proc.stdout
    row = re.search(r"\| 2 \| parallelkit \| 3 \| ([\d.]+) \| ([\d.]+)% \|", proc.stdout)
    assert row, proc.stdout
    assert float(row.group(2)) > 80.0  # 98% measured; chance is 10%
