"""Helpers that every script under benchmarks/ uses: timing on ranks, the machine, saving.

The benchmark scripts are run as files (``python benchmarks/collectives.py``), which puts this
folder first on ``sys.path``, so they import from here with ``from _common import ...`` (and
spawned ranks inherit that path). What lives here is the part they share to the letter:

- timing on the ranks: ``Sync`` (barrier and max-reduction over the ranks), ``torch_sync``,
  ``time_block`` / ``time_block_cpu`` (seconds per call on the slowest rank), ``choose_iters``
  (calls per block) and ``alternating`` (the order of the variants round by round);
  ``comm_sync`` picks the barrier of a gloo or an MPI communicator;
- the ceiling of a scaling benchmark: ``ceiling_rows`` (the rows a rank's dense share runs
  on) and ``scaling`` (speedup, ceiling speedup and efficiency from the step times);
- ranks under MPI: ``run_mpi`` starts a script's ranks under mpiexec, ``mpi_worker`` is the
  rank's side (a hidden ``--worker JOB OUT`` flag of the script);
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
import pickle
import platform
import shlex
import subprocess
import sys
import tempfile
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
    """The raw backend's barrier and max-reduction of one float, used around timed blocks.

    ``idle`` is a barrier for a rank that has nothing to do while another computes alone: it
    must not take a core from it. gloo's barrier sleeps; MPI's spins (MPICH's takes ~30 % of a
    core), so MPI's ``idle`` polls a non-blocking barrier with short sleeps.
    """

    barrier: Callable[[], None]
    max: Callable[[float], float]
    idle: Callable[[], None] | None = None

    def wait_idle(self) -> None:
        """``idle`` where there is one, else ``barrier``."""
        (self.idle or self.barrier)()


def torch_sync(group: Any) -> Sync:
    """``Sync`` on a torch.distributed process group."""
    import torch.distributed as dist

    def allmax(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    return Sync(lambda: dist.barrier(group=group), allmax)


def mpi_sync(mc: Any) -> Sync:
    """``Sync`` on an mpi4py communicator."""
    from mpi4py import MPI

    def idle() -> None:
        request = mc.Ibarrier()
        while not request.Test():
            time.sleep(1e-3)

    return Sync(mc.Barrier, lambda x: mc.allreduce(x, op=MPI.MAX), idle)


def comm_sync(comm: Any) -> Sync:
    """``Sync`` on a parallelkit communicator: its process group (gloo) or its mpi4py comm."""
    return mpi_sync(comm.comm) if comm.backend == "mpi" else torch_sync(comm.group)


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


# ---------------------------------------------------------------------------- ceiling
def ceiling_rows(total: int, parts: int, rank: int, halo: int, align: int = 1) -> slice:
    """The rows of a ``total``-row dimension that rank ``rank`` of ``parts`` runs its dense
    share of a ceiling variant on: its ``torch.tensor_split`` block, extended by ``halo`` rows
    on each side that has a neighbour, then by as many more as make its length a multiple of
    ``align`` (a network whose shapes need it, as a U-Net's skips do), within the dimension.

    The ceiling is each rank computing its share of the dense work with no communication; the
    halo stands for the rows a rank needs from its neighbours, not the network's whole
    receptive field (that would recompute work no parallel variant does, and flatter them).
    """
    from parallelkit.geometry import tensor_split_sizes

    sizes = tensor_split_sizes(total, parts)
    start = sum(sizes[:rank])
    lo, hi = max(0, start - halo), min(total, start + sizes[rank] + halo)
    while (hi - lo) % align and (hi - lo) < total:
        if hi < total:
            hi += 1
        else:
            lo -= 1
    return slice(lo, hi)


def scaling(dense: float, ceiling: float, variant: float) -> dict[str, float]:
    """Speedup, ceiling speedup and efficiency of a parallel variant, from three step times.

    speedup = dense / variant; ceiling speedup = dense / ceiling, the step every rank takes
    running its own share of the dense work at the same time as the others, without
    communication (on a shared CPU node less than P: the ranks share memory bandwidth and
    clocks); efficiency = speedup / ceiling speedup (= ceiling / variant), the part of the
    attainable speedup the variant gets.
    """
    speedup, ceiling_speedup = dense / variant, dense / ceiling
    return {
        "speedup": speedup,
        "ceiling_speedup": ceiling_speedup,
        "efficiency": speedup / ceiling_speedup,
    }


# ---------------------------------------------------------------------------- MPI ranks
def keep_freed_memory(glibc_defaults: bool = False) -> str:
    """Give every rank this benchmark starts from now on, of any framework, the malloc
    settings that parallelkit's ranks make in-process (``parallelkit.train.loop.allocator``), as
    glibc's variables, unless ``glibc_defaults``; the line that says which, for the header.

    A CPU step that frees and allocates the same large blocks faults their pages in again
    under glibc's defaults (a BatchNorm2d's step twice as long): the frameworks compared get
    the same settings, so that none is timed with page faults the others do not pay.
    """
    from parallelkit.train.loop import allocator

    if glibc_defaults:
        return "glibc's defaults (--glibc-defaults)"
    kept = {
        "MALLOC_MMAP_THRESHOLD_": str(allocator.MMAP_THRESHOLD_MAX),
        "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD),
    }
    os.environ.update(kept)
    settings = " ".join(f"{k}={v}" for k, v in kept.items())
    return f"freed memory kept in every rank ({settings}), as parallelkit's ranks do"


def mpiexec() -> str:
    """The mpiexec next to this Python (a venv's mpi4py), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def run_mpi(script: str, n: int, args: tuple, timeout: float) -> list[Any]:
    """``n`` ranks of ``script --worker JOB OUT`` under mpiexec; every rank's result, by rank.

    ``args`` travel to the ranks by pickle in the file JOB, the results back in OUT. The ranks
    run the script as ``__main__``, as the parent does, so its classes unpickle on both sides.
    """
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp, "job.pkl"), Path(tmp, "out.pkl")
        job.write_bytes(pickle.dumps(args))
        command = [mpiexec(), "-n", str(n), sys.executable, script, "--worker", str(job), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env, timeout=timeout)
        return pickle.loads(out.read_bytes())


def mpi_worker(fn: Callable[..., Any], job: str, out: str, timeout: float) -> None:
    """One rank under mpiexec: ``fn(comm, *args)`` on ``pk.init("mpi")``; rank 0 writes every
    rank's result to ``out``."""
    torch.set_num_threads(1)
    import parallelkit as pk

    comm = pk.init("mpi", timeout=timeout)
    results = comm.comm.gather(fn(comm, *pickle.loads(Path(job).read_bytes())), root=0)
    if comm.rank == 0:
        Path(out).write_bytes(pickle.dumps(results))


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
