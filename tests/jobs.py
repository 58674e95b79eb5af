"""``parallelkit train`` as a subprocess job, for the fault tests: every process it starts is
tracked, so a test can assert that all of them are gone within a bound, and none survives a
failing test.

The launcher runs in a session of its own (``start_new_session``). Its descendants are
snapshotted from ``/proc`` while it runs (a rank orphaned by a dying launcher is reparented
to PID 1 and would not be found by walking the tree afterwards); a pid counts as the same
process only while its start time is unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallelkit.train.ranks.procs import forked_name

if not Path("/proc/self/stat").exists():
    pytest.skip("the fault tests read /proc (Linux)", allow_module_level=True)

# A ResNet-18 of width 4 on 16x16 digits: seconds per run (as tests/train/loop/test_trainer.py).
TINY = [
    "model.width=4",
    "model.stem=cifar",
    "data.image_size=16",
    "data.channels=1",
    "train.batch_size=16",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",  # curves.png: test_trainer.py's bf16 run, test_plot.py
    "optim.lr=0.4",
]
CLI = [sys.executable, "-m", "parallelkit.cli", "train"]


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid``, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


class Job:
    """One ``parallelkit train`` (or any command), its output in ``out``, its processes in
    ``seen``. Use as a context manager: leaving kills whatever is left."""

    def __init__(
        self,
        run_dir: Path,
        *overrides: str,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.out = Path(f"{run_dir}.out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        cmd = command or [*CLI, f"train.run_dir={run_dir}", *overrides]
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        with self.out.open("w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.seen: dict[int, int] = {}  # pid -> start time
        self.track()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def track(self) -> None:
        """Add the launcher's current descendants to ``seen``."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (info := _stat(int(entry))) is not None:
                children.setdefault(info[0], []).append(int(entry))
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            if (info := _stat(pid)) is not None and pid not in self.seen:
                self.seen[pid] = info[2]
            todo += children.get(pid, [])

    def alive(self) -> list[int]:
        """Tracked processes still running (zombies and reused pids do not count)."""
        left = []
        for pid, start in self.seen.items():
            info = _stat(pid)
            if info is not None and info[2] == start and info[1] != "Z":
                left.append(pid)
        return left

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        """Track processes until ``predicate()`` holds; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self.track()
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s:\n{self.output()[-3000:]}")
            time.sleep(0.1)
        self.track()

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return 0
        steps = [0]
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "train":
                    steps.append(record["step"])
        return max(steps)

    def gone_within(self, bound: float, since: float) -> tuple[int, float]:
        """Wait for the launcher and every tracked process to end; returns the launcher's exit
        status and the seconds from ``since`` (a ``time.monotonic()``) until all were gone
        (``self.gone_at``: the wall-clock time then). Fails when anything is left after
        ``bound`` seconds."""
        deadline = since + bound
        while self.proc.poll() is None or self.alive():
            if self.proc.poll() is None:
                self.track()
            if time.monotonic() > deadline:
                left = self.alive()
                self.kill_all()
                pytest.fail(
                    f"processes {left} still running {bound} s after the fault:\n"
                    + self.output()[-3000:]
                )
            time.sleep(0.05)
        self.gone_at = time.time()
        return self.proc.returncode, time.monotonic() - since

    def injected_at(self) -> float:
        """The wall-clock time the rank printed when injecting its fault (train.fail_at_step)."""
        for line in self.output().splitlines():
            if "parallelkit train: injecting" in line:
                return float(line.rsplit(" at ", 1)[1])
        pytest.fail("no fault was injected:\n" + self.output()[-3000:])

    def signal(self, signum: int) -> float:
        """Send ``signum`` to the launcher; returns the time it was sent."""
        self.track()
        now = time.monotonic()
        self.proc.send_signal(signum)
        return now

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.alive()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def run(run_dir: Path, *overrides: str, timeout: float = 180) -> tuple[int, str]:
    """Run a job to its end (bounded); returns (exit status, output)."""
    with Job(run_dir, *overrides) as job:
        status, _ = job.gone_within(timeout, time.monotonic())
        return status, job.output()


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def report(name: str, seconds: float) -> None:
    """Print the measured time (shown with pytest -s, and in the log of a failure)."""
    print(f"\nFAULT-TIME {name}: {seconds:.2f} s from the fault to every process gone")


def rank_pid(job: Job, rank: int) -> int | None:
    """The pid of local rank ``rank`` of ``job``, or None."""
    job.track()
    return next((pid for pid in job.alive() if pid != job.proc.pid and is_rank(pid, rank)), None)


def is_rank(pid: int, rank: int) -> bool:
    """Whether process ``pid`` is local rank ``rank``: its ``RANK`` variable where it started as
    a new program, its name where it is a fork of ``parallelkit train``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    if name.startswith("pk-rank-"):
        return name == forked_name(f"rank {rank}")
    return f"RANK={rank}".encode() in environ


UNMAPPED_UID = 54321  # owns what the job may not touch, when the tests run as root


def as_a_user(command: list[str]) -> list[str]:
    """``command`` as a process that file modes apply to. As root, it runs in a user namespace
    (``unshare --user --map-root-user``): it still owns the files root owns, but no longer
    overrides the mode of files owned by an uid outside the namespace (:func:`deny`)."""
    if os.geteuid() != 0:
        return command
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("running as root, and no user namespace to drop the override of file modes")
    return ["unshare", "--user", "--map-root-user", *command]


def deny(path: Path, mode: int) -> None:
    """Give ``path`` ``mode``, so that a job run by :func:`as_a_user` is held to it."""
    if os.geteuid() == 0:
        os.chown(path, UNMAPPED_UID, UNMAPPED_UID)
    path.chmod(mode)
