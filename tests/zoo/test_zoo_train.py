"""``parallelkit train`` on models of other libraries named in the config, end to end.

``model.name=torchvision:NAME``, ``timm:NAME`` and ``smp:ARCH`` build the library's model with
random weights (nothing downloads: conftest sets HF_HUB_OFFLINE). Each is trained the way a
user would, by ``parallelkit train`` in a subprocess, on 1 process and under one parallel
strategy, and the loss curves must agree (the strategies' exactness for every architecture is
test_zoo.py's business; this is the path from a name in a config to a trained model). Three
models, one of each library, one task and strategy each, to keep the tier's time small:

    torchvision:resnet18   classify   spatial (2 rows)
    timm:resnet18          classify   channel (2)
    smp:Unet (resnet18)    segment    data x rows (2 x 2), loss and mIoU on blocks; a
                                      shallow encoder, so parallel.find_unused_parameters

The zoo environment has no scikit-learn (digits), so the data are generated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallelkit.train import config

COMMON = [
    "train.batch_size=8",
    "train.max_steps=3",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
    "data.train_samples=32",
    "data.test_samples=8",
    "optim.lr=0.1",
]
# float32 rounding grows step by step with the rate: at lr 0.1, torchvision's resnet18 under
# spatial moved 1e-7, 1.5e-5 and 4.4e-4 (relative) from the 1-process loss at steps 0-2, and
# one of 8 test images changed class; at 0.02, 4e-6 and 3e-5. (Exactness is test_zoo.py's, in
# float64.)
CLASSIFY = [*COMMON, "optim.lr=0.02", "data.name=synthetic", "data.num_classes=4",
            "data.image_size=64"]  # fmt: skip
SEGMENT = [
    *COMMON, "train.task=segment", "data.image_size=32", "model.name=smp:Unet",
    "model.kwargs={encoder_name: resnet18, encoder_depth: 3, decoder_channels: [16, 8, 8]}",
    "parallel.find_unused_parameters=true",  # encoder_depth 3 keeps resnet18's layer3 and 4
]  # fmt: skip
CASES = {
    "torchvision": (
        [*CLASSIFY, "model.name=torchvision:resnet18"], 2, ["parallel.strategy=spatial"]
    ),
    "timm": ([*CLASSIFY, "model.name=timm:resnet18"], 2, ["parallel.strategy=channel"]),
    "smp": (SEGMENT, 4, ["parallel.strategy=hybrid", "parallel.rows=2"]),
}  # fmt: skip


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", f"train.run_dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("library", list(CASES))
def test_model_by_name_trains_like_one_process(tmp_path, library):
    overrides, ranks, strategy = CASES[library]
    train(tmp_path / "one", *overrides, "parallel.ranks=1")
    train(tmp_path / "many", *overrides, *strategy, f"parallel.ranks={ranks}")
    one, many = records(tmp_path / "one", "train"), records(tmp_path / "many", "train")
    want = torch.tensor([r["loss"] for r in one])
    assert len(want) == 3 and len(set(want.tolist())) == 3  # it trains
    torch.testing.assert_close(torch.tensor([r["loss"] for r in many]), want, rtol=2e-4, atol=1e-5)
    (a,), (b,) = records(tmp_path / "one", "eval"), records(tmp_path / "many", "eval")
    for key in ("loss", "accuracy", "miou", "pixel_accuracy"):
        if key in a:
            assert b[key] == pytest.approx(a[key], rel=2e-4, abs=1e-5), key


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("timm:resnet_nope", "timm has no model 'resnet_nope'"),
        ("torchvision:resnt18", "torchvision has no model 'resnt18'; similar names: ['resnet18'"),
        ("smp:Unetz", "smp has no model 'unetz'"),
    ],
)
def test_unknown_name_is_a_config_error(name, message):
    # In this process: the command turns the same ValueError into exit status 2 (that path
    # is tested in .venv, tests/train/loop/test_train_segment.py, with torchvision missing).
    task = ["train.task=segment"] if name.startswith("smp") else []
    with pytest.raises(ValueError, match=re.escape(message)):
        config.load(None, [*task, f"model.name={name}"])
