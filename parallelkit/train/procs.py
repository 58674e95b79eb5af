"""Supervising the local ranks: signals reach every rank, and no rank outlives the launcher.

``parallelkit train`` started from a shell runs its ranks as child processes (one per rank for
gloo/NCCL, or one ``mpiexec``) and stays in front of them:

- SIGINT or SIGTERM to the launcher is passed on to every rank (to ``mpiexec`` for MPI, which
  passes it on itself). The ranks stop (see :mod:`parallelkit.train.stopping`); whatever is
  still running ``grace`` seconds later is killed. A second signal kills at once.
- When a rank exits non-zero, the others get SIGTERM and, ``FAIL_GRACE_S`` later, SIGKILL;
  the launcher names the rank that failed first. A rank that left because its collective
  failed or timed out (``PEER_FAILED_EXIT``) is not the cause: when only such ranks have left
  and others still run a moment later, those are named as the ranks that stopped answering
  (a rank stopped by SIGSTOP, or stuck without failing). Ranks that exit with
  ``REFUSED_EXIT`` stopped together and said why (:mod:`parallelkit.train.agree`): nothing
  is added.
- Each child runs in a session of its own, so a Ctrl-C at the terminal reaches the launcher
  only (once), and the launcher decides. Each rank also asks the kernel for SIGKILL
  when the launcher dies (``PR_SET_PDEATHSIG``), so even ``kill -9`` of the launcher leaves no
  rank behind. mpiexec (Hydra) cleans up its own ranks when it dies.
- A child with a ``forked`` function is a fork of the launcher that calls it, instead of a new
  Python that runs ``command``: it keeps what the launcher imported and checked (about three
  seconds of CPU per rank), and is watched as a started command is (:class:`Forked`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from parallelkit.comm.base import PEER_FAILED_EXIT
from parallelkit.train.agree import REFUSED as REFUSED_EXIT

GRACE_S = 30.0  # after a signal: time to finish the step, save a checkpoint and exit
FAIL_GRACE_S = 5.0  # after a rank failed: the others have nothing left to save
LAUNCHER_PID = "PARALLELKIT_LAUNCHER_PID"  # set for ranks started by this module
_POLL_S = 0.05
_BLAME_S = 1.0  # how long a peer's failure may take to show after the ranks it took along


@dataclass
class Child:
    """One process to start: its command, environment and the name used in messages; with
    ``forked``, a fork of this process that runs ``forked()`` (its exit status) in ``env``."""

    command: list[str]
    env: dict[str, str]
    name: str
    forked: Callable[[], int] | None = None


@dataclass
class _State:
    signum: int | None = None
    deadline: float | None = None
    failed: tuple[str, int] | None = None
    first_exit: float | None = None
    signals: list[int] = field(default_factory=list)


def supervise(
    children: list[Child], grace: float = GRACE_S, serve: Callable[[], object] | None = None
) -> int:
    """Start ``children``, each in a new session, wait, and return the job's exit status:
    0 when all exit 0, else the first failure's status (128 + signal after a signal).
    ``serve()`` is called once they are started (a fork then copies none of its threads), and
    what it returns is kept until they have exited."""
    state = _State()
    procs: list[subprocess.Popen | Forked] = []
    previous = {}

    def on_signal(signum: int, frame: object) -> None:
        state.signals.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        for child in children:
            if child.forked is not None:
                procs.append(Forked(child))
            else:
                procs.append(subprocess.Popen(child.command, env=child.env, start_new_session=True))
        served = serve() if serve is not None else None
        status = _wait(children, procs, state, grace)
        del served
        return status
    finally:
        _kill(procs, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Forked:
    """A child forked from this process, seen through the ``subprocess.Popen`` calls that
    :func:`supervise` makes (``pid``, ``poll``, ``wait``, ``send_signal``).

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
        ready, tell = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready)
            _forked_main(child, tell)
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
            time.sleep(_POLL_S / 5)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _forked_main(child: Child, tell: int) -> NoReturn:
    """The fork's side: a session of its own, Python's handlers for the signals the launcher
    catches, the child's environment and thread count, ``child.forked()``; then the end of a
    Python program (see :class:`Forked`)."""
    code, interrupted = 1, False
    try:
        os.setsid()
        os.close(tell)
        _name_process(forked_name(child.name))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(child.env)
        threads = child.env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch  # OpenMP read OMP_NUM_THREADS when the launcher started, not now

            torch.set_num_threads(int(threads))
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


