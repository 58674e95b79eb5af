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
from parallelkit.train.ranks.launch import mpich_available

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1")
QUIET = ["train.progress=false", "train.tensorboard=false", "parallel.timeout=120"]

# What 2 local ranks run on: MPI where mpi4py and MPICH are installed (the test venv), else gloo.
LOCAL = "2 (mpi)" if mpich_available() else "2 (gloo)"


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
    assert table["ranks"] == LOCAL
    assert table["grid (data x depth x rows x cols x channel)"] == "2 x 1 x 1 x 1 x 1"
    assert table["steps"] == "2" and table["test accuracy"].endswith("%")
    assert [r["count"] for r in records(tmp_path, "eval")] == [359]  # every test image once
    assert {"model.pt", "config.yaml", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}


def test_spatial_large_images(tmp_path):
    # 64x64 instead of 512x512: 4 rows per rank at the last stage.
    table = train_example(
        "spatial_large_images", tmp_path, "model.width=8", "data.image_size=64",
        "train.max_steps=2",
    )  # fmt: skip
    assert table["grid (data x depth x rows x cols x channel)"] == "1 x 1 x 2 x 1 x 1"
    # The larger rank's peak resident set in MiB: above what a process with torch keeps
    # resident (~300 MiB; a figure in GiB or of a process that never imported torch falls
    # below 100), and below 1 GiB, since width 8 at 64x64 adds a few MiB of activations (a
    # figure in KiB lands far above). How activation memory divides over ranks is measured
    # in test_segmentation_memory_divides_over_ranks.
    assert 100 < float(table["peak memory per rank, MiB (max)"]) < 1024
    assert len(records(tmp_path, "train")) == 2


def test_channel_parallel(tmp_path):
    pytest.importorskip("sklearn")
    table = train_example(
        "channel_parallel", tmp_path, "model.width=16", "data.image_size=16", "train.max_steps=2"
    )
    assert table["grid (data x depth x rows x cols x channel)"] == "1 x 1 x 1 x 1 x 2"
    assert table["test accuracy"].endswith("%")
    # The export is the whole (gathered) network: it loads into the plain ResNet-18.
    plain = models.create(
        "resnet18", num_classes=10, in_channels=1, stem="imagenet", widths=(16, 32, 64, 128)
    )
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))


def test_dcgan(tmp_path):
    pytest.importorskip("sklearn")
    table = train_example("dcgan", tmp_path, "model.width=8", "train.max_steps=2")
    assert table["ranks"] == LOCAL and "train loss_g" in table
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


