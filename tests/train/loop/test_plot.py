"""``curves.png``: the curves of a run drawn from its ``metrics.jsonl`` (matplotlib optional)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from parallelkit.cli import main
from parallelkit.train.loop.plot import plot_run, series

RECORDS = [
    {"kind": "train", "step": 1, "loss": 2.0, "lr": 0.1},
    {"kind": "train", "step": 2, "loss": 1.5},
    {
        "kind": "eval",
        "step": 2,
        "loss": 1.4,
        "miou": 0.3,
        "mdice": 0.4,
        "pixel_accuracy": 0.8,
        "iou": [0.3],
    },
    {"kind": "train", "step": 2, "loss": 1.25},  # a resumed run logged step 2 again
    {"kind": "summary", "step": 2, "seconds": 3.0},
]


def write(run_dir):
    lines = [json.dumps(r) for r in RECORDS] + ['{"kind": "tra']  # and a torn last line
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_series_reads_losses_and_metrics(tmp_path):
    write(tmp_path)
    got = series(tmp_path)
    assert got["train"] == {"loss": [(1, 2.0), (2, 1.25)]}
    assert got["eval"] == {
        "loss": [(2, 1.4)],
        "miou": [(2, 0.3)],
        "mdice": [(2, 0.4)],
        "pixel_accuracy": [(2, 0.8)],
    }


def test_plot_writes_a_png_or_says_why_not(tmp_path, capsys):
    write(tmp_path)
    status = main(["plot", str(tmp_path)])
    out = capsys.readouterr()
    if importlib.util.find_spec("matplotlib") is None:
        assert status == 1 and "matplotlib is not installed" in out.err
        pytest.skip("no matplotlib here: the picture itself is not drawn")
    assert status == 0 and (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "no training records" in plot_run(tmp_path / "empty")
