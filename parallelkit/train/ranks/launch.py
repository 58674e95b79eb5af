"""Start the ranks of ``parallelkit train``, or join the job a launcher started.

Under ``torchrun``, ``mpiexec``/``srun`` or ``torch_xla.launch`` every process is already a
rank: it joins the job (``pk.init("auto")`` reads the launcher's variables). Run from a plain
shell, ``parallelkit train`` starts ``parallel.ranks`` local ranks itself and supervises them
(:mod:`parallelkit.train.ranks.procs`: signals passed on, a failed rank stops the others, nothing
outlives the launcher):

    gloo / nccl          one process per rank with torchrun's variables (RANK, WORLD_SIZE,
                         MASTER_ADDR=127.0.0.1, MASTER_PORT, ...). The launcher hosts the
                         rendezvous store itself, on a socket bound to 127.0.0.1, and the
                         ranks' gloo/NCCL sockets use the loopback interface: nothing listens
                         on another interface. (torchrun cannot do this: its stores bind every
                         interface whatever --rdzv-endpoint says.) On Linux CPUs each rank is a
                         fork of the launcher, after its checks and before its store starts a
                         thread: a new Python would import torch again and redo what the
                         checks load, about three seconds of CPU per rank
                         (benchmarks/startup.py). A fork copies one thread, so the launcher
                         forks only while it runs no other (its checks run on one OpenMP
                         thread for this: :func:`checks_on_one_thread`); when a thread runs
                         (a data set's pool, say) every rank is a new process, and the header
                         says why (:func:`how_ranks_start`). GPU ranks start as new processes
                         (CUDA does not survive a fork), and so does every rank when
                         ``PARALLELKIT_FORK_RANKS=0``.
    mpi                  with MPICH: one process per rank, forked as above, whose MPI start-up
                         (PMI) the launcher serves over socket pairs
                         (:mod:`parallelkit.train.ranks.pmi`): nothing listens on any interface,
                         where mpiexec's control port would listen on all of them. With another
                         MPI: mpiexec -n N (the mpiexec next to this Python, else on PATH).
                         ``auto`` picks it for CPU ranks where mpi4py and MPICH are installed: a
                         small all-reduce takes 5-10 us there against about 1 ms on gloo.
    xla                  torch_xla.launch (one process per local XLA device)

One rank with the default backend runs in this process, without any launcher. Jobs over
several machines go through the user's own torchrun / srun / mpiexec (docs/training.md).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.util
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from parallelkit.comm import detect_backend, launcher
from parallelkit.train.ranks import openblas
from parallelkit.train.ranks.pmi import PmiServer
from parallelkit.train.ranks.procs import LAUNCHER_PID, Child, supervise
from parallelkit.train.ranks.rankproc import other_threads
from parallelkit.train.ranks.startup import Startup
from parallelkit.train.schema import Config

WORKER = [sys.executable, "-m", "parallelkit.cli", "train"]
PACKAGE_CLI = WORKER[:3]  # the worker of any command: python -m parallelkit.cli COMMAND
LOOPBACK = "127.0.0.1"


FORK_RANKS = "PARALLELKIT_FORK_RANKS"
"""``0``: every local rank is a new Python process, not a fork of the launcher."""


def under_launcher() -> bool:
    """True when a launcher started this process as one rank of a job
    (:func:`parallelkit.comm.launcher.detect`), or it is an XLA replica."""
    return detect_backend() != "local"


def explicit(key: str, path: str | None, overrides: list[str]) -> bool:
    """Whether the user set ``key`` (a dotted name) on the command line or in the YAML file."""
    if any(o.partition("=")[0].strip() == key for o in overrides):
        return True
    if path is None:
        return False
    node = yaml.safe_load(Path(path).read_text()) or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def check_world(cfg: Config, job: launcher.Launcher, ranks_set: bool) -> None:
    """Under a launcher the job's size is the launcher's: a ``parallel.ranks`` the user set
    that disagrees is refused, never silently replaced."""
    if job.name != "none" and ranks_set and cfg.parallel.ranks != job.world:
        raise ValueError(
            f"parallel.ranks={cfg.parallel.ranks}, but {job.name} started {job.world} ranks "
            f"({job.why}); drop parallel.ranks, or start {cfg.parallel.ranks} with {job.name}"
        )


def local_command(cfg: Config, argv: list[str], command: str = "train") -> list[str] | None:
    """The command that starts ``parallel.ranks`` ranks of ``parallelkit COMMAND`` here:
    ``mpiexec ...`` for MPI, the worker command (started once per rank) otherwise; None: run
    in this process."""
    worker = [*PACKAGE_CLI, command]
    n, backend = cfg.parallel.ranks, cfg.parallel.backend
    if backend == "xla":
        return None  # torch_xla.launch is a function, called by launch_xla
    if n == 1 and backend in ("auto", "local"):
        return None
    if backend == "local":
        raise ValueError(f"parallel.backend=local runs one rank; got parallel.ranks={n}")
    if backend == "mpi" and not mpich_available():
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise ValueError("parallel.backend=mpi: no mpiexec found (pip install mpich)")
        return [mpiexec, "-n", str(n), *worker, *argv]
    return [*worker, *argv]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def find_mpiexec() -> str | None:
    """The ``mpiexec`` that ``parallel.backend=mpi`` starts: the one next to this Python (a
    venv's pip-installed MPICH), else the one on PATH."""
    beside = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    return beside or shutil.which("mpiexec")


def mpi_available() -> bool:
    """mpi4py and an ``mpiexec``: ``parallel.backend=mpi`` would run here."""
    return find_mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None


def mpich_available() -> bool:
    """mpi4py and MPICH (its ``mpichversion`` beside the ``mpiexec`` found): the launcher can
    start MPI ranks itself, serving their PMI (:mod:`parallelkit.train.ranks.pmi`)."""
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        return False
    return shutil.which("mpichversion", path=str(Path(mpiexec).parent)) is not None


def local_mpi(backend: str, cuda: bool, ranks: int) -> bool:
    """Whether the local ranks the launcher starts use MPI over its own PMI: asked for with
    MPICH installed, or ``auto`` on CPUs where it is (5-10 us a small all-reduce against
    gloo's 1 ms; every socket stays on loopback, as gloo's) and each rank's threads have a
    core each: MPICH waits by spinning, which would take the cores of the ranks that compute."""
    if backend == "mpi":
        return mpich_available()
    return backend == "auto" and not cuda and not oversubscribed(ranks) and mpich_available()


def oversubscribed(ranks: int) -> str | None:
    """Why ``ranks`` local ranks of ``OMP_NUM_THREADS`` threads (1 unless set) would share
    cores, or None."""
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    threads = int(threads) if threads.isdigit() and int(threads) > 0 else 1
    if ranks * threads <= cores():
        return None
    each = f" of {threads} threads" if threads > 1 else ""
    return f"{ranks} ranks{each} on {cores()} cores"


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launch(
    command: list[str],
    ranks: int = 1,
    backend: str = "auto",
    entry: Callable[[list[str]], int] | None = None,
    timeout: float | None = None,
) -> int:
    """Run :func:`local_command`'s command (``ranks`` copies for torch backends) under
    supervision and wait; the exit status is the job's. ``entry`` (``parallelkit.cli.main``)
    runs the command's arguments in a forked rank (:func:`how_ranks_start`); without it every
    rank is a new process. ``timeout`` (``parallel.timeout``): the ranks that have not reached
    their first collective that long after they started are named and stopped."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    processes = command[: len(PACKAGE_CLI)] == PACKAGE_CLI  # else mpiexec
    cuda = processes and cuda_available()
    mpi = processes and local_mpi(backend, cuda, ranks)
    crowded = oversubscribed(ranks)
    stop_library_threads()
    fork, how = how_ranks_start(backend, cuda) if processes else (False, "mpiexec")
    why = launcher.detect().why
    env[launcher.STARTED] = f"{ranks} local ranks started by parallelkit ({how}): {why}"
    if mpi:
        env[launcher.STARTED] += "; MPI, started by the launcher itself: every socket on loopback"
    elif backend == "auto" and processes and not cuda and crowded:
        env[launcher.STARTED] += f"; gloo, which waits without spinning: {crowded}"
    elif backend == "auto" and processes and not cuda:
        env[launcher.STARTED] += "; gloo (pip install mpi4py mpich: MPI is faster on CPUs)"
    startup = Startup(ranks, timeout) if timeout is not None else None
    env.update(startup.env if startup else {})
    try:
        if not processes:  # mpiexec, which cleans up its ranks
            return supervise([Child(command, {**mpi_loopback_env(), **env}, "mpiexec")],
                             startup=startup)  # fmt: skip
        env[LAUNCHER_PID] = str(os.getpid())
        args = command[len(PACKAGE_CLI) :]
        if mpi:
            pmi = PmiServer(ranks)
            children = []
            for rank in range(ranks):
                close = functools.partial(pmi.in_rank, rank)
                own = {**mpi_loopback_env(), **env, **pmi.rank_env(rank),
                       **rank_numbers(rank, ranks)}  # fmt: skip
                forked = forked_rank(entry, args, close) if fork and entry else None
                children.append(Child(command, own, f"rank {rank}", forked, (pmi.rank_fd(rank),)))
            return supervise(children, serve=pmi.serve, startup=startup)
        with loopback_socket() as sock:
            port = sock.getsockname()[1]
            children = [
                Child(
                    command,
                    {**env, **rank_env(rank, ranks, port)},
                    f"rank {rank}",
                    forked=forked_rank(entry, args, sock.close) if fork and entry else None,
                )
                for rank in range(ranks)
            ]
            return supervise(children, serve=lambda: store_on(sock), startup=startup)
    finally:
        if startup is not None:
            startup.close()


def how_ranks_start(backend: str, cuda: bool) -> tuple[bool, str]:
    """Whether the local ranks are forks of this process, and the header's words for it. On
    Linux, CPU ranks (``cuda``: torch sees a GPU here) are forked while this process runs no
    thread but its main one: a fork copies that thread alone, and a lock or barrier another
    thread holds (OpenMP's pool at ``gomp_team_barrier_wait_end``, a data set's thread pool)
    would stay held in the fork for ever. ``PARALLELKIT_FORK_RANKS=0``: never forked."""
    if not sys.platform.startswith("linux") or os.environ.get(FORK_RANKS, "1") == "0":
        return False, "processes"
    if backend not in ("auto", "gloo", "mpi") or cuda:
        return False, "processes"  # CUDA does not survive a fork
    if "mpi4py.MPI" in sys.modules:
        return False, "processes, not forks: MPI was started in the launcher"
    threads = other_threads()
    if threads:
        return False, (f"processes, not forks: the launcher runs {threads + 1} threads, which "
                       "a fork would not copy")  # fmt: skip
    return True, "forked processes"


def stop_library_threads() -> None:
    """Stop the threads that the launcher started in a library that can stop them, so that the
    ranks can be forks: numpy's OpenBLAS pool (:mod:`parallelkit.train.ranks.openblas`), and zarr's
    IO loop and its executor (the checks read the data's stores; zarr starts them again when it
    next needs them, in the launcher or a rank)."""
    openblas.stop_pool()
    sync = sys.modules.get("zarr.core.sync")
    running = sync is not None and getattr(sync, "loop", [None])[0] is not None
    if not running or not hasattr(sync, "cleanup_resources"):
        return  # zarr not imported, or it runs no loop
    sync.cleanup_resources()
    # The loop's own executor threads were told to stop, not waited for: a moment for them to
    # exit. They are Python threads: an OpenMP pool, which stays, costs no wait.
    deadline = time.monotonic() + 5.0  # a loaded machine: seconds; else milliseconds
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def checks_on_one_thread(cfg: Config) -> int | None:
    """Before the launcher's checks: when its ranks will be forks, let torch's operations run on
    one thread here, so that no OpenMP pool exists to be lost in the forks (each fork sets
    ``OMP_NUM_THREADS``'s count again). Returns the count to restore when no rank is forked
    after all (one rank, run here), else None."""
    if not sys.platform.startswith("linux") or os.environ.get(FORK_RANKS, "1") == "0":
        return None
    if cfg.parallel.ranks < 2 or cfg.parallel.backend not in ("auto", "gloo", "mpi"):
        return None
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


def forked_rank(
    entry: Callable[[list[str]], int], args: list[str], close: Callable[[], None]
) -> Callable[[], int]:
    """What a forked rank runs: ``entry(args)``, as the new process would run its command,
    after ``close()`` drops the launcher's descriptors that are not the rank's (its store's
    listening socket, the other ranks' PMI pairs)."""

    def rank() -> int:
        close()
        return entry(args)

    return rank


def rank_numbers(rank: int, world: int) -> dict[str, str]:
    """torchrun's numbers of one local rank, which every local rank has whatever its transport
    (a user's code reads ``RANK``); MPI's ranks have them beside MPI's own, which they equal."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
    }


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for one local rank, pointing at the launcher's store."""
    env = {
        **rank_numbers(rank, world),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        # Every rank is a client of the launcher's store (rank 0 hosts none of its own).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    loopback = _loopback_interface()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if loopback and var not in os.environ:
            env[var] = loopback
    return env


def mpi_loopback_env() -> dict[str, str]:
    """The variables that keep the MPI ranks' own sockets on the loopback interface (libfabric's
    tcp and sockets providers, UCX); the user's settings win. Hydra's control port, which
    ``mpiexec`` opens for its proxies, listens on every interface whatever its options
    (``-iface``, ``-host``, ``-localhost``): measured with ``ss -ltnp``, docs/training.md."""
    loopback = _loopback_interface()
    if loopback is None:
        return {}
    return {var: loopback for var in ("FI_TCP_IFACE", "FI_SOCKETS_IFACE", "UCX_NET_DEVICES")}


@contextlib.contextmanager
def loopback_socket() -> Iterator[socket.socket]:
    """A listening socket bound to 127.0.0.1 only, for the launcher's store (:func:`store_on`).

    It is bound here and handed to the store (``master_listen_fd``), because the store binds
    every interface when it opens the socket itself. Ranks may connect before the store
    serves: the kernel queues them.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        yield sock
    finally:
        sock.close()  # the store has a copy of the descriptor (see store_on)


def store_on(sock: socket.socket) -> object:
    """A TCPStore served from this process on ``sock``; serves until it is dropped."""
    import torch.distributed as dist

    fd = os.dup(sock.fileno())  # the store closes the descriptor it was given
    try:
        return dist.TCPStore(
            LOOPBACK,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=fd,
            timeout=datetime.timedelta(seconds=300),
        )
    except BaseException:
        os.close(fd)
        raise


def _loopback_interface() -> str | None:
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def _xla_rank(index: int, entry: Callable[[Config], object], cfg: Config) -> None:
    entry(cfg)


def launch_xla(entry: Callable[[Config], object], cfg: Config) -> None:
    """``entry(cfg)`` (the trainer's run) as one rank per local XLA device, under
    torch_xla.launch (multi-host: one call per host)."""
    import torch_xla

    torch_xla.launch(_xla_rank, args=(entry, cfg))
