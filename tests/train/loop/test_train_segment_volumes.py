"""``parallelkit train train.task=segment`` on volumes, run as a user runs it: a subprocess.

A MONAI 3-D U-Net (``model.name=monai:UNet``, BatchNorm3d, so SyncBatchNorm under the data
strategy) on generated volumes (``data.name=shapes3d``, 16^3) and on a folder of ``.npy``
volumes and masks (``segfolder3d``). The central check, as in
tests/train/loop/test_train_segment.py: for a fixed seed and global batch, the loss curve and
the test loss, mIoU and voxel accuracy of 2 data-parallel ranks, of 2 channel ranks (whose
Conv3d layers are split), and of 2 and 4 spatial ranks (every volume split over D, and over D
and W) equal the 1-process ones; another seed's curve does not (negative control).
"""

from __future__ import annotations

import numpy as np
import pytest
from runs import assert_curves_equal, curve, records, train, train_all

from parallelkit.data.shapes3d import ShapesVolumeDataset

pytest.importorskip("monai")

TINY = [
    "train.task=segment",
    "data.name=shapes3d",
    "data.image_size=16",
    "data.channels=1",
    "data.num_classes=3",
    "data.train_samples=16",
    "data.test_samples=6",
    "model.name=monai:UNet",
    "model.kwargs={channels: [4, 8], strides: [2], num_res_units: 1, norm: batch}",
    "train.batch_size=4",
    "train.max_steps=4",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
    "optim.lr=0.2",
]
METRICS = ("loss", "miou", "pixel_accuracy", "count", "pixels")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The 1-process runs of this module, computed once, two at a time."""
    root = tmp_path_factory.mktemp("volumes")
    runs = {"one": TINY, "seed1": [*TINY, "train.seed=1"]}
    procs = train_all({k: (root / k, [*o, "parallel.ranks=1"]) for k, o in runs.items()})
    return {k: (root / k, procs[k]) for k in runs}


def evaluation(run) -> dict:
    (last,) = [r for _, r in sorted(records(run, "eval").items())][-1:]
    return {k: last[k] for k in METRICS}


def assert_same_run(got_dir, want_dir) -> None:
    assert_curves_equal(curve(got_dir), curve(want_dir))
    got, want = evaluation(got_dir), evaluation(want_dir)
    assert got["count"] == want["count"] and got["pixels"] == want["pixels"]
    for key in ("loss", "miou", "pixel_accuracy"):
        assert got[key] == pytest.approx(want[key], rel=2e-4, abs=1e-5), key


def test_the_curve_moves_and_every_voxel_is_counted(one_rank):
    run, proc = one_rank["one"]
    loss = curve(run)
    assert len(loss) == 4 and len(set(loss)) == 4 and loss[-1] < loss[0]
    assert "segment (monai:UNet on shapes3d)" in proc.stdout
    got = evaluation(run)
    assert got["count"] == 6 and got["pixels"] == 6 * 16**3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["data", "channel"])
def test_two_ranks_give_the_one_process_curve(tmp_path, one_rank, strategy):
    train(tmp_path, *TINY, f"parallel.strategy={strategy}", "parallel.ranks=2")
    assert_same_run(tmp_path, one_rank["one"][0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid", [["parallel.depth=2"], ["parallel.depth=2", "parallel.cols=2"]])
def test_volumes_split_over_depth_give_the_one_process_curve(tmp_path, one_rank, grid):
    """Every volume split over D (then over D and W on 4 ranks): each rank holds its block of
    every activation and reads only its block of every mask; the loss, computed on blocks,
    and the metrics are the 1-process ones."""
    ranks = 2 * len(grid)
    train(tmp_path, *TINY, "parallel.strategy=spatial", *grid, f"parallel.ranks={ranks}")
    assert_same_run(tmp_path, one_rank["one"][0])


def test_negative_control_other_seed_differs(one_rank):
    assert abs(curve(one_rank["seed1"][0])[-1] - curve(one_rank["one"][0])[-1]) > 1e-3


def _write_folder(root, split: str, count: int, base: int) -> None:
    """``count`` generated volumes at 20^3 (resized to 16^3 on reading) as .npy files."""
    (root / split / "images").mkdir(parents=True)
    (root / split / "masks").mkdir(parents=True)
    ds = ShapesVolumeDataset(count, image_size=20, channels=1, num_classes=3, base=base)
    for i in range(count):
        volume, mask = ds[i]
        np.save(root / split / "images" / f"v{i:02d}.npy", (volume[0] * 500).numpy())
        np.save(root / split / "masks" / f"v{i:02d}.npy", mask.numpy().astype(np.uint8))


@pytest.mark.timeout(300)
def test_a_folder_of_volumes_on_two_data_ranks(tmp_path):
    _write_folder(tmp_path / "data", "train", 16, 0)
    _write_folder(tmp_path / "data", "test", 6, 1000)
    data = ["data.name=segfolder3d", f"data.root={tmp_path / 'data'}"]
    train_all({
        "one": (tmp_path / "one", [*TINY, *data, "parallel.ranks=1"]),
        "two": (tmp_path / "two", [*TINY, *data, "parallel.strategy=data", "parallel.ranks=2"]),
    })  # fmt: skip
    assert_same_run(tmp_path / "two", tmp_path / "one")
    assert evaluation(tmp_path / "one")["pixels"] == 6 * 16**3
