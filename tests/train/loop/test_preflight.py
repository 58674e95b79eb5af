"""Mistakes found before any rank starts (train/loop/preflight.py): one line, exit status 2,
and no rank started (nothing written under ``train.run_dir``). ``parallelkit train`` in
subprocesses (tests/jobs.py) with the default 2 local ranks.

Covered: config mistakes that used to surface inside the ranks, run directories that cannot
take the run, the docs' table of faults.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from jobs import CLI, TINY, Job, as_a_user, deny, run
from runs import BLOCK_IMAGES, write_block_samples

pytestmark = pytest.mark.timeout(120)

DOCS = Path(__file__).parents[3] / "docs" / "training.md"


def one_line_error(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    return lines[0]


# 4. Config mistakes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.batch_size=15"], "train.batch_size=15 must split into 2 data-parallel ranks"),
        (["parallel.rows=3"], "2 ranks do not split into groups of depth x rows x cols"),
        (["model.kwargs={bogus_arg: 1}"], "unexpected keyword arguments ['bogus_arg']"),
        (["data.name=synthetic", "data.train_samples=8"], "has 8 samples, too few"),
        (["parallel.rows=2", "data.image_size=1"], "has fewer planes than the parallel.rows=2"),
    ],
)
def test_config_mistakes_are_found_before_the_ranks_start(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    status, out = run(run_dir, *TINY, *overrides, timeout=90)
    assert status == 2 and message in one_line_error(out)
    assert not run_dir.exists()  # no rank started: rank 0 makes it first


@pytest.mark.parametrize("key", ["parallel.backend=nccl", "parallel.device=cuda"])
def test_a_gpu_asked_for_where_there_is_none_is_refused_before_the_ranks_start(tmp_path, key):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    run_dir = tmp_path / "run"
    status, out = run(run_dir, *TINY, key, timeout=90)
    assert status == 2 and f"{key} needs a GPU" in one_line_error(out)
    assert not run_dir.exists()


def test_data_whose_values_would_be_lost_or_crops_too_large_are_refused_first(tmp_path):
    """A complex64 training image (its imaginary part was dropped without a word), then a crop
    larger than the samples: both from the headers, before any rank starts."""
    import numpy as np

    pytest.importorskip("monai")
    data, run_dir = tmp_path / "data", tmp_path / "run"
    write_block_samples(data, "npy")
    bad = data / "train" / "images" / "s3.npy"
    np.save(bad, np.load(bad).astype(np.complex64))
    status, out = run(run_dir, *BLOCK_IMAGES, f"data.name=npy:{data}", timeout=90)
    line = one_line_error(out)
    assert status == 2 and str(bad) in line and "complex64" in line, out
    assert not run_dir.exists()
    np.save(bad, np.load(bad).real.astype(np.float32))
    status, out = run(run_dir, *BLOCK_IMAGES, f"data.name=npy:{data}",
                      "data.image_size=32", timeout=90)  # fmt: skip
    line = one_line_error(out)
    assert status == 2 and "crop (32, 32) does not fit in" in line and "(28, 28)" in line, out
    assert not run_dir.exists()
    truncated = data / "test" / "images" / "s1.npy"  # the test split's headers are read too
    truncated.write_bytes(truncated.read_bytes()[:100])
    status, out = run(run_dir, *BLOCK_IMAGES, f"data.name=npy:{data}", timeout=90)
    line = one_line_error(out)
    assert status == 2 and f"{truncated}: cannot read its header as npy" in line, out
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("split", "masks"), [("train", "every"), ("test", "every"), ("train", "one")]
)
def test_a_bad_mask_stops_every_rank_with_one_line(tmp_path, split, masks):
    """A label past data.num_classes in training masks, non-integer float masks in the test
    split. Every rank checks the first batch of both splits before the first step, so where
    every mask is bad nothing trains; one bad mask met later stops the run alike: one line
    from the rank that read it, exit status 2, no traceback on any rank."""
    import numpy as np

    pytest.importorskip("monai")
    data, run_dir = tmp_path / "data", tmp_path / "run"
    write_block_samples(data, "npy")
    paths = sorted((data / split / "masks").glob("*.npy"))
    for bad in paths if masks == "every" else paths[:1]:
        mask = np.load(bad)
        if split == "train":
            mask[3, 4], message = 7, "has labels [7] outside 0..2"
        else:
            mask, message = mask.astype(np.float32) + 0.5, "holds non-integer values"
        np.save(bad, mask)
    status, out = run(run_dir, *BLOCK_IMAGES, f"data.name=npy:{data}",
                      "train.max_steps=12", timeout=120)  # fmt: skip
    line = one_line_error(out)
    assert status == 2 and str(data / split / "masks") in line and message in line, out
    assert "parallelkit train: done" not in out
    if masks == "every":
        metrics = run_dir / "metrics.jsonl"
        assert '"kind": "train"' not in (metrics.read_text() if metrics.exists() else "")


# 5. Run directories -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only", "full"])
def test_a_run_dir_that_cannot_take_the_run_is_refused_before_the_ranks_start(tmp_path, where):
    run_dir, more = tmp_path / "run", []
    if where == "a file":
        run_dir.write_text("not a directory")
        message = f"train.run_dir={run_dir} is a file, not a directory"
    elif where == "under a file":
        (tmp_path / "file").write_text("not a directory")
        run_dir = tmp_path / "file" / "run"
        message = f"lies under {tmp_path / 'file'}, which is a file"
    elif where == "read-only":
        run_dir.mkdir()
        deny(run_dir, 0o555)
        message = "is not writable by this user"
    else:  # checkpoints of a ResNet-18 of width 16384 (built on the meta device): terabytes
        more = ["model.width=16384"]
        message = "MiB free on its file system, and the run needs about"
    command = as_a_user([*CLI, f"train.run_dir={run_dir}", *TINY, *more])
    try:
        with Job(tmp_path / "job", command=command) as job:
            status, _ = job.gone_within(90, time.monotonic())
    finally:
        if run_dir.is_dir():
            run_dir.chmod(0o755)
    assert status == 2 and message in one_line_error(job.output())
    assert not (run_dir / "config.yaml").exists()  # no rank started


# 8. The docs' table of faults ---------------------------------------------------------------


def test_the_docs_fault_table_is_whole_and_names_every_fault():
    text = DOCS.read_text()
    section = text[text.index("### What happens when") :].split("\n\n")
    table = next(block for block in section if block.startswith("| fault"))
    rows = [re.split(r"(?<!\\)\|", line.strip())[1:-1] for line in table.splitlines()]
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    faults = " ".join(row[0] for row in rows)
    for fault in [
        "no SHA-256", "cannot be read", "not a parallelkit train checkpoint", "does not fit",
        "stuck", "SIGSTOP", "train.batch_size", "parallel.rows", "model.kwargs",
        "data.train_samples", "run_dir", "full", "at the same instant", "train.overwrite",
        "manifest was deleted",
    ]:  # fmt: skip
        assert fault in faults, fault


# The launcher's model check --------------------------------------------------------------------

META_BUILD = """
import sys, torch
from parallelkit.train import config
from parallelkit.train.loop import preflight
from parallelkit.train.tasks import TASKS
for overrides in ([], ["train.task=gan", "model.name=dcgan"],
                  ["train.task=segment", "data.name=shapes", "model.name=unet"]):
    cfg = config.load(None, [*overrides, "data.image_size=32"])
    loader = preflight.check_data(cfg, None)
    meta = preflight.build_on_meta(cfg, loader)
    real = TASKS[cfg.train.task].dense_networks(cfg, loader)
    for name, net in real.items():
        want = {k: (v.shape, v.dtype) for k, v in net.state_dict().items()}
        got = {k: (v.shape, v.dtype) for k, v in meta[name].state_dict().items()}
        assert got == want and all(v.is_meta for v in meta[name].state_dict().values()), name
        print(cfg.train.task, name, len(want), "torch._dynamo" in sys.modules)
"""


def test_the_networks_built_on_meta_have_the_real_shapes_and_skip_the_fills():
    """Each task's networks as the launcher builds them (initializers' fills skipped): every
    parameter and buffer of the real build, shape and dtype; and torch._dynamo, which torch's
    meta fills import (a second of every start), is not imported before the real builds."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", META_BUILD], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert [line.split()[:2] for line in out if line] == [
        ["classify", "model"], ["gan", "generator"], ["gan", "discriminator"], ["segment", "model"]
    ], out  # fmt: skip
    assert out[0].endswith("False"), out
