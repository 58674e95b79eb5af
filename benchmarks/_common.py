"""Helpers that every script under benchmarks/ uses: timing on ranks, the machine, saving.

The benchmark scripts are run as files (``python benchmarks/collectives.py``), which puts this
folder first on ``sys.path``, so they import from here with ``from _common import ...`` (and
spawned ranks inherit that path). What lives here is the part they share to the letter:

- timing on the ranks: ``Sync`` (barrier and max-reduction over the ranks), ``torch_sync``,
  ``time_block`` / ``time_block_cpu`` (seconds per call on the slowest rank), ``choose_iters``
  (calls per block) and ``alternating`` (the order of the variants round by round);
- the split of a step: ``timed_methods`` adds up the time spent inside each kind of the
  communicator's collectives (``CATEGORIES``), and ``ByteCounter`` the halo bytes;
- the load that other processes put on the machine meanwhile, from /proc (``OtherLoad``);
- the description of a run: ``environment``, ``library_state`` and ``command_line``;
- ``save``: the markdown report and the JSON record next to it, and the record's PNG plots
  (plots.py; skipped with a note where matplotlib, the ``plot`` extra, is not installed).

What each script measures, and its tables, stay in the script.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch

WARMUP = 3  # untimed calls of every variant before calibrating
MIN_ITERS = 3
MAX_ITERS = 10_000


# ---------------------------------------------------------------------------- timing (ranks)
class Sync(NamedTuple):
    """The raw backend's barrier and max-reduction of one float, used around timed blocks."""

    barrier: Callable[[], None]
    max: Callable[[float], float]


