"""Faults and bad input, tried the way users break training jobs: ``parallelkit train`` in
subprocesses, 2 ranks on gloo (and mpiexec, and a user's torchrun), small digits images.

Every case has a bound on time and checks that no process of the job remains (tests/jobs.py
tracks them all, and kills what is left even when the test fails). The measured time from the
fault to every process gone is printed as ``FAULT-TIME`` (``pytest -s``). The checks on data:
checkpoints and ``model.pt`` stay loadable, ``--resume`` stays exact, the metrics have no
duplicate steps.

Findings of the issue they cover: 1 run identity, 2 signals, 3 fail fast, 4 checksums,
5 atomic files, 6 fallback, 7 errors, 8 metrics, 9 loopback, 10 shape checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import CLI, TINY, Job, rank_pid, records, report, run

from parallelkit.testing import free_port
from parallelkit.train.store import files, rundir

pytestmark = pytest.mark.timeout(300)

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
# A constant rate: where a run stops (max_steps) does not change its numbers, so a run
# stopped and resumed can be compared with an uninterrupted one of any length.
CONSTANT = ["optim.schedule=constant", "optim.warmup_epochs=0"]
LONG = [*TINY, *CONSTANT, "train.max_steps=400", "parallel.timeout=300"]
BOUND_S = 60.0  # generous for a loaded 2-core machine; parallel.timeout is 300


def assert_no_duplicate_steps(run_dir: Path) -> None:
    keys = [(r["kind"], r["step"]) for r in records(run_dir)]
    assert len(keys) == len(set(keys)), keys


def assert_loadable(run_dir: Path) -> None:
    """Every checkpoint's shards match their checksums and load; model.pt loads."""
    for manifest in (run_dir / "checkpoints").glob("step-*/manifest.json"):
        m = json.loads(manifest.read_text())
        for shard in m["shards"]:
            data = (manifest.parent / shard).read_bytes()
            assert files.sha256(data) == m["sha256"][shard]
            torch.load(manifest.parent / shard, weights_only=True)
    if (run_dir / "model.pt").exists():
        torch.load(run_dir / "model.pt", weights_only=True)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "train"}


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def one_line_error(output: str) -> str:
    """The single error line of a refused command (no traceback)."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    return lines[0]


def listeners(pids: list[int]) -> list[str]:
    """Local addresses that ``pids`` listen on (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & set(pids):
            found.append(line.split()[3])
    return found


# 1. Run identity -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """One finished 1-rank run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("identity") / "run"
    status, out = run(run_dir, *TINY, *CONSTANT, "parallel.ranks=1", "train.max_steps=4",
                      "train.checkpoint_every=2")  # fmt: skip
    assert status == 0, out
    return run_dir


def run_ids(run_dir: Path) -> set[str]:
    paths = (run_dir / "checkpoints").glob("step-*/manifest.json")
    return {json.loads(p.read_text())["run_id"] for p in paths}


def test_second_run_refuses_then_overwrite_replaces(first_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    status, out = run(run_dir, *TINY, "parallel.ranks=1", "train.max_steps=2")
    line = one_line_error(out)
    assert status == 2
    assert "--resume" in line and "train.run_dir" in line and "train.overwrite=true" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before

    old = run_ids(run_dir)
    status, out = run(run_dir, *TINY, "parallel.ranks=1", "train.max_steps=2",
                      "train.overwrite=true")  # fmt: skip
    assert status == 0, out
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000000002"]
    assert run_ids(run_dir).isdisjoint(old)
    assert_loadable(run_dir)


def test_resume_refuses_another_config_and_names_it(first_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    status, out = run(run_dir, *TINY, *CONSTANT, "parallel.ranks=1", "train.max_steps=6",
                      "optim.lr=0.2", "--resume")  # fmt: skip
    assert status == 2 and "optim.lr: 0.4 -> 0.2" in one_line_error(out)


def test_pruning_leaves_other_runs_alone_and_stale_files_go(first_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    other = run_dir / "checkpoints" / "step-000000001"  # another run's, older
    shutil.copytree(run_dir / "checkpoints" / "step-000000002", other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "run_id": "someone-else"}))
    # 5: what killed writers leave: a temporary file, a checkpoint without its manifest.
    unfinished = run_dir / "checkpoints" / "step-000000003"
    unfinished.mkdir()
    stale = [run_dir / ".model.pt.tmp-abc", unfinished / "shard-0.pt"]
    for p in stale:
        p.write_bytes(b"left by a killed writer")

    status, out = run(run_dir, *TINY, *CONSTANT, "parallel.ranks=1", "train.max_steps=8",
                      "train.checkpoint_every=2", "--resume")  # fmt: skip
    assert status == 0, out
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step-000000001", "step-000000006", "step-000000008"]
    assert not any(p.exists() for p in [*stale, unfinished])
    assert_no_duplicate_steps(run_dir)


def test_overwrite_removes_only_what_the_earlier_run_wrote(first_run, tmp_path):
    # A classify run never wrote samples/: files there named like a GAN run's stay, as do a
    # user's files in every output folder, named like the run's own or not.
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    assert "model.pt" in (run_dir / rundir.RECORD).read_text().split()
    mine = [run_dir / "samples" / "epoch-001.png", run_dir / "notes.txt",
            run_dir / "checkpoints" / "step-notes.txt", run_dir / "model.pt.bak",
            run_dir / "tensorboard" / "events.out.tfevents.1.host.1.0"]  # fmt: skip
    for p in mine:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"the user's")
    status, out = run(run_dir, *TINY, "parallel.ranks=1", "train.max_steps=2",
                      "train.overwrite=true")  # fmt: skip
    assert status == 0, out
    assert all(p.read_bytes() == b"the user's" for p in mine)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-000000002", "step-notes.txt"]  # fmt: skip


def test_overwrite_never_follows_a_link_out_of_the_run(first_run, tmp_path):
    # samples/ links to the user's folder, and the record names a file there (as a GAN run
    # writing into the linked folder would have): overwrite leaves it and the link alone.
    run_dir = tmp_path / "run"
    shutil.copytree(first_run, run_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = elsewhere / "epoch-001.png"
    theirs.write_bytes(b"the user's")
    (run_dir / "samples").symlink_to(elsewhere, target_is_directory=True)
    with (run_dir / rundir.RECORD).open("a") as f:
        f.write("samples/epoch-001.png\n../elsewhere/epoch-001.png\n")
    status, out = run(run_dir, *TINY, "parallel.ranks=1", "train.max_steps=2",
                      "train.overwrite=true")  # fmt: skip
    assert status == 0, out
    assert theirs.read_bytes() == b"the user's"
    assert (run_dir / "samples").is_symlink()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000000002"]


def test_two_runs_started_at_once_into_one_new_directory(tmp_path):
    # Both pass the launcher's check (nothing there yet); the one whose
    # rank 0 does not get the lock stops with one line, like a run started later.
    run_dir = tmp_path / "run"
    command = [*CLI, f"train.run_dir={run_dir}", *TINY, *CONSTANT, "train.max_steps=8"]
    with Job(tmp_path / "a", command=command) as a, Job(tmp_path / "b", command=command) as b:
        statuses = [job.gone_within(180, time.monotonic())[0] for job in (a, b)]
    assert sorted(statuses) == [0, 2], (a.output(), b.output())
    loser = (a, b)[statuses.index(2)].output()
    line = one_line_error(loser)
    assert "in use by another parallelkit train" in line or "holds the checkpoints" in line


# 2 and 9. Signals, a second run beside a running one, loopback -----------------------------


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_sigterm_stops_every_rank_and_nothing_listens_outside(tmp_path, backend):
    # auto: MPI where mpi4py and MPICH are installed (as in the test venv), the launcher
    # serving its start-up; gloo: the launcher's store.
    run_dir = tmp_path / "run"
    with Job(run_dir, *LONG, "train.checkpoint_every=2", f"parallel.backend={backend}") as job:
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        # 9: the launcher's store and the ranks' sockets are bound to loopback only.
        if shutil.which("ss"):
            addresses = listeners(job.alive())
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        # 1: a second run into the directory, even --resume, refuses while this one runs. Once:
        # rank 0 takes the lock and the launcher probes it alike on either backend.
        if backend == "auto":
            status, out = run(run_dir, *LONG, "train.checkpoint_every=2", "--resume", timeout=60)
            assert status == 2 and "in use by another parallelkit train" in one_line_error(out)

        sent = job.signal(signal.SIGTERM)
        status, seconds = job.gone_within(BOUND_S, sent)
    report(f"SIGTERM to the local launcher ({backend}, 2 ranks)", seconds)
    assert status == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in job.output()
    assert_loadable(run_dir)


def test_sigint_with_checkpoint_resumes_exactly(tmp_path):
    stopped = tmp_path / "stopped"
    with Job(stopped, *LONG, "train.checkpoint_on_signal=true") as job:
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        sent = job.signal(signal.SIGINT)
        status, seconds = job.gone_within(BOUND_S, sent)
    report("SIGINT to the local launcher, checkpoint on signal (gloo, 2 ranks)", seconds)
    assert status == 128 + signal.SIGINT, job.output()
    (folder,) = (stopped / "checkpoints").iterdir()  # written at the step it stopped after
    k = int(folder.name.split("-")[1])
    assert_loadable(stopped)

    end = f"train.max_steps={k + 2}"
    status, out = run(stopped, *LONG, "train.checkpoint_on_signal=true", end, "--resume")
    assert status == 0 and f"resumed at step {k}" in out, out
    whole = tmp_path / "whole"  # 7: --resume without a checkpoint says so, starts afresh
    status, out = run(whole, *LONG, end, "--resume")
    assert status == 0 and f"no checkpoint in {whole}; starting a new run" in out, out
    assert losses(stopped) == losses(whole)
    assert same_weights(stopped / "model.pt", whole / "model.pt")
    assert_no_duplicate_steps(stopped)


def test_sigkill_of_the_launcher_takes_the_ranks_along(tmp_path):
    with Job(tmp_path / "run", *LONG) as job:
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        sent = job.signal(signal.SIGKILL)
        status, seconds = job.gone_within(BOUND_S, sent)
    report("SIGKILL to the local launcher (gloo, 2 ranks)", seconds)
    assert status == -signal.SIGKILL


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
def test_sigterm_under_mpiexec(tmp_path):
    run_dir = tmp_path / "run"
    command = [MPIEXEC, "-n", "2", *CLI, f"train.run_dir={run_dir}", *LONG]
    with Job(run_dir, command=command) as job:  # the user's own mpiexec
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        sent = job.signal(signal.SIGTERM)
        status, seconds = job.gone_within(BOUND_S, sent)
    report("SIGTERM to mpiexec (2 ranks)", seconds)
    assert status != 0


def torchrun(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "parallelkit.cli", "train",
            f"train.run_dir={run_dir}", *overrides]  # fmt: skip


def test_sigterm_to_a_users_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    with Job(run_dir, command=torchrun(run_dir, *LONG)) as job:
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        sent = job.signal(signal.SIGTERM)
        status, seconds = job.gone_within(BOUND_S, sent)
    report("SIGTERM to torchrun (gloo, 2 ranks)", seconds)
    assert status != 0


# 3. An exception on any rank ends the job within seconds ------------------------------------


@pytest.mark.parametrize(
    ("rank", "how", "launcher"),
    [
        (1, "raise", "local"),
        (1, "raise", "local, new processes"),
        (1, "raise", "local gloo"),
        (0, "raise", "local"),
        (1, "raise_in_backward", "local"),
        (1, "exit", "local"),
        (1, "raise", "torchrun"),
        (1, "raise", "mpiexec"),
    ],
)  # (rank 0 raising under mpiexec took the same path: the except hook's MPI_Abort, any rank)
def test_failure_on_one_rank_ends_the_job(tmp_path, rank, how, launcher):
    if launcher == "mpiexec" and MPIEXEC is None:
        pytest.skip("no mpiexec (pip install mpich)")
    run_dir = tmp_path / "run"
    fault = [*LONG, "train.fail_at_step=3", f"train.fail_rank={rank}", f"train.fail_how={how}"]
    command = torchrun(run_dir, *fault) if launcher == "torchrun" else None
    if launcher == "mpiexec":  # the user's own
        command = [MPIEXEC, "-n", "2", *CLI, f"train.run_dir={run_dir}", *fault]
    if launcher == "local gloo":  # "local": MPI, where mpi4py and MPICH are installed
        fault.append("parallel.backend=gloo")
    # Each local rank a new Python, as GPU ranks always are, rather than a fork of the launcher.
    env = {"PARALLELKIT_FORK_RANKS": "0"} if launcher == "local, new processes" else {}
    with Job(run_dir, *fault, command=command, env=env) as job:
        status, _ = job.gone_within(180, time.monotonic())
    seconds = job.gone_at - job.injected_at()
    report(f"{how} on rank {rank} ({launcher}, 2 ranks, parallel.timeout=300)", seconds)
    assert status != 0
    assert seconds < BOUND_S  # far below parallel.timeout
    out = job.output()
    if how != "exit":
        assert "InjectedFault" in out
    if launcher.startswith("local"):
        assert f"rank {rank} failed first" in out
        assert ("(forked processes)" in out) == (launcher != "local, new processes")
    if launcher == "torchrun":
        assert re.search(rf"rank\s*:\s*{rank}\b", out), out[-3000:]  # torchrun's root cause


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_a_stalled_rank_is_named(tmp_path, backend):
    # Rank 1 stops (SIGSTOP) without failing; rank 0 gives up after parallel.timeout (gloo's
    # own timeout, or MPI's watchdog under auto), and the launcher names rank 1, not rank 0.
    with Job(tmp_path / "run", *LONG, "parallel.timeout=10", f"parallel.backend={backend}") as job:
        job.wait_until(lambda: job.steps_logged() >= 3, 120, "step 3")
        pid = rank_pid(job, 1)
        assert pid is not None, job.output()
        os.kill(pid, signal.SIGSTOP)
        status, seconds = job.gone_within(10 + BOUND_S, time.monotonic())
    report(f"rank 1 stopped by SIGSTOP ({backend}, 2 ranks, parallel.timeout=10)", seconds)
    out = job.output()
    assert status != 0
    assert "rank 1 (its process is stopped, as by SIGSTOP) stopped answering" in out, out
    assert "rank 0 failed first" not in out


# 4 and 6. Damaged checkpoints: detected, reported, the next older one used -----------------


def test_damaged_newest_checkpoint_falls_back_to_an_older_one(tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, *CONSTANT, "parallel.ranks=1", "train.checkpoint_every=2"]
    whole = tmp_path / "whole"  # the uninterrupted run, on the other core meanwhile
    with Job(whole, *common, "train.max_steps=8") as uninterrupted:
        status, out = run(run_dir, *common, "train.max_steps=6", "train.keep_checkpoints=3")
        assert status == 0, out
        status, _ = uninterrupted.gone_within(180, time.monotonic())
        assert status == 0, uninterrupted.output()
    shard = run_dir / "checkpoints" / "step-000000006" / "shard-0.pt"
    with shard.open("r+b") as f:  # 4 KiB overwritten in the middle
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x00" * 4096)

    status, out = run(run_dir, *common, "train.max_steps=8", "train.resume_fallback=false",
                      "--resume")  # fmt: skip
    assert status != 0 and f"checkpoint shard {shard} is damaged" in out

    status, out = run(run_dir, *common, "train.max_steps=8", "--resume")
    assert status == 0, out
    assert f"checkpoint shard {shard} is damaged" in out and "resumed at step 4" in out
    assert losses(run_dir) == losses(whole)
    assert same_weights(run_dir / "model.pt", whole / "model.pt")
    assert_no_duplicate_steps(run_dir)
    assert_loadable(run_dir)


# 5. Files are replaced whole; stale temporary files go --------------------------------------


def test_a_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    files.atomic_torch_save(path, {"w": torch.ones(3)})

    def torn(obj, f):  # a kill in the middle of the export
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        files.atomic_torch_save(path, {"w": torch.zeros(3)})
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


# 7. Clear errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.timeout=0"], "parallel.timeout=0.0 must be > 0"),
        (["train.max_steps=-1"], "train.max_steps=-1 must be >= 0"),
        (["--config", "BAD_YAML"], "is not valid YAML"),
    ],
)
def test_config_mistakes_are_one_line_and_exit_2(tmp_path, overrides, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [3\n")
    overrides = [str(bad) if o == "BAD_YAML" else o for o in overrides]
    status, out = run(tmp_path / "run", *overrides, timeout=60)
    assert status == 2 and message in one_line_error(out)


# 10. Mismatched shapes across ranks ---------------------------------------------------------


def transposed_all_reduce(comm, debug: bool):
    comm.debug = debug
    try:
        return tuple(comm.all_reduce(torch.ones((2, 3) if comm.rank == 0 else (3, 2))).shape)
    except ValueError as e:
        return str(e)
    finally:
        comm.debug = False


def test_shape_mismatch_is_caught_in_debug_mode_only(ranks):
    # What docs/communicators.md says: the same element count in another shape passes
    # unnoticed without debug mode; debug mode raises the same ValueError on every rank.
    assert ranks(2).run(transposed_all_reduce, False, timeout=60) == [(2, 3), (3, 2)]
    errors = ranks(2).run(transposed_all_reduce, True, timeout=60)
    assert errors[0] == errors[1] and "(2, 3)" in errors[0] and "(3, 2)" in errors[0]
