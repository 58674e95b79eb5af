"""Supervising the local ranks: signals reach every rank, and no rank outlives the launcher.

``parallelkit train`` started from a shell runs its ranks as child processes (one per rank for
gloo/NCCL, or one ``mpiexec``) and stays in front of them:

- SIGINT or SIGTERM to the launcher is passed on to every rank (to ``mpiexec`` for MPI, which
  passes it on itself). The ranks stop (see :mod:`parallelkit.train.ranks.stopping`); whatever is
  still running ``grace`` seconds later is killed. A second signal kills at once.
- When a rank exits non-zero, the others get SIGTERM and, ``FAIL_GRACE_S`` later, SIGKILL;
  the launcher names the rank that failed first. A rank that left because its collective
  failed or timed out (``PEER_FAILED_EXIT``) is not the cause: when only such ranks have left
  and others still run a moment later, those are named as the ranks that stopped answering
  (a rank stopped by SIGSTOP, or stuck without failing). Ranks that exit with
  ``REFUSED_EXIT`` stopped together and said why (:mod:`parallelkit.train.ranks.agree`): nothing
  is added.
- Each child runs in a session of its own, so a Ctrl-C at the terminal reaches the launcher
  only (once), and the launcher decides. Each rank also asks the kernel for SIGKILL
  when the launcher dies (``PR_SET_PDEATHSIG``), first thing, so even ``kill -9`` of the
  launcher while the ranks start leaves no rank behind (:mod:`parallelkit.train.ranks.rankproc`).
  mpiexec (Hydra) cleans up its own ranks when it dies.
- A child with a ``forked`` function is a fork of the launcher that calls it, instead of a new
  Python that runs ``command``: it keeps what the launcher imported and checked (about three
  seconds of CPU per rank), and is watched as a started command is (:class:`Forked`).
- With a :class:`~parallelkit.train.ranks.startup.Startup`, the start-up is watched too: ranks that
  have not reached their first collective ``parallel.timeout`` after they started are named and
  stopped as stalled ones are, and a check a rank failed is printed with its exit status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from parallelkit.comm.base import PEER_FAILED_EXIT
from parallelkit.train.ranks.agree import REFUSED as REFUSED_EXIT
from parallelkit.train.ranks.rankproc import LAUNCHER_PID as LAUNCHER_PID
from parallelkit.train.ranks.rankproc import Child as Child
from parallelkit.train.ranks.rankproc import Forked, start
from parallelkit.train.ranks.rankproc import forked_name as forked_name
from parallelkit.train.ranks.startup import Startup, failed_checks

GRACE_S = 30.0  # after a signal: time to finish the step, save a checkpoint and exit
FAIL_GRACE_S = 5.0  # after a rank failed: the others have nothing left to save
STUCK_EXIT = 1  # the job's status when ranks were stopped in their start-up
_POLL_S = 0.05
_START_CHECK_S = 1.0  # how often the ranks' start-up is looked at
_BLAME_S = 1.0  # how long a peer's failure may take to show after the ranks it took along


@dataclass
class _State:
    signum: int | None = None
    deadline: float | None = None
    failed: tuple[str, int] | None = None
    first_exit: float | None = None
    signals: list[int] = field(default_factory=list)
    startup: Startup | None = None
    started: float = 0.0  # when the start-up was last looked at
    watching: bool = True  # the start-up, until every rank is past it


def supervise(
    children: list[Child],
    grace: float = GRACE_S,
    serve: Callable[[], object] | None = None,
    startup: Startup | None = None,
) -> int:
    """Start ``children``, each in a new session, wait, and return the job's exit status:
    0 when all exit 0, else the first failure's status (128 + signal after a signal).
    ``serve()`` is called once they are started (a fork then copies none of its threads), and
    what it returns is kept until they have exited. ``startup``: the ranks' start-up is watched
    (its folder must be in the children's environments)."""
    state = _State(startup=startup, started=time.monotonic())
    procs: list[subprocess.Popen | Forked] = []
    previous = {}

    def on_signal(signum: int, frame: object) -> None:
        state.signals.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        for child in children:
            procs.append(start(child))
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
                checks = failed_checks(state.startup.errors()) if state.startup else []
                state.failed = (name, code)
                state.deadline = time.monotonic() + FAIL_GRACE_S
                what = "stopping the others" if len(procs) > 1 else "stopping"
                running = [(c, p) for c, p, code in zip(children, procs, codes, strict=True)
                           if code is None]  # fmt: skip
                if checks:  # a rank's own check: its line, which it left for the launcher
                    for line in checks:
                        _say(line)
                    if len(procs) > 1:
                        _say(f"{name} failed its checks first; stopping the others")
                elif code == REFUSED_EXIT:
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
        if _stuck(state):
            state.failed, state.deadline = ("start-up", STUCK_EXIT), time.monotonic() + FAIL_GRACE_S
            _kill(procs, signal.SIGTERM)
        if state.deadline is not None and time.monotonic() > state.deadline:
            _say("ranks still running after the grace period: killing them")
            _kill(procs, signal.SIGKILL)
            state.deadline = None
        time.sleep(_POLL_S)
    for line in failed_checks(state.startup.errors()) if state.startup else []:
        _say(line)  # checks failed by other ranks too, seen when the job ended
    if state.signum is not None:
        return 128 + state.signum
    if state.failed is not None:
        code = state.failed[1]
        return code if code > 0 else 128 - code
    return 0


def _stuck(state: _State) -> bool:
    """Whether a rank stayed ``parallel.timeout`` in one phase of its start-up (said in one
    line). Read about once a second, until every rank is past its first collective: after
    that the collectives' own timeouts watch the ranks."""
    startup, now = state.startup, time.monotonic()
    if startup is None or not state.watching or state.failed or state.signum is not None:
        return False
    if now - state.started < _START_CHECK_S:
        return False
    state.started = now  # the next look, a second from now
    if startup.done():
        state.watching = False
        return False
    late = startup.stuck()
    if late is not None:
        _say(late[1])
    return late is not None


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
