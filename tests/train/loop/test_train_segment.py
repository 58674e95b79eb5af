"""``parallelkit train train.task=segment`` end to end, run as a user runs it: a subprocess.

The central check, as tests/train/loop/test_trainer.py makes it for classification: for a fixed
seed and global batch, the loss curve of every strategy (data, spatial 2x1 and 2x2, channel,
data x rows) equals the 1-process curve, and so do the test loss, mIoU and pixel accuracy. Under
spatial parallelism the loss and the metrics are computed on each rank's block of the logits and
masks and reduced; equal numbers mean the reduction is exact. Then masks from WebDataset shards,
the final table, and the task's config errors.
"""

from __future__ import annotations

import importlib.util

import pytest
from runs import SEGMENT_TINY as TINY
from runs import assert_curves_equal, curve, records, train, train_all

from parallelkit.data import shard_main

METRICS = ("loss", "miou", "pixel_accuracy", "count", "pixels")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The 1-process runs of this module, computed once, two at a time."""
    root = tmp_path_factory.mktemp("segment")
    runs = {"one": TINY, "seed1": [*TINY, "train.seed=1"],
            "accumulate": [*TINY, "train.accumulate=2"]}  # fmt: skip
    procs = train_all({k: (root / k, [*o, "parallel.ranks=1"]) for k, o in runs.items()})
    return {k: (root / k, procs[k]) for k in runs}


@pytest.fixture(scope="module")
def reference(one_rank):
    """The 1-process run: (run_dir, completed process)."""
    return one_rank["one"]


def evaluation(run) -> dict:
    (last,) = [r for _, r in sorted(records(run, "eval").items())][-1:]
    return {k: last[k] for k in METRICS}


def test_the_curve_moves_and_the_table_reports_miou(reference):
    run, proc = reference
    loss = curve(run)
    assert len(loss) == 4 and len(set(loss)) == 4 and loss[-1] < loss[0]
    assert "test mIoU" in proc.stdout and "test pixel accuracy" in proc.stdout
    got = evaluation(run)
    assert got["count"] == 12 and got["pixels"] == 12 * 16 * 16
    assert 0 <= got["miou"] <= 1 and (run / "model.pt").is_file()


@pytest.mark.parametrize(
    ("ranks", "grid"),
    [
        (2, ["parallel.strategy=data"]),
        (2, ["parallel.strategy=spatial"]),
        (4, ["parallel.strategy=spatial", "parallel.rows=2", "parallel.cols=2"]),
        (2, ["parallel.strategy=channel"]),
        (4, ["parallel.strategy=hybrid", "parallel.rows=2"]),
    ],
    ids=["data2", "rows2", "spatial2x2", "channel2", "data2xrows2"],
)
def test_loss_curve_and_metrics_equal_one_process(tmp_path, reference, ranks, grid):
    # Blocks of columns are reduced in spatial2x2 (and a 1 x 2 grid in the pool tiers'
    # spatial_output="blocks" cases), rows alone in rows2: a separate 1 x 2 run repeated both.
    train(tmp_path, *TINY, *grid, f"parallel.ranks={ranks}")
    one, _ = reference
    assert_curves_equal(curve(tmp_path), curve(one))
    got, want = evaluation(tmp_path), evaluation(one)
    assert got["count"] == want["count"] and got["pixels"] == want["pixels"]
    for key in ("loss", "miou", "pixel_accuracy"):
        assert got[key] == pytest.approx(want[key], rel=2e-4, abs=1e-5), key


def test_negative_control_other_seed_differs(one_rank, reference):
    assert abs(curve(one_rank["seed1"][0])[-1] - curve(reference[0])[-1]) > 1e-3


def test_accumulation_on_spatial_ranks(tmp_path, one_rank):
    # Classification on spatial ranks with accumulation: tests/train/loop/test_trainer.py
    # (test_accumulation_on_two_ranks[spatial]), against that module's 1-process curve.
    train(tmp_path, *TINY, "train.accumulate=2", "parallel.strategy=spatial", "parallel.ranks=2")
    assert_curves_equal(curve(tmp_path), curve(one_rank["accumulate"][0]))


def test_masks_from_shards_on_spatial_ranks(tmp_path):
    """`parallelkit data shard shapes`, then training on the shards with each rank decoding
    its block of every mask."""
    shards = tmp_path / "shards"
    # In this process: the command only hands its arguments to shard_main, and
    # test_trainer.py's webdataset test runs it as a command.
    assert shard_main(["shapes", str(shards), "--samples-per-shard", "10", "--image-size", "16",
                       "--train-samples", "32", "--test-samples", "12"]) == 0  # fmt: skip
    data = ["data.name=webdataset", f"data.root={shards}"]
    train(tmp_path / "one", *TINY, *data, "parallel.ranks=1")
    train(tmp_path / "two", *TINY, *data, "parallel.strategy=spatial", "parallel.ranks=2")
    assert_curves_equal(curve(tmp_path / "two"), curve(tmp_path / "one"))
    assert evaluation(tmp_path / "two")["count"] == 12


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.name=digits"], "train.task=segment needs masks"),
        (["model.name=resnet18"], "resnet18 is a classify model"),
        (["model.name=torchvision:fcn_resnet50"], "needs torchvision, which is not installed"),
        (["data.num_classes=1"], "data.num_classes=1 must lie in 2..255"),
    ],
)
def test_config_errors_exit_2(tmp_path, overrides, message):
    if "torchvision" in overrides[0] and importlib.util.find_spec("torchvision"):
        pytest.skip("torchvision is installed here (the missing-library case is .venv's)")
    proc = train(tmp_path, *TINY, *overrides, ok=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
