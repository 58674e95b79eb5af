"""``parallelkit train parallel.backend=xla`` as a user runs it: torch_xla.launch, one XLA CPU
device, MpDeviceLoader; its loss curve equals the same run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import XLA_ENV

RUN = [
    "parallel.ranks=1", "data.name=synthetic", "data.image_size=16", "data.train_samples=64",
    "data.test_samples=32", "model.width=4", "model.stem=cifar", "train.batch_size=16",
    "train.epochs=1", "train.log_every=1", "train.progress=false", "train.tensorboard=false",
]  # fmt: skip


def losses(run_dir: Path, *overrides: str) -> tuple[list[float], str]:
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", f"train.run_dir={run_dir}", *RUN]
    proc = subprocess.run(
        [*cmd, *overrides], capture_output=True, text=True, timeout=600,
        env={**os.environ, **XLA_ENV, "CPU_NUM_DEVICES": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["kind"] == "train"], proc.stdout


def test_train_on_xla_equals_cpu(tmp_path):
    cpu, _ = losses(tmp_path / "cpu", "parallel.backend=local")
    xla, table = losses(tmp_path / "xla", "parallel.backend=xla")
    assert "1 (xla)" in table  # the run really was on the XLA device
    assert len(xla) == 4 and len(set(xla)) == 4  # it trained
    torch.testing.assert_close(torch.tensor(xla), torch.tensor(cpu), rtol=1e-4, atol=1e-5)