def write_store(root: Path, *args: str) -> None:
    """``examples/common/shapes_store.py root args``: generated shapes as zarr arrays."""
    cmd = [sys.executable, str(EXAMPLES / "common/shapes_store.py"), str(root), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def picture(name: str, run_dir: Path, panel: int, *more: str) -> Image.Image:
    """``examples/<name>/picture.py run_dir``: the PNG it wrote, loaded."""
    png = run_dir / "picture.png"
    cmd = [sys.executable, str(EXAMPLES / name / "picture.py"), str(run_dir), "--panel",
           str(panel), "--out", str(png), *more]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = EXAMPLES / name
    shown = re.findall(r"\]\((\S+\.png)\)", (folder / "README.md").read_text())
    assert shown and all((folder / p).is_file() for p in shown)
    with Image.open(png) as sheet:
        sheet.load()
        return sheet


@pytest.mark.timeout(480)
def test_segmentation_large_images(tmp_path):
    # 64x64 instead of 2048x2048, crops of 32: the store, one epoch of training on 2 data
    # ranks, then the README's parallelkit predict on 4 ranks (2 x 2 blocks of each whole test
    # image read from the store) and the picture of its prediction.
    write_store(tmp_path / "data", "--side", "64", "--train", "4", "--test", "2")
    run = tmp_path / "run"
    table = train_example(
        "segmentation_large_images", run, "data.image_size=32", "train.epochs=1",
        f"data.name=zarr:{tmp_path / 'data'}", "train.precise_bn=2",
    )  # fmt: skip
    assert table["grid (data x depth x rows x cols x channel)"] == "2 x 1 x 1 x 1 x 1"
    assert table["task"] == f"segment (unet on zarr:{tmp_path / 'data'})"
    assert table["test mIoU"].split("%")[0].replace(".", "").isdigit()
    assert [r["pixels"] for r in records(run, "eval")] == [2 * 64 * 64]  # every test pixel
    pred = predict_example("segmentation_large_images", run, tmp_path / "pred")
    assert pred["samples"] == 2 and pred["voxels"] == 2 * 64 * 64
    sheet = picture("segmentation_large_images", run, 64, "--prediction", str(tmp_path / "pred"))
    assert sheet.size == (3 * 64 + 2 * 8, 64 + 20 + 20)  # input, mask, prediction; numbers


def predict_example(name: str, run_dir: Path, out: Path) -> dict:
    """The ``parallelkit predict`` command of the example's README on ``run_dir``; its
    ``predict.json``."""
    readme = (EXAMPLES / name / "README.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in readme.splitlines() if "parallelkit predict train.run_dir" in ln)
    keys = [k for k in line.split() if k.startswith("parallel.")]
    assert keys, line
    cmd = [
        sys.executable,
        "-m",
        "parallelkit.cli",
        "predict",
        f"train.run_dir={run_dir}",
        f"predict.output={out}",
        *keys,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "predict.json").read_text())


def measure(tmp_path: Path, *args: str, example: str = "segmentation_large_images") -> dict:
    """examples/<example>/measure.py ``args``, its JSON record."""
    cmd = [sys.executable, str(EXAMPLES / example / "measure.py"), *args, "--width", "4",
           "--timeout", "200", "--out-dir", str(tmp_path), "--store-dir",
           str(tmp_path / "stores")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / f"{args[0]}.json").read_text())


def test_segmentation_memory_divides_over_ranks(tmp_path):
    record = measure(tmp_path, "memory", "--sides", "128", "--ranks", "1", "2")
    one, two = (row["per_rank"] for row in record["rows"])
    assert len(one) == 1 and len(two) == 2
    # 128x128 on 2 ranks: 64 rows each, 8 at the last stage, where the halo rows that the
    # convolutions save beside their block weigh most; 2048x2048: the example's README.
    ratio = max(r["saved_mib"] for r in two) / (one[0]["saved_mib"] / 2)
    assert 1.0 <= ratio < 1.1  # 1.03 measured
    assert record["rows"][1]["ratio"] == pytest.approx(ratio)
    for r in one + two:
        assert sum(r["layers_mib"].values()) == pytest.approx(r["saved_mib"])
        assert r["peak_rss_mib"] > r["runtime_rss_mib"] >= r["cold_rss_mib"]
    # Each rank reads only its rows: 3 x 64 x 128 float32, half the image.
    assert [r["input_mib"] for r in two] == [pytest.approx(3 * 64 * 128 * 4 / 2**20)] * 2
    assert one[0]["input_mib"] == pytest.approx(3 * 128 * 128 * 4 / 2**20)
    assert (tmp_path / "memory.md").read_text().count("| 128 |") == 2


def test_segmentation_budget_is_enforced(tmp_path):
    # 2 ranks within 400 MiB of RLIMIT_DATA each: at 1024x1024 (about 600 MiB a rank) an
    # allocation fails on some rank and the others are stopped; 64x64 trains.
    record = measure(tmp_path, "budget", "--ranks", "2", "--budget-mib", "400", "--sides", "64",
                     "1024")  # fmt: skip
    small, large = record["trials"]
    assert small["fits"] and small["side"] == 64
    assert not large["fits"], large  # measure.py raises on any error but a failed allocation
    assert record["largest_side"] == {"2": 64}


