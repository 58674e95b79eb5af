"""Resuming fails closed: a checkpoint that cannot be verified or used is reported once and the
next older one is tried; where none is left, or a save cannot be written, the job stops with
one line. ``parallelkit train`` in subprocesses (tests/jobs.py), 1 and 2 ranks on gloo.

Covered: integrity, unusable checkpoints, a full disk during a save, a damaged shard
reported once, a checkpoint without its manifest removed with a word.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import CLI, TINY, Job, as_a_user, deny, run

from parallelkit.train.store import files

pytestmark = pytest.mark.timeout(300)

CONSTANT = ["optim.schedule=constant", "optim.warmup_epochs=0"]
COMMON = [*TINY, *CONSTANT, "train.checkpoint_every=2"]
SCRIPTS = Path(__file__).parents[2] / "scripts"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """One finished 1-rank run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    status, out = run(run_dir, *COMMON, "parallel.ranks=1", "train.max_steps=4")
    assert status == 0, out
    return run_dir


@pytest.fixture
def copy(first_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    return run_dir


def newest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-000000004"


def damage(shard: Path) -> None:
    """64 bytes in the middle overwritten."""
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 64)


def edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def replace_shard(folder: Path, state) -> None:
    """``state`` as the shard, with its checksum in the manifest (intact, but not usable)."""
    data = files.torch_bytes(state)
    (folder / "shard-0.pt").write_bytes(data)
    edit_manifest(folder, lambda m: m["sha256"].__setitem__("shard-0.pt", files.sha256(data)))


def one_line_error(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    return lines[0]


def resume(run_dir: Path, *more: str) -> tuple[int, str]:
    return run(run_dir, *COMMON, "train.max_steps=6", *more, "--resume")


# 1 and 8. Every shard verified; a damaged one reported once ---------------------------------


@pytest.mark.parametrize("how", ["no checksum", "damaged"])
def test_unverifiable_or_damaged_shard_is_reported_once_and_an_older_one_used(copy, how):
    shard = newest(copy) / "shard-0.pt"
    damage(shard)
    if how == "no checksum":
        edit_manifest(newest(copy), lambda m: m.pop("sha256"))
    # 2 data ranks read shard-0: one of them says so.
    status, out = resume(copy, "parallel.ranks=2")
    assert status == 0, out
    said = "cannot be verified" if how == "no checksum" else "is damaged"
    assert out.count(f"checkpoint shard {shard} {said}") == 1, out
    assert "resumed at step 2" in out


# 2. Unusable checkpoints: reported, the next older one tried ---------------------------------


def test_an_unreadable_checkpoint_folder_is_reported_and_an_older_one_used(copy):
    deny(newest(copy), 0o000)
    try:
        # (checkpoint_every=5: the resumed run's own saves go elsewhere than the folder)
        command = as_a_user([*CLI, f"train.run_dir={copy}", *COMMON, "parallel.ranks=1",
                             "train.max_steps=6", "train.checkpoint_every=5",
                             "--resume"])  # fmt: skip
        with Job(copy, command=command) as job:
            status, _ = job.gone_within(180, time.monotonic())
        out = job.output()
    finally:
        newest(copy).chmod(0o755)
    assert status == 0, out
    assert "Traceback" not in out
    assert f"checkpoint {newest(copy)}: manifest cannot be read" in out
    assert "Permission denied" in out and "resumed at step 2" in out


def test_a_passed_over_checkpoint_is_set_aside_not_reused_when_the_run_gets_there(copy):
    """The newest checkpoint is damaged, so resuming starts from step 2; its save at step 4
    moves the damaged folder aside (named, never deleted), and later resumes go on."""
    shard = newest(copy) / "shard-0.pt"
    damage(shard)
    damaged = shard.read_bytes()
    status, out = resume(copy, "parallel.ranks=1")
    assert status == 0, out
    aside = copy / "checkpoints" / "set-aside-step-000000004"
    assert f"checkpoint {newest(copy)} was passed over on resume; it is kept as {aside}" in out
    assert (aside / "shard-0.pt").read_bytes() == damaged
    assert "resumed at step 2" in out
    for steps in (8, 10):
        status, out = run(copy, *COMMON, f"train.max_steps={steps}", "parallel.ranks=1",
                          "--resume")  # fmt: skip
        assert status == 0 and f"resumed at step {steps - 2}" in out, out
    names = sorted(p.name for p in (copy / "checkpoints").iterdir())
    assert names == ["set-aside-step-000000004", "step-000000008", "step-000000010"], names


def test_a_file_that_is_no_checkpoint_is_reported_and_an_older_one_used(copy):
    state = torch.load(newest(copy) / "shard-0.pt", weights_only=True)["task"]["model"]
    replace_shard(newest(copy), state)  # a bare state dict: no step, no optimizer
    status, out = resume(copy, "parallel.ranks=2")
    assert status == 0, out
    assert out.count("is not a parallelkit train checkpoint") == 1, out
    assert "resumed at step 2" in out


def test_a_state_that_does_not_fit_is_reported_and_an_older_one_used(copy):
    state = torch.load(newest(copy) / "shard-0.pt", weights_only=True)
    state["task"]["model"].pop(next(iter(state["task"]["model"])))  # one weight missing
    replace_shard(newest(copy), state)
    status, out = resume(copy, "parallel.ranks=2")
    assert status == 0, out
    assert out.count(f"checkpoint {newest(copy)} does not fit this run's model") == 1, out
    assert "Missing key" in out and "resumed at step 2" in out


def test_when_no_checkpoint_fits_the_job_stops_with_one_line(copy):
    for folder in (copy / "checkpoints").iterdir():  # as from an older parallelkit
        edit_manifest(folder, lambda m: m.pop("config"))
    status, out = resume(copy, "parallel.ranks=2", "model.width=8")
    line = one_line_error(out)
    assert status == 2 and f"no usable checkpoint in {copy}" in line
    assert out.count("does not fit this run's model (resnet18)") == 2 and "size mismatch" in out


# 8. A checkpoint whose manifest was deleted ------------------------------------------------


def test_a_checkpoint_without_its_manifest_is_removed_with_a_word(copy):
    (newest(copy) / "manifest.json").unlink()
    status, out = resume(copy, "parallel.ranks=1")
    assert status == 0, out
    assert f"removed checkpoint {newest(copy)}: it has no manifest" in out
    assert "resumed at step 2" in out


# 5. A full disk during a save ---------------------------------------------------------------


def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, str(SCRIPTS / "disk_full.py"), f"train.run_dir={run_dir}",
               *COMMON, "parallel.ranks=1", "train.max_steps=6"]  # fmt: skip
    with Job(run_dir, command=command) as job:
        status, _ = job.gone_within(180, time.monotonic())
    out = job.output()
    line = one_line_error(out)
    shard = run_dir / "checkpoints" / "step-000000004" / "shard-0.pt"
    assert status == 1
    assert f"checkpoint file {shard} could not be written: No space left on device" in line
    assert f"the previous checkpoint {run_dir / 'checkpoints' / 'step-000000002'} is kept" in line
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000000002"]
    state = torch.load(run_dir / "checkpoints" / "step-000000002" / "shard-0.pt",
                       weights_only=True)  # fmt: skip
    assert state["step"] == 2


