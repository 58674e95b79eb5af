"""``parallelkit train`` end to end, run the way a user runs it: the command in a subprocess.

The central check: for a fixed seed and global batch, the loss curve of every strategy on 1, 2
and 4 ranks equals the 1-process curve. Then resume exactness, a rank that dies, evaluation
that counts every test image once, the GAN task, and clear errors.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import TINY, assert_curves_equal, curve, records, train, train_all

from parallelkit.data import DataConfig, build_loader
from parallelkit.train.ranks.launch import local_mpi

GAN = [
    "train.task=gan",
    "model.name=dcgan",
    "model.width=4",
    "model.nz=8",
    "data.image_size=16",
    "data.channels=1",
    "train.batch_size=16",
    "train.max_steps=3",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
    "parallel.timeout=120",
    "optim.name=adam",
    "optim.lr=2e-4",
    "optim.scale_lr=false",
    "optim.betas=[0.5,0.999]",
    "optim.warmup_epochs=0",
    "optim.schedule=constant",
    "optim.weight_decay=0",
]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))



@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every 1-process run of this module, computed once, two at a time."""
    root = tmp_path_factory.mktemp("one_rank")
    runs = {
        "classify": TINY,
        "accumulate": [*TINY, "train.accumulate=2"],
        "lars": [*TINY, "optim.name=lars", "optim.lr=2.0"],
        "gan": GAN,
        "seed1": [*TINY, "train.seed=1"],
        "bf16": [
            *TINY, "train.precision=bf16", "train.progress=true", "train.tensorboard=true",
            "train.plot=true",
        ],
    }
    procs = train_all({k: (root / k, [*o, "parallel.ranks=1"]) for k, o in runs.items()})
    return {k: (root / k, procs[k]) for k in runs}


@pytest.fixture(scope="module")
def reference(one_rank) -> dict[str, list[float]]:
    """1-process curves."""
    out = {name: curve(one_rank[name][0]) for name in ("classify", "accumulate", "lars")}
    gan = one_rank["gan"][0]
    out["gan_d"], out["gan_g"] = curve(gan, "loss_d"), curve(gan, "loss_g")
    return out



def test_the_curve_moves(reference):
    # The comparisons below would pass vacuously if nothing trained.
    loss = reference["classify"]
    assert len(loss) == 4 and len(set(loss)) == 4


@pytest.mark.parametrize(
    ("ranks", "grid"),
    [
        (2, ["parallel.strategy=data"]),
        (4, ["parallel.strategy=spatial", "parallel.rows=2", "parallel.cols=2"]),
        (2, ["parallel.strategy=channel"]),
        (4, ["parallel.strategy=hybrid", "parallel.rows=2"]),
        (4, ["parallel.strategy=hybrid", "parallel.channel=2"]),
    ],
    ids=["data2", "spatial2x2", "channel2", "data2xrows2", "data2xchannel2"],
)
def test_loss_curve_equals_one_process(tmp_path, reference, ranks, grid):
    # (4 data ranks are left out: data2 and the data x model grids, with uneven shards of the
    # test set on 2 ranks, prove the data dimension; the pool tiers run DataParallel on 1-4.
    # Spatial alone on 2 ranks (a 2 x 1 grid) is test_accumulation_on_two_ranks[spatial]: its
    # last micro-batch takes the synchronised step a run without accumulation takes, so a
    # separate 2 x 1 run here repeated it.)
    train(tmp_path, *TINY, *grid, f"parallel.ranks={ranks}")
    assert_curves_equal(curve(tmp_path), reference["classify"])
    assert_counted_once_and_exported(tmp_path)


def assert_counted_once_and_exported(run_dir: Path) -> None:
    """Every test image counted once, whatever the grid; the dense export loads."""
    evals = records(run_dir, "eval")
    test = build_loader(
        DataConfig(image_size=16, channels=1), "test", rank=0, size=1, batch_size=16
    )
    assert [r["count"] for r in evals.values()] == [test.num_samples]
    assert_dense_export(run_dir)


def assert_dense_export(run_dir: Path) -> None:
    """model.pt, whatever the grid (channel shards gathered), loads into the plain model."""
    from parallelkit import models

    plain = models.create(
        "resnet18", num_classes=10, in_channels=1, stem="cifar", widths=(4, 8, 16, 32)
    )
    plain.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    assert (run_dir / "config.yaml").is_file()


def test_negative_control_other_seed_differs(one_rank, reference):
    assert abs(curve(one_rank["seed1"][0])[-1] - reference["classify"][-1]) > 1e-3


@pytest.mark.parametrize("strategy", ["data", "spatial"])
def test_accumulation_on_two_ranks(tmp_path, reference, strategy):
    # spatial: each micro-batch's gradients are summed over the rows' ranks, not only the last.
    train(tmp_path, *TINY, "train.accumulate=2", f"parallel.strategy={strategy}",
          "parallel.ranks=2")  # fmt: skip
    assert_curves_equal(curve(tmp_path), reference["accumulate"])
    assert curve(tmp_path) != reference["classify"]  # accumulation changed BatchNorm batches
    assert_counted_once_and_exported(tmp_path)