def torch_sync(group: Any) -> Sync:
    """``Sync`` on a torch.distributed process group."""
    import torch.distributed as dist

    def allmax(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    return Sync(lambda: dist.barrier(group=group), allmax)


def time_block(fn: Callable[[], object], iters: int, sync: Sync) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, on the slowest rank."""
    sync.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return sync.max(time.perf_counter() - start) / iters


def time_block_cpu(fn: Callable[[], object], iters: int, sync: Sync) -> tuple[float, float]:
    """Seconds per call of ``fn`` over ``iters`` calls on the slowest rank: wall and CPU time.

    CPU time counts all threads of the rank (gloo's too), so it is what the rank consumed,
    whereas wall time also holds waiting for peers and for cores that others hold.
    """
    sync.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(iters):
        fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sync.max(wall) / iters, sync.max(cpu) / iters


def choose_iters(fn: Callable[[], object], sync: Sync, target_s: float) -> int:
    """Calls per timed block so that a block lasts about ``target_s`` (at least MIN_ITERS).

    Every rank gets the same answer, since block times are all-reduced with max.
    """
    iters = 1
    while True:
        total = time_block(fn, iters, sync) * iters
        if total >= target_s / 10 or iters >= MAX_ITERS:
            return max(MIN_ITERS, min(MAX_ITERS, round(iters * target_s / total)))
        iters *= 4


def alternating(names: Sequence[str], rounds: int) -> Iterator[str]:
    """The variants to time, round by round: in order on even rounds, reversed on odd ones."""
    for r in range(rounds):
        yield from names if r % 2 == 0 else names[::-1]


# ---------------------------------------------------------------------------- split (ranks)
CATEGORIES = {
    "neighbor_exchange": "halo exchange",
    "all_reduce": "reductions",
    "all_gather": "reductions",
    "all_reduce_async": "reductions",
    "all_gather_ints": "host metadata",
}
"""The communicator's methods that ``timed_methods`` times, and the kind each counts as."""


@contextlib.contextmanager
def timed_methods(comm: Any, spent: dict[str, float]) -> Iterator[None]:
    """Add the time the calling thread spends in each of comm's ``CATEGORIES`` methods to
    ``spent[kind]`` while inside (an asynchronous all-reduce: the time of its ``wait``).

    The spatial layers call these methods from inside autograd, where nothing else can tell
    their time apart; only this instance is wrapped, so the class and every other
    communicator stay untouched, and leaving restores its methods. Time inside a collective
    includes waiting for the other ranks, so imbalance shows as communication.
    """
    for method, kind in CATEGORIES.items():
        setattr(comm, method, _timed(getattr(comm, method), kind, spent))
    try:
        yield
    finally:
        for method in CATEGORIES:
            delattr(comm, method)  # the class's methods again


def _timed(fn: Callable, kind: str, spent: dict[str, float]) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if hasattr(out, "wait"):  # an asynchronous all-reduce: time its wait
            return _TimedWork(out, kind, spent)
        spent[kind] += time.perf_counter() - start
        return out

    return call


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` adds its time to ``spent[kind]``."""

    def __init__(self, work: Any, kind: str, spent: dict[str, float]) -> None:
        self.work, self.kind, self.spent = work, kind, spent

    def wait(self) -> Any:
        start = time.perf_counter()
        out = self.work.wait()
        self.spent[self.kind] += time.perf_counter() - start
        return out


# ---------------------------------------------------------------------------- load (parent)
def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat (clock ticks)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


def tree_jiffies() -> int:
    """CPU time (clock ticks) of this process and its descendants, living or reaped."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    mine, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        mine.add(pid)
        todo += [p for p, pp in parent.items() if pp == pid and p not in mine]
    return sum(ticks[p] for p in mine if p in ticks)


class OtherLoad:
    """Cores that processes outside this one and its descendants keep busy, from creation on.

    Ranks must have been joined (or still be alive) when ``cores`` is read: a reaped child's
    CPU time is in this process's cutime and cstime.
    """

    def __init__(self) -> None:
        self.busy, self.total = cpu_jiffies()
        self.mine = tree_jiffies()

    def cores(self) -> float:
        """Average busy cores of the other processes since creation (0 or more)."""
        busy, total = cpu_jiffies()
        others = busy - self.busy - (tree_jiffies() - self.mine)
        return max(0.0, others / max(1, total - self.total) * os.cpu_count())


# ---------------------------------------------------------------------------- the run (parent)
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or "unknown"."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return cpu


def library_state() -> str:
    """The commit measured, and whether parallelkit/ held uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head, dirty = (
            subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            ).stdout.strip()
            for args in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "parallelkit"])
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    changed = len(dirty.splitlines())
    return f"commit {head}" + (f" + uncommitted changes to {changed} file(s)" if changed else "")


def environment(**extra: str) -> dict[str, str]:
    """Versions and machine, for the header of the results; ``extra`` entries follow torch's."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **extra,
        "cpu": cpu_model(),
        "nproc": str(os.cpu_count()),
    }


def command_line() -> str:
    """The command that ran this script, with OMP_NUM_THREADS when it was set."""
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = [f"OMP_NUM_THREADS={threads}"] if threads else []
    return shlex.join([*prefix, os.path.relpath(sys.executable), *sys.argv])


def save(out: Path, markdown: str, env: dict[str, str], cfg: Any, rows: list, **extra: Any) -> Path:
    """Write ``markdown`` to ``out`` and the record of the run next to it; returns the JSON path.

    The record holds command, env, config (the dataclass ``cfg``), the ``extra`` entries and
    rows, in that order.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    record = {"command": command_line(), "env": env, "config": asdict(cfg), **extra, "rows": rows}
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    draw_plots(json_path)
    return json_path


def draw_plots(json_path: Path) -> None:
    """The PNGs of a saved record, next to it (plots.py), or a note saying why not."""
    try:
        from plots import plot
    except ImportError as exc:  # matplotlib is the optional ``bench`` extra
        print(f"no plots for {json_path.name}: {exc}", file=sys.stderr)
        return
    for png in plot(json_path):
        print(f"wrote {png}")


class ByteCounter:
    """Counts the bytes of every tensor this rank hands to ``comm.neighbor_exchange``.

    Messages to other ranks are ``sent`` / ``received``; messages to itself (a rank's own rows,
    which gather_rows routes through the exchange and the communicator copies locally) are
    ``self_copied`` and do not cross the network. Wraps the method on the instance only.
    """

    def __init__(self, comm: Any) -> None:
        self.comm, self.sent, self.received, self.self_copied = comm, 0, 0, 0

    def __enter__(self) -> ByteCounter:
        inner, rank = self.comm.neighbor_exchange, self.comm.rank

        def counted(send, recv):  # type: ignore[no-untyped-def]
            for peer, t in send:
                nbytes = t.numel() * t.element_size()
                if peer == rank:
                    self.self_copied += nbytes
                else:
                    self.sent += nbytes
            self.received += sum(b.numel() * b.element_size() for p, b in recv if p != rank)
            return inner(send, recv)

        self.comm.neighbor_exchange = counted
        return self

    def __exit__(self, *exc: object) -> None:
        del self.comm.neighbor_exchange  # the class's method again

    def snapshot(self) -> dict[str, int]:
        return {"sent": self.sent, "received": self.received, "self_copied": self.self_copied}
