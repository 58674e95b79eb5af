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


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", f"train.run_dir={run_dir}", *RUN]
    return subprocess.Popen(
        [*cmd, *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **XLA_ENV, "CPU_NUM_DEVICES": "1"},
    )  # fmt: skip


def losses(run_dir: Path, proc: subprocess.Popen) -> tuple[list[float], str]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["kind"] == "train"], stdout


def test_train_on_xla_equals_cpu(tmp_path):
    # Both at once, one core each.
    procs = {name: start(tmp_path / name, f"parallel.backend={backend}")
             for name, backend in (("cpu", "local"), ("xla", "xla"))}  # fmt: skip
    try:
        cpu, _ = losses(tmp_path / "cpu", procs["cpu"])
        xla, table = losses(tmp_path / "xla", procs["xla"])
    finally:
        for proc in procs.values():
            proc.kill()
    assert "1 (xla)" in table  # the run really was on the XLA device
    assert len(xla) == 4 and len(set(xla)) == 4  # it trained
    torch.testing.assert_close(torch.tensor(xla), torch.tensor(cpu), rtol=1e-4, atol=1e-5)
