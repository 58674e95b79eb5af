"""How a local rank's process begins: a fork of the launcher, or a new Python, each tied to the
launcher's life from its first instruction.

Why forks, and when not. A fork keeps what the launcher imported and checked (about three
seconds of CPU per rank, benchmarks/startup.py), but it copies one thread only: a lock or a
barrier that another thread of the launcher held stays held for ever in the fork. OpenMP's
pool is such a thread (libgomp keeps its workers after the first parallel region, and a fork
that enters the next region waits for them at ``gomp_team_barrier_wait_end``), and so is any
thread a user's data set starts on import. So the launcher forks only while it is the only
thread of its process, counted by the kernel (:func:`other_threads`: OpenMP's, MKL's and C
libraries' threads are invisible to :mod:`threading`); otherwise every rank is a new process.

Why every rank dies with its launcher at once. A rank asks the kernel for SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``), then checks that its parent is still the launcher: a
launcher killed before the request took effect has already handed the rank to init, and the
rank leaves. The fork does so first thing after ``fork()``; a new Python does so before it
imports anything (:data:`BOOT`), not after its checks, which take seconds and may hang.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

LAUNCHER_PID = "PARALLELKIT_LAUNCHER_PID"  # set for ranks started by procs.supervise
_POLL_S = 0.01
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15

BOOT = (
    "import os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL\n"
    f"    if os.getppid() != int(os.environ['{LAUNCHER_PID}']):\n"
    "        os._exit(137)  # the launcher died before the request took effect\n"
    "import runpy\n"
    "sys.argv = sys.argv[2:]  # -c's '-c', then '-m'\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)
"""What a new rank process runs first (``python -c BOOT -m MODULE ARGS``): the launcher's death
request and check of :func:`die_with_launcher`, with nothing imported, then ``MODULE`` as
``python -m`` runs it."""


@dataclass
class Child:
    """One process to start: its command, environment and the name used in messages; with
    ``forked``, a fork of this process that runs ``forked()`` (its exit status) in ``env``.
    ``fds``: descriptors a new process keeps (a fork keeps all)."""

    command: list[str]
    env: dict[str, str]
    name: str
    forked: Callable[[], int] | None = None
    fds: tuple[int, ...] = ()


def rank_command(command: list[str]) -> list[str]:
    """``command`` (``python -m MODULE ARGS``) started through :data:`BOOT`; other commands
    unchanged."""
    if len(command) > 2 and command[1] == "-m":
        return [command[0], "-c", BOOT, *command[1:]]
    return command


def start(child: Child) -> subprocess.Popen | Forked:
    """``child`` started in a session of its own: forked, or its command run."""
    if child.forked is not None:
        return Forked(child)
    command = rank_command(child.command) if LAUNCHER_PID in child.env else child.command
    return subprocess.Popen(command, env=child.env, start_new_session=True, pass_fds=child.fds)


def other_threads() -> int:
    """How many threads besides the calling one this process runs: the kernel's count (Linux
    ``/proc/self/task``), or :mod:`threading`'s where that cannot be read or says more."""
    python = threading.active_count() - 1
    try:
        return max(len(os.listdir("/proc/self/task")) - 1, python)
    except OSError:
        return python


def die_with_launcher(launcher: int) -> None:
    """Be killed when process ``launcher``, the parent, dies (Linux); exit now when it already
    has (the parent is no longer ``launcher``)."""
    if not sys.platform.startswith("linux"):
        return
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != launcher:
        os._exit(128 + signal.SIGKILL)


class Forked:
    """A child forked from this process, seen through the ``subprocess.Popen`` calls that
    :func:`parallelkit.train.ranks.procs.supervise` makes (``pid``, ``poll``, ``wait``,
    ``send_signal``).

    The fork ends as a Python program ends, never through the launcher's own frames: an
    uncaught exception goes to ``sys.excepthook`` (which a rank sets to leave at once), then
    the ``atexit`` functions run (a rank's leave-together barrier among them), then the streams
    are flushed. The functions registered before the fork run too, as a new Python registers
    them on import; so the launcher forks before it holds anything they would release (a
    temporary directory, a child process, a lock). The constructor returns once the fork runs
    in a session of its own, so that a SIGKILL sent to its process group cannot miss it.
    """

    def __init__(self, child: Child) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        launcher = os.getpid()
        ready, tell = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready)
            _forked_main(child, tell, launcher)
        os.close(tell)
        os.read(ready, 1)  # end of file: its session began, or it died before
        os.close(ready)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status (minus the signal that killed it), None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as Popen says, 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(_POLL_S)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _forked_main(child: Child, tell: int, launcher: int) -> NoReturn:
    """The fork's side: tied to the launcher's life, a session of its own, Python's handlers
    for the signals the launcher catches, the child's environment and thread count,
    ``child.forked()``; then the end of a Python program (see :class:`Forked`)."""
    code, interrupted = 1, False
    try:
        die_with_launcher(launcher)
        os.setsid()
        os.close(tell)
        _prctl(_PR_SET_NAME, forked_name(child.name).encode()[:15])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(child.env)
        threads = child.env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch  # OpenMP read OMP_NUM_THREADS when the launcher started, not now

            torch.set_num_threads(int(threads))
        from parallelkit.train.ranks import openblas  # numpy's OpenBLAS read its count then too

        if (blas := openblas.threads_asked(child.env)) is not None:
            openblas.set_threads(blas)
        assert child.forked is not None
        code = child.forked()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        sys.excepthook(*sys.exc_info())
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        if interrupted:  # as Python does: killed by the SIGINT it did not handle
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def forked_name(name: str) -> str:
    """What ``ps`` and ``top`` call a forked child (``pk-rank-1``): its command line and
    ``/proc/PID/environ`` are the launcher's, since no new program started."""
    return "pk-" + name.replace(" ", "-")


def _prctl(option: int, value: int | bytes) -> bool:
    """Linux's ``prctl(option, value)``; False where the C library has none."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True