class _Payload:
    """A pickle that runs code when loaded: it would leave a file named ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_with_code_is_refused_in_one_line_without_torchs_warnings(tmp_path):
    """A shard that passes its SHA-256 but is a pickle of code (not torch.save's format, so
    torch also warns of its protocol): refused with one line, nothing run, no warning."""
    import pickle
    import warnings

    from parallelkit.train.store.checkpoint import Unreadable, load_shard

    ran = tmp_path / "ran"
    data = pickle.dumps({"step": 2, "task": _Payload(ran)}, protocol=4)
    (tmp_path / "shard-0.pt").write_bytes(data)
    manifest = {"sha256": {"shard-0.pt": files.sha256(data)}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(Unreadable, match=r"shard-0.pt holds pickled objects other than"):
            load_shard(tmp_path, manifest, "shard-0.pt")
    assert seen == [] and not ran.exists()


def test_a_passed_over_checkpoint_that_cannot_be_moved_aside_is_not_deleted(tmp_path, monkeypatch):
    # The save that meets a folder resuming passed over moves it aside; where the move fails
    # (a read-only checkpoints/ folder, say), the save stops and the folder stays untouched.
    import parallelkit as pk
    from parallelkit.train.ranks.agree import Stop
    from parallelkit.train.store import checkpoint

    damaged = tmp_path / "checkpoints" / "step-000000004"
    damaged.mkdir(parents=True)
    (damaged / "shard-0.pt").write_bytes(b"the user's bytes")

    def refuse(self, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "rename", refuse)
    with pytest.raises(Stop, match="could not be written"):
        checkpoint.save(tmp_path, 4, {"w": torch.ones(1)}, pk.Grid(pk.init("local")))
    assert (damaged / "shard-0.pt").read_bytes() == b"the user's bytes"
