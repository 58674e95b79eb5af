"""A user's own network by import path (``model.name=package.module:Class``), the way a user
with a module beside their data would train it: from that directory, no registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from parallelkit.models import create, imported

NETS = """
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, in_channels, num_classes, width=4):
        super().__init__()
        self.width = width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)


def tiny(in_chans, classes, width=4):
    return TinyNet(in_chans, classes, width)


NOT_A_MODEL = 3
from subprocess import run  # noqa: E402  (a standard-library function this module holds)
"""
QUIET = ["data.image_size=16", "data.channels=1", "train.batch_size=16", "train.max_steps=3",
         "train.log_every=1", "train.progress=false", "train.tensorboard=false",
         "train.plot=false", "parallel.timeout=120"]  # fmt: skip


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A working directory holding ``mynets.py``, imported afresh (other tests may have
    imported a module of that name from elsewhere)."""
    (tmp_path / "mynets.py").write_text(NETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mynets", raising=False)
    yield tmp_path
    sys.modules.pop("mynets", None)


def test_channels_and_classes_go_where_the_constructor_takes_them(user_dir):
    net = create("mynets:TinyNet", num_classes=7, in_channels=2, width=8)
    assert net.body[0].in_channels == 2 and net.body[-1].out_features == 7 and net.width == 8
    net = create("mynets:tiny", num_classes=5, in_channels=1)  # in_chans, classes
    assert net.body[0].in_channels == 1 and net.body[-1].out_features == 5
    assert imported.is_import_path("mynets:TinyNet") and not imported.is_import_path("timm:x")


NAMES_CODE = "a config names a Module class or a function of your own that returns one"


@pytest.mark.parametrize(
    ("name", "message"),
    [("nosuchmodule:Net", "module 'nosuchmodule' does not import"),
     ("mynets:Nope", "mynets has no 'Nope'"), ("mynets:NOT_A_MODEL", f"is a int: {NAMES_CODE}"),
     ("mynets:run", "the standard library's function subprocess.run"),
     ("subprocess:Popen", "names Python's standard library (subprocess)"),
     ("torch.utils.data:Dataset", f"the class torch.utils.data.dataset.Dataset: {NAMES_CODE}")],
)  # fmt: skip
def test_bad_import_paths_are_config_errors(user_dir, name, message):
    proc = subprocess.run(
        [sys.executable, "-m", "parallelkit.cli", "train", "--check", f"model.name={name}",
         "model.kwargs={args: [touch, made]}"],
        capture_output=True, text=True, timeout=120, cwd=user_dir,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (user_dir / "made").exists()


def test_a_run_directory_cannot_make_predict_run_code(user_dir):
    """A trained run whose ``config.yaml`` is then edited to name other code than a model:
    ``parallelkit predict`` refuses it in one line, and nothing it names is called."""
    run = user_dir / "run"
    train_curve(user_dir, "run", *SEGMENT, "train.max_steps=1", "parallel.ranks=1")
    np.save(user_dir / "scan.npy", np.zeros((1, 16, 16), np.float32))
    text = (run / "config.yaml").read_text()
    for name in ("subprocess:Popen", "mynets:run"):
        edited = text.replace("name: unet", f"name: '{name}'").replace(
            "kwargs: {}", "kwargs: {args: [touch, made]}", 1)
        assert edited.count(name) == 1 and "touch" in edited
        (run / "config.yaml").write_text(edited)
        proc = subprocess.run(
            [sys.executable, "-m", "parallelkit.cli", "predict", f"train.run_dir={run}",
             f"predict.output={user_dir / 'out'}", f"predict.input={user_dir / 'scan.npy'}"],
            capture_output=True, text=True, timeout=120, cwd=user_dir,
        )  # fmt: skip
        assert proc.returncode == 2 and "not other code" in proc.stderr, proc.stderr
        assert not (user_dir / "made").exists()


def train_curve(user_dir: Path, name: str, *overrides: str) -> list[float]:
    """``parallelkit train`` from ``user_dir`` into ``user_dir/name``; its training losses."""
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", *overrides,
           f"train.run_dir={user_dir / name}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=user_dir,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(user_dir / name)


def losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_trains_split_over_two_ranks_as_on_one(user_dir):
    """The user's network under spatial parallelism on 2 ranks gives the 1-rank loss curve."""
    curves = []
    for ranks in (1, 2):
        curves.append(train_curve(user_dir, f"run{ranks}", "model.name=mynets:TinyNet",
                                  "model.kwargs={width: 8}", f"parallel.ranks={ranks}",
                                  "parallel.strategy=spatial", *QUIET))  # fmt: skip
    assert len(curves[0]) == 3 and curves[0][0] != curves[0][-1]  # it trains
    assert curves[0] == pytest.approx(curves[1], rel=1e-4, abs=1e-5)
    assert isinstance(create("mynets:TinyNet", num_classes=2), nn.Module)


LOSSES = '''
import torch.nn.functional as F


def ce(logits, masks):
    return F.cross_entropy(logits, masks, ignore_index=255)
'''
SEGMENT = ["train.task=segment", "model.width=4", "data.image_size=16", "data.train_samples=16",
           "data.test_samples=4", "train.batch_size=8", "train.max_steps=3", "train.log_every=1",
           "train.progress=false", "train.tensorboard=false", "train.plot=false",
           "parallel.timeout=120"]  # fmt: skip


def test_own_loss_on_two_data_ranks_as_on_one(user_dir):
    """``train.loss=mylosses:ce`` (cross-entropy written by the user): on 1 rank the built-in
    ``ce`` curve, on 2 data ranks the same curve; refused in one line under spatial."""
    (user_dir / "mylosses.py").write_text(LOSSES)
    curves = {}
    for name, extra in (("ce", ["train.loss=ce", "parallel.ranks=1"]),
                        ("own", ["train.loss=mylosses:ce", "parallel.ranks=1"]),
                        ("own2", ["train.loss=mylosses:ce", "parallel.ranks=2"])):  # fmt: skip
        curves[name] = train_curve(user_dir, name, *SEGMENT, *extra)
    assert len(set(curves["ce"])) == 3
    assert curves["own"] == pytest.approx(curves["ce"], rel=1e-6)
    assert curves["own2"] == pytest.approx(curves["ce"], rel=1e-4, abs=1e-5)
    proc = subprocess.run(
        [sys.executable, "-m", "parallelkit.cli", "train", "--check", *SEGMENT,
         "train.loss=mylosses:ce", "parallel.strategy=spatial"],
        capture_output=True, text=True, timeout=120, cwd=user_dir,
    )  # fmt: skip
    assert proc.returncode == 2 and "needs whole logits" in proc.stderr, proc.stderr


DATA = '''
import numpy as np
from torch.utils.data import Dataset

from parallelkit.data.shapes import ShapesDataset


class Scenes(Dataset):
    """Whole generated scenes and masks, as numpy arrays (a user's own reader would be here)."""

    def __init__(self, split, count=16, size=16):
        self.inner = ShapesDataset(count, size, 3, 4, base=0 if split == "train" else 1000)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        image, mask = self.inner[i]
        return image.numpy(), mask.numpy().astype(np.uint8)
'''


def test_own_dataset_split_over_two_ranks_as_on_one(user_dir):
    """``data.name=mydata:Scenes data.kwargs={count: 16}``: 2 spatial ranks (each keeping its
    block of every mask) give the 1-rank curve and test scores."""
    (user_dir / "mydata.py").write_text(DATA)
    base = [*SEGMENT, "data.name=mydata:Scenes", "data.kwargs={count: 16}", "data.num_classes=4"]
    runs = {}
    for name, extra in (("one", ["parallel.ranks=1"]),
                        ("two", ["parallel.strategy=spatial", "parallel.ranks=2"])):  # fmt: skip
        runs[name] = train_curve(user_dir, name, *base, *extra)
    assert len(set(runs["one"])) == 3
    assert runs["two"] == pytest.approx(runs["one"], rel=1e-4, abs=1e-5)
    proc = subprocess.run(
        [sys.executable, "-m", "parallelkit.cli", "train", "--check", *base,
         "data.kwargs={counts: 3}"],
        capture_output=True, text=True, timeout=120, cwd=user_dir,
    )  # fmt: skip
    assert proc.returncode == 2 and "unexpected keyword argument 'counts'" in proc.stderr