@pytest.mark.timeout(480)
def test_segmentation_volumes(tmp_path):
    # 32^3 volumes in 3 channels, crops of 16^3 (the README: 64^3 crops of 128^3): the store,
    # one epoch on 2 data ranks, the README's parallelkit predict on 8 ranks (2 x 2 x 2 blocks
    # of the whole test volume), the picture, and one step's memory on 1 and 2 ranks.
    pytest.importorskip("monai")
    write_store(
        tmp_path / "data",
        "--dims",
        "3",
        "--side",
        "32",
        "--train",
        "4",
        "--test",
        "1",
        "--channels",
        "3",
    )
    run = tmp_path / "run"
    table = train_example(
        "segmentation_volumes", run, f"data.name=zarr:{tmp_path / 'data'}",
        "data.image_size=16", "train.epochs=1", "train.precise_bn=2",
    )  # fmt: skip
    assert table["grid (data x depth x rows x cols x channel)"] == "2 x 1 x 1 x 1 x 1"
    assert table["steps"] == "1"
    assert [r["pixels"] for r in records(run, "eval")] == [32**3]
    pred = predict_example("segmentation_volumes", run, tmp_path / "pred")
    assert pred["voxels"] == 32**3 and pred["grid (data x depth x rows x cols)"] == "1 x 2 x 2 x 2"
    sheet = picture("segmentation_volumes", run, 32, "--prediction", str(tmp_path / "pred"))
    assert sheet.size == (3 * 32 + 2 * 8, 3 * (32 + 20) + 2 * 8 + 20)  # 3 slices x 3 panels
    record = measure(tmp_path, "memory", "--sides", "32", "--ranks", "1", "2",
                     example="segmentation_volumes")  # fmt: skip
    one, two = (row["per_rank"] for row in record["rows"])
    # Each rank reads only its depth slab of the volume: 16 x 32 x 32 float32.
    assert [r["input_mib"] for r in two] == [pytest.approx(16 * 32 * 32 * 4 / 2**20)] * 2
    ratio = max(r["saved_mib"] for r in two) / (one[0]["saved_mib"] / 2)
    assert 1.0 <= ratio < 1.25, ratio  # at 32^3 the 4^3 bottom carries one halo slice a side
    assert record["rows"][1]["ratio"] == pytest.approx(ratio)


def slurm_commands(script: Path) -> list[tuple[list[str], int]]:
    """Each ``parallelkit train`` line of an sbatch script (continuations joined): its
    arguments, and the ranks it runs on (its ``parallel.ranks``, else the tasks the script asks
    for, times torchrun's processes per node)."""
    text = script.read_text().replace("\\\n", " ")
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    found = []
    for line in text.splitlines():
        words = line.split()
        if "train" not in words or line.lstrip().startswith("#"):
            continue
        args = words[words.index("train") + 1 :]
        ranks = [int(a.split("=")[1]) for a in args if a.startswith("parallel.ranks=")]
        per_node = int(sbatch.get("ntasks-per-node", 1))
        if "--nproc-per-node" in words:
            per_node = int(words[words.index("--nproc-per-node") + 1])
        found.append((args, ranks[0] if ranks else int(sbatch["nodes"]) * per_node))
    return found


@pytest.mark.parametrize("script", sorted((EXAMPLES / "slurm").glob("*.sbatch")), ids=str)
def test_slurm_scripts_pass_the_check(tmp_path, script):
    """Every ``parallelkit train`` of ``examples/slurm/`` passes ``--check`` for the ranks it
    would run on (``bash -n`` first: the script parses)."""
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    commands = slurm_commands(script)
    assert commands, f"{script.name} runs no parallelkit train"
    for args, ranks in commands:
        args = [a for a in args if a != "--check" and not a.startswith("parallel.ranks=")]
        cmd = [sys.executable, "-m", "parallelkit.cli", "train", "--check", *args,
               f"parallel.ranks={ranks}", f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        assert proc.returncode == 0, (script.name, args, proc.stderr)
        assert f"check passed for {ranks} ranks" in proc.stdout