def test_lars_on_channel_shards(tmp_path, reference):
    # The trust ratio of a channel-split weight uses the norm of the whole weight.
    train(tmp_path, *TINY, "optim.name=lars", "optim.lr=2.0", "parallel.strategy=channel")
    assert_curves_equal(curve(tmp_path), reference["lars"])


@pytest.mark.parametrize("strategy", ["data", "spatial", "channel"])
def test_gan_curves(tmp_path, reference, strategy):
    train(tmp_path, *GAN, f"parallel.strategy={strategy}", "parallel.ranks=2")
    assert_curves_equal(curve(tmp_path, "loss_d"), reference["gan_d"])
    assert_curves_equal(curve(tmp_path, "loss_g"), reference["gan_g"])
    assert (tmp_path / "samples" / "epoch-001.png").is_file()
    assert {p.name for p in tmp_path.glob("*.pt")} == {"generator.pt", "discriminator.pt"}


def test_ranks_started_as_new_processes(tmp_path, reference):
    # Local CPU ranks are forks of the launcher; with PARALLELKIT_FORK_RANKS=0 each is a new
    # Python, as GPU ranks always are. Same curve, same test images, same export.
    proc = train(tmp_path, *TINY, "parallel.ranks=2", PARALLELKIT_FORK_RANKS="0")
    assert "2 local ranks started by parallelkit (processes)" in proc.stdout
    assert_curves_equal(curve(tmp_path), reference["classify"])
    assert [r["count"] for r in records(tmp_path, "eval").values()] == [359]
    assert_dense_export(tmp_path)


def test_compiled_training_gives_the_eager_curve(tmp_path, reference):
    # torch.compile'd steps and evaluation (aot_eager: dynamo's graphs and their backward,
    # without inductor's code generation, minutes on this machine) on 2 data ranks.
    train(tmp_path, *TINY, "train.compile=true", "train.compile_backend=aot_eager",
          "parallel.ranks=2")  # fmt: skip
    assert_curves_equal(curve(tmp_path), reference["classify"])
    assert [r["count"] for r in records(tmp_path, "eval").values()] == [359]
    assert_dense_export(tmp_path)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
@pytest.mark.skipif(local_mpi("auto", False, 2), reason="auto picks MPI here: "
                    "test_loss_curve_equals_one_process[data2] is this run")  # fmt: skip
def test_mpi_backend(tmp_path, reference):
    train(tmp_path, *TINY, "parallel.backend=mpi", "parallel.ranks=2")
    assert_curves_equal(curve(tmp_path), reference["classify"])


def test_resume_is_exact_after_a_rank_dies(tmp_path):
    run = [
        *TINY,
        "train.max_steps=6",
        "train.checkpoint_every=2",
        "parallel.ranks=2",
        "parallel.timeout=600",
    ]
    train(tmp_path / "whole", *run)

    start = time.monotonic()
    proc = train(tmp_path / "broken", *run, "train.fail_at_step=3", ok=False)
    # The surviving rank did not sit out its 600 s timeout: the launcher stopped it.
    assert proc.returncode != 0 and time.monotonic() - start < 120
    assert "a rank failed" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "broken/checkpoints").iterdir()) == ["step-000000002"]

    train(tmp_path / "broken", *run, "--resume")
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "broken")
    assert [whole[s]["loss"] for s in range(1, 7)] == [resumed[s]["loss"] for s in range(1, 7)]
    a = torch.load(tmp_path / "whole/model.pt", weights_only=True)
    b = torch.load(tmp_path / "broken/model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The dense export of channel shards: test_loss_curve_equals_one_process[channel2] (every
# grid's model.pt is loaded into the plain model there).


def test_bf16_progress_bar_tensorboard_and_curves(one_rank):
    run_dir, proc = one_rank["bf16"]
    assert "epoch 1/" in proc.stderr  # the bar
    assert "test accuracy" in proc.stdout  # the final table
    assert all(torch.isfinite(torch.tensor(curve(run_dir))))
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "curves.png" in proc.stdout


def test_webdataset_shards_end_to_end(tmp_path):
    """`parallelkit data shard`, then training on the shards over two ranks."""
    shards = tmp_path / "shards"
    cmd = [sys.executable, "-m", "parallelkit.cli", "data", "shard", "digits", str(shards)]
    subprocess.run(
        [*cmd, "--samples-per-shard", "300", "--image-size", "16", "--channels", "1"],
        check=True,
        timeout=120,
    )
    assert len(list(shards.glob("train-*.tar"))) == 5  # 1,438 images
    run = tmp_path / "run"
    train(run, *TINY, "data.name=webdataset", f"data.root={shards}", "parallel.ranks=2")
    assert [r["count"] for r in records(run, "eval").values()] == [359]


def test_config_error_exits_before_starting_ranks(tmp_path):
    proc = train(tmp_path, "train.epoch=3", ok=False)
    assert proc.returncode == 2 and "epoch" in proc.stderr


def test_batch_that_does_not_split_fails_on_every_rank(tmp_path):
    proc = train(tmp_path, *TINY, "train.batch_size=15", "parallel.ranks=2", ok=False)
    assert proc.returncode != 0 and "must split into 2 data-parallel ranks" in proc.stderr