def _name_process(name: str) -> None:
    """Set this process's name (``/proc/self/comm``, 15 bytes), where Linux's prctl is."""
    _prctl(15, name.encode()[:15])  # PR_SET_NAME


def _prctl(option: int, value: int | bytes) -> bool:
    """Linux's ``prctl(option, value)``; False where the C library has none."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def _wait(
    children: list[Child], procs: list[subprocess.Popen | Forked], state: _State, grace: float
) -> int:
    while True:
        while state.signals:
            signum = state.signals.pop(0)
            if state.signum is None:
                state.signum, state.deadline = signum, time.monotonic() + grace
                _say(
                    f"{signal.Signals(signum).name}: passing it on to the ranks; "
                    f"they stop within {grace:g} s (a second signal kills them now)"
                )
                _kill(procs, signum)
            else:
                _say("second signal: killing the ranks now")
                _kill(procs, signal.SIGKILL)
        codes = [p.poll() for p in procs]
        if state.failed is None and state.signum is None:
            failed = [(c.name, code) for c, code in zip(children, codes, strict=True) if code]
            if failed and state.first_exit is None:
                state.first_exit = time.monotonic()
            # A rank that left because a peer's connection closed (PEER_FAILED_EXIT) is not
            # the cause: wait a moment for the rank that failed to be seen too.
            cause = [f for f in failed if f[1] != PEER_FAILED_EXIT]
            if cause or (failed and time.monotonic() - state.first_exit > _BLAME_S):
                name, code = (cause or failed)[0]
                state.failed = (name, code)
                state.deadline = time.monotonic() + FAIL_GRACE_S
                what = "stopping the others" if len(procs) > 1 else "stopping"
                running = [(c, p) for c, p, code in zip(children, procs, codes, strict=True)
                           if code is None]  # fmt: skip
                if code == REFUSED_EXIT:
                    pass  # the ranks stopped together, and one of them said why
                elif not cause and running:
                    _say(f"{_stalled(running)} stopped answering: {name} gave up waiting "
                         f"(exit status {code}, after parallel.timeout); {what}")  # fmt: skip
                else:
                    _say(f"{name} failed first ({_status(code)}); {what}")
                _kill(procs, signal.SIGTERM)
                for _, proc in running:  # a stopped process cannot act on SIGTERM: no grace
                    if _proc_state(proc.pid) in ("T", "t"):
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(proc.pid, signal.SIGKILL)
        if all(c is not None for c in codes):
            break
        if state.deadline is not None and time.monotonic() > state.deadline:
            _say("ranks still running after the grace period: killing them")
            _kill(procs, signal.SIGKILL)
            state.deadline = None
        time.sleep(_POLL_S)
    if state.signum is not None:
        return 128 + state.signum
    if state.failed is not None:
        code = state.failed[1]
        return code if code > 0 else 128 - code
    return 0


def _kill(procs: list[subprocess.Popen | Forked], signum: int) -> None:
    """Signal every started process; SIGKILL goes to each one's whole process group
    (DataLoader workers included), other signals to the process, which handles them."""
    for p in procs:
        if p.poll() is not None:
            continue  # reaped: its pid may belong to another process by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if signum == signal.SIGKILL:
                os.killpg(p.pid, signum)
            else:
                p.send_signal(signum)


def _stalled(running: list[tuple[Child, subprocess.Popen | Forked]]) -> str:
    """``rank 1 (its process is stopped)``: the ranks still running when the others gave up."""
    names = []
    for child, proc in running:
        stopped = _proc_state(proc.pid) in ("T", "t")
        names.append(child.name + (" (its process is stopped, as by SIGSTOP)" if stopped else ""))
    return ", ".join(names)


def _proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` in /proc (Linux), or '' where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.rindex(")") + 2 :].split()[0]


def _status(code: int) -> str:
    return f"exit status {code}" if code > 0 else f"killed by {signal.Signals(-code).name}"


def _say(message: str) -> None:
    """One line from the launcher, named after its command (``parallelkit train``, ``parallelkit
    predict``)."""
    command = "predict" if sys.argv[1:2] == ["predict"] else "train"
    print(f"parallelkit {command}: {message}", file=sys.stderr, flush=True)


def die_with_launcher() -> None:
    """In a rank started by :func:`supervise`: be killed when the launcher dies (Linux)."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux") or os.getppid() != int(launcher):
        return  # not a direct child of the launcher (under mpiexec: of Hydra's proxy)
    if not _prctl(1, int(signal.SIGKILL)):  # PR_SET_PDEATHSIG
        return
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os._exit(128 + signal.SIGKILL)
