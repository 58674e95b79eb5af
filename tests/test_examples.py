"""The examples, run the way their README says (shorter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallelkit.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_digits_allreduce_learns_on_two_ranks():
    pytest.importorskip("sklearn")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(ROOT / "examples/digits_allreduce/train.py"),
        "--epochs", "4",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    row = re.search(r"\| 2 \| gloo \| 4 \| ([\d.]+)% \|", proc.stdout)
    assert row, proc.stdout
    assert float(row.group(1)) > 90.0
