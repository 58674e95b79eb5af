"""Small frictions met on the way to a prediction, as a user meets them:

- ``parallelkit plan --config RUN/config.yaml`` plans a run whose model is the user's own
  (``model.name=mynets:SegNet``), and ``plan --help`` lists ``--config``;
- ``tiff:`` images with PNG masks: the refusal names the PNG as the cause.
(``pk.Predictor(normalize=RUN)`` and ``.ome.zarr`` names: ``tests/train/predict/test_level.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import tifffile

NETS = """
from torch import nn


class SegNet(nn.Module):
    def __init__(self, in_channels, num_classes, width=4):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, num_classes, 3, padding=1))

    def forward(self, x):
        return self.body(x)
"""


def _cli(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(cwd))
    return subprocess.run([sys.executable, "-m", "parallelkit.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)  # fmt: skip


def test_plan_takes_a_config_whose_model_is_the_users_own(tmp_path):
    (tmp_path / "mynets.py").write_text(NETS)
    config = tmp_path / "config.yaml"
    config.write_text("model: {name: 'mynets:SegNet'}\ntrain: {task: segment, batch_size: 4}\n"
                      "data: {num_classes: 3, channels: 1, image_size: 32}\n"
                      "parallel: {ranks: 2}\n")  # fmt: skip
    proc = _cli("plan", "--config", str(config), "--flop-rate", "1000", "--bandwidth", "10",
                "--latency", "5", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "train on it with: parallel.ranks=2" in proc.stdout
    helped = _cli("plan", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--config RUN.yaml" in helped.stdout


def test_png_masks_beside_tiff_images_are_named_as_the_cause(tmp_path):
    data = tmp_path / "slides"
    for split in ("train", "test"):
        (data / split / "images").mkdir(parents=True)
        (data / split / "masks").mkdir(parents=True)
        tifffile.imwrite(data / split / "images" / "slide0.tif", np.zeros((32, 32), np.uint8))
        (data / split / "masks" / "slide0.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    proc = _cli("train", f"train.run_dir={tmp_path / 'run'}", "train.task=segment",
                f"data.name=tiff:{data}", "data.num_classes=2", "data.channels=1",
                "data.image_size=16", "train.max_steps=1", "parallel.ranks=1",
                cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "slide0.png is there" in errors[0], proc.stderr[-3000:]
    assert "block format" in errors[0]
