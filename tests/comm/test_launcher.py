"""pk.init as users launch it: torchrun picks gloo by itself; bad set-ups raise ValueError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallelkit as pk
from parallelkit.comm import detect_backend, launcher
from parallelkit.testing import free_port

SCRIPTS = Path(__file__).parents[1] / "scripts"


def test_torchrun_auto_picks_gloo():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "3",
        "--master-port",
        str(free_port()),
        str(SCRIPTS / "torchrun_allreduce.py"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        assert f"rank {rank}/3 backend=gloo sum=6" in proc.stdout


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "local"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "1234"}, "gloo"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1234"}, "local"),  # left over: refused
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "local"),  # sbatch's batch script
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, "mpi"),  # srun
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "local"),
    ],
)
def test_detect_backend(monkeypatch, env, expected):
    for var in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "MASTER_PORT",
        "PMI_RANK",
        "PMI_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_STEP_ID",
        "SLURM_STEP_NUM_TASKS",
        "TORCHELASTIC_RUN_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert detect_backend() == expected


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        pk.init("tcp")


def test_gloo_without_torchrun_variables_says_what_is_missing(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_PORT not set"):
        pk.init("gloo")


def test_local_communicator_is_a_copy():
    comm = pk.init("local")
    x = torch.arange(6.0).view(2, 3)
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "local")
    for y in (
        comm.all_reduce(x, "mean"),
        comm.all_gather(x, 1),
        comm.reduce_scatter(x),
        comm.broadcast(x),
        comm.reduce(x),
        comm.all_reduce_async(x).wait(),
    ):
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    (got,) = comm.neighbor_exchange([(0, x)], [(0, torch.empty(2, 3))])
    assert torch.equal(got, x)
    assert comm.split(3).size == 1
    comm.barrier()


def test_cli_info():
    proc = subprocess.run(
        [sys.executable, "-m", "parallelkit.cli", "info"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert f"torch {torch.__version__}" in proc.stdout and "pk.init('auto')" in proc.stdout


def test_debug_and_timeout_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PARALLELKIT_DEBUG", "1")
    monkeypatch.setenv("PARALLELKIT_TIMEOUT", "7.5")
    comm = pk.init("local")
    assert comm.debug and comm.timeout == 7.5
    assert not pk.init("local", debug=False).debug


@pytest.mark.parametrize(
    ("backend", "mpich", "cuda", "says"),
    [("auto", True, False, "; MPI, started by the launcher itself: every socket on loopback"),
     ("mpi", True, False, "; MPI, started by the launcher itself: every socket on loopback"),
     ("auto", False, False, "; gloo (pip install mpi4py mpich: MPI is faster on CPUs)"),
     ("gloo", True, False, ""), ("auto", True, True, "")],
)  # fmt: skip
def test_the_header_names_the_local_ranks_transport(monkeypatch, backend, mpich, cuda, says):
    # The launcher's line of the run's header says which transport auto chose for local ranks:
    # MPI where mpi4py and MPICH are installed, on CPUs; gloo, and the faster one, otherwise.
    from parallelkit.train.ranks import launch

    seen = {}
    monkeypatch.setattr(launch, "mpich_available", lambda: mpich)
    monkeypatch.setattr(launch, "cuda_available", lambda: cuda)
    monkeypatch.setattr(launch, "cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(
        launch, "supervise", lambda children, **_: seen.update(children[0].env) or 0
    )
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 2, backend) == 0
    assert seen[launcher.STARTED].endswith("are set" + says), seen[launcher.STARTED]
    assert ("PMI_RANK" in seen) == bool(says.startswith("; MPI"))


def test_auto_keeps_gloo_when_the_ranks_outnumber_the_cores(monkeypatch):
    # MPICH's waiting ranks spin: with more ranks (or their OpenMP threads) than cores they
    # would take the cores of the ranks that compute. parallel.backend=mpi is still MPI.
    from parallelkit.train.ranks import launch

    seen = {}
    monkeypatch.setattr(launch, "mpich_available", lambda: True)
    monkeypatch.setattr(launch, "cuda_available", lambda: False)
    monkeypatch.setattr(launch, "cores", lambda: 2)
    monkeypatch.setattr(
        launch, "supervise", lambda children, **_: seen.update(children[0].env) or 0
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 4, "auto") == 0
    started = seen[launcher.STARTED]
    assert started.endswith("; gloo, which waits without spinning: 4 ranks on 2 cores"), started
    assert "PMI_RANK" not in seen and "MASTER_PORT" in seen
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 4, "mpi") == 0
    assert "PMI_RANK" in seen
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # 2 ranks of 2 threads: 4 cores wanted
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 2, "auto") == 0
    started = seen[launcher.STARTED]
    assert started.endswith("2 ranks of 2 threads on 2 cores"), started


def test_local_mpi_ranks_get_the_launchers_pmi_and_torchruns_numbers(monkeypatch):
    # Each MPI rank: its end of a socket pair (PMI_FD, kept by a new process), MPI's and
    # torchrun's numbers, which agree, and no store: it is MPI's rank, not torchrun's.
    from parallelkit.comm import launcher
    from parallelkit.train.ranks import launch

    seen = []
    monkeypatch.setattr(launch, "mpich_available", lambda: True)
    monkeypatch.setattr(launch, "cores", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(launch, "other_threads", lambda: 0)
    monkeypatch.setattr(launch, "supervise", lambda children, **_: seen.extend(children) or 0)
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 3, "auto", entry=lambda a: 0) == 0
    for rank, child in enumerate(seen):
        assert child.env["PMI_FD"] == str(child.fds[0]) and child.forked is not None
        assert child.env["PMI_RANK"] == child.env["RANK"] == str(rank)
        assert child.env["PMI_SIZE"] == child.env["WORLD_SIZE"] == "3"
        assert "MASTER_PORT" not in child.env
        job = launcher.detect(child.env)
        assert (job.name, job.rank, job.world) == ("mpiexec", rank, 3)
    assert len({c.fds[0] for c in seen}) == 3


@pytest.mark.parametrize(
    ("backend", "cuda", "variable", "forked"),
    [("auto", False, None, True), ("gloo", False, None, True), ("auto", True, None, False),
     ("nccl", True, None, False), ("auto", False, "0", False), ("auto", False, "1", True)],
)  # fmt: skip
def test_cpu_ranks_are_forks_of_the_launcher(monkeypatch, backend, cuda, variable, forked):
    # On Linux CPUs each local rank is a fork that runs the same command line; GPU ranks and
    # PARALLELKIT_FORK_RANKS=0 start new processes. The header says which.
    from parallelkit.train.ranks import launch

    if not sys.platform.startswith("linux"):
        forked = False
    if variable is None:
        monkeypatch.delenv(launch.FORK_RANKS, raising=False)
    else:
        monkeypatch.setenv(launch.FORK_RANKS, variable)
    seen = []
    monkeypatch.setattr(launch, "cuda_available", lambda: cuda)
    monkeypatch.setattr(launch, "mpich_available", lambda: False)  # gloo's ranks here
    monkeypatch.setattr(launch, "other_threads", lambda: 0)  # pytest's threads are not the point
    monkeypatch.setattr(launch, "supervise", lambda children, **_: seen.extend(children) or 0)
    ran = []

    def entry(args: list[str]) -> int:
        ran.append(args)
        return 0

    assert launch.launch([*launch.PACKAGE_CLI, "train", "a=1"], 2, backend, entry=entry) == 0
    assert [c.forked is not None for c in seen] == [forked, forked]
    assert ("(forked processes)" in seen[0].env[launcher.STARTED]) == forked
    assert [c.env["RANK"] for c in seen] == ["0", "1"]
    if forked:  # a fork runs the command's arguments, as the new process would
        assert seen[1].forked() == 0 and ran == [["train", "a=1"]]


_ZARR_THEN_FORK = """
import os, sys
import numpy as np, zarr
from parallelkit.train.ranks import launch
from parallelkit.train.ranks.rankproc import other_threads
z = zarr.create_array(sys.argv[1], shape=(4, 4), dtype="f4")
z[:] = np.arange(16, dtype="f4").reshape(4, 4)  # the launcher's checks read a store so
started = other_threads()
launch.stop_library_threads()
print(started, other_threads(), launch.how_ranks_start("gloo", False)[0])
pid = os.fork()
if pid == 0:  # a forked rank reads and writes the store again
    z = zarr.open_array(sys.argv[1])
    z[0, 0] = 100.0
    os._exit(0 if float(z[:].sum()) == 220.0 else 1)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), float(zarr.open_array(sys.argv[1])[0, 0]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux")
def test_zarrs_threads_stopped_after_the_checks_let_the_ranks_be_forks(tmp_path):
    # Reading a zarr store starts zarr's IO thread and its executor; the launcher stops them
    # after its checks, so the ranks are forks (not new processes, each importing torch again),
    # and zarr starts its threads again in a fork that reads the store.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _ZARR_THEN_FORK, str(tmp_path / "a.zarr")],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads, after, forked = proc.stdout.split()[:3]
    assert int(threads) > 0  # not vacuous: zarr did start threads
    assert (int(after), forked) == (0, "True")
    assert proc.stdout.split()[3:] == ["0", "100.0"]


_OPENBLAS_THEN_FORK = """
import os, sys
import numpy as np
import torch  # noqa: F401 (as the launcher imports it)
from parallelkit.train.ranks import launch, openblas
from parallelkit.train.ranks.rankproc import Child, Forked, other_threads
a = np.random.default_rng(0).random((300, 300))
want = a @ a  # on OpenBLAS's pool
started = other_threads()
launch.stop_library_threads()
print(started, other_threads(), launch.how_ranks_start("gloo", False)[0])

def rank():  # the launcher's count, or the one its OMP_NUM_THREADS asks for
    same = np.allclose(a @ a, want, rtol=1e-12, atol=0)  # maybe summed in another order
    return (10 + openblas.threads()[0]) if same else 1

env = {**os.environ, **dict(kv.split("=") for kv in sys.argv[1:])}
print(Forked(Child([], env, "rank 0", forked=rank)).wait(60), np.array_equal(a @ a, want))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenBLAS starts no pool")
def test_numpys_openblas_pool_stopped_lets_the_ranks_be_forks():
    # With OMP_NUM_THREADS and OPENBLAS_NUM_THREADS unset (a user's usual environment), numpy's
    # OpenBLAS starts a pool of threads when torch imports it, and every rank was a new
    # process. The launcher stops the pool, as OpenBLAS does before a fork; a BLAS call starts
    # it again, in the fork and in the launcher, with the same results; a forked rank whose
    # OMP_NUM_THREADS is 1 (the ranks' default) computes on one, as a new process would.
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}  # fmt: skip
    asked = {"rank's": ["OMP_NUM_THREADS=1"], "OpenBLAS's own": ["OMP_NUM_THREADS=2",
             "OPENBLAS_NUM_THREADS=1"], "none": []}  # fmt: skip
    results = {}
    for name, variables in asked.items():
        proc = subprocess.run([sys.executable, "-c", _OPENBLAS_THEN_FORK, *variables],
                              capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        threads, after, forked, *results[name] = proc.stdout.split()
        assert int(threads) > 0  # not vacuous: OpenBLAS did start its pool
        assert (int(after), forked) == (0, "True")
    # the fork's OpenBLAS on 1 thread, its results right; OPENBLAS_NUM_THREADS first
    assert results["rank's"] == results["OpenBLAS's own"] == ["11", "True"]
    # not vacuous: none asked, the launcher's count (its pool's threads and the calling one)
    assert results["none"] == [str(10 + int(threads) + 1), "True"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux")
def test_a_launcher_running_threads_starts_new_processes(monkeypatch):
    # A fork copies only the thread that forks: with any other thread running that no library
    # can stop (OpenMP's pool, a data set's executor) the ranks are new processes, and the
    # header says why.
    from parallelkit.train.ranks import launch

    monkeypatch.delenv(launch.FORK_RANKS, raising=False)
    monkeypatch.setattr(launch, "cuda_available", lambda: False)
    monkeypatch.setattr(launch, "other_threads", lambda: 2)
    seen = []
    monkeypatch.setattr(launch, "supervise", lambda children, **_: seen.extend(children) or 0)
    assert launch.launch([*launch.PACKAGE_CLI, "train"], 2, "auto", entry=lambda a: 0) == 0
    assert [c.forked for c in seen] == [None, None]
    assert "(processes, not forks: the launcher runs 3 threads" in seen[0].env[launcher.STARTED]


@pytest.mark.parametrize(
    ("env", "inconsistent"),
    [({"WORLD_SIZE": "2"}, True), ({"RANK": "0", "MASTER_PORT": "1"}, True),
     ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, False),
     ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, False),
     # an srun batch script that copies Slurm's rank and size into torch's names: srun
     ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
       "SLURM_STEP_ID": "0"}, False),
     ({"RANK": "0", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
       "SLURM_STEP_ID": "0"}, True)],
)  # fmt: skip
def test_a_part_of_torchruns_variables_is_no_launcher(env, inconsistent):
    from parallelkit.comm import launcher

    job = launcher.detect(env)
    assert (job.name == "inconsistent") == inconsistent, job
    if inconsistent:
        assert "unset" in job.why and "LOCAL_RANK" in job.why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux")
@pytest.mark.parametrize(("case", "status"), [("ok", 0), ("raises", 1), ("exits", 3)])
def test_a_forked_child_ends_as_a_python_program_does(tmp_path, case, status):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "forked_children.py"), str(tmp_path), case],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"status {status}" in proc.stdout
    if case == "ok":
        seen = json.loads((tmp_path / "child.json").read_text())
        assert seen == {"X": "1", "own session": True, "name": "pk-rank-0"}
        assert (tmp_path / "atexit").read_text() == "ran"
    if case == "raises":
        assert "ValueError: raised in the fork" in proc.stderr  # sys.excepthook's traceback
        assert "rank 0 failed first (exit status 1)" in proc.stderr
    if case == "exits":
        assert "rank 0 failed first (exit status 3)" in proc.stderr
