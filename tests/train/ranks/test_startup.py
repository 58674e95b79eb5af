"""The start-up of ``parallelkit train``, broken the ways users break it: threads in the launcher
(``OMP_NUM_THREADS``, a data set's thread pool), a rank stuck before its first collective, the
launcher killed while its ranks start, a check failing on one rank only, a shell's leftover
torchrun variables, an srun step whose MPI sees each task alone.

Each case runs ``parallelkit train`` in a subprocess on tiny settings, with a bound on time, and
(tests/jobs.py) checks that no process of the job remains. The user's code is
tests/scripts/startup_code.py and threaded_dataset.py, named by import path as a user names
theirs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import CLI, TINY, Job, rank_pid

from parallelkit.train.ranks.launch import mpi_available

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).parents[2] / "scripts"
ONE_STEP = [*TINY, "train.max_steps=1", "parallel.timeout=120"]
USER = {"PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
BOUND_S = 180.0  # a whole tiny job on a loaded 2-core machine


def finished(job: Job, bound: float = BOUND_S) -> str:
    """The job's output, once it ended with status 0 and left no process."""
    status, _ = job.gone_within(bound, time.monotonic())
    assert status == 0, job.output()[-3000:]
    return job.output()


@pytest.mark.parametrize("threads", ["2", None])
def test_openmp_threads_do_not_hang_the_ranks(tmp_path, threads):
    # OMP_NUM_THREADS=2 made the launcher's checks start OpenMP's pool; the forked ranks then
    # waited for its threads for ever in the data set's setup (gomp_team_barrier_wait_end).
    # Passive waiting keeps the pool and its threads (what a fork loses) but not their spinning
    # on the 2 cores that the ranks share, which only made the test slow. With it 2 or unset
    # (a user's usual environment), numpy's OpenBLAS pool ran in the launcher and the ranks
    # were new processes; the launcher now stops that pool, and they are forks.
    given = ["-u", "OMP_NUM_THREADS"] if threads is None else [f"OMP_NUM_THREADS={threads}"]
    command = ["env", "-u", "OPENBLAS_NUM_THREADS", *given, "OMP_WAIT_POLICY=PASSIVE", *CLI,
               f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
    with Job(tmp_path / "run", command=[*command, *ONE_STEP]) as job:  # env: after Job's own
        out = finished(job)
    assert "2 local ranks started by parallelkit (forked processes)" in out, out[-3000:]


def test_a_data_set_that_runs_threads_on_import(tmp_path):
    # A module-level ThreadPoolExecutor: its thread would not exist in a fork, and the fork's
    # first submit would wait for it for ever. The ranks are new processes, and the header
    # says why.
    with Job(tmp_path / "run", *ONE_STEP, "data.name=threaded_dataset:Threaded", env=USER) as job:
        out = finished(job)
    assert "(processes, not forks: the launcher runs" in out, out[-3000:]


def test_a_rank_stuck_in_its_start_up_is_named_and_stopped(tmp_path):
    # Every rank hangs in the data set's constructor, before any collective: no collective's
    # timeout can fire, so the launcher watches each phase of the start-up.
    args = [*TINY, "data.name=startup_code:Hangs", "parallel.timeout=5"]
    with Job(tmp_path / "run", *args, env=USER) as job:
        status, _ = job.gone_within(5 + 60, time.monotonic())
    out = job.output()
    assert status == 1, out[-3000:]
    assert "rank 0" in out and "made no progress in its checks" in out, out[-3000:]
    assert "parallel.timeout=5 s, before the first collective" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("forked", [True, False])
def test_sigkill_of_the_launcher_while_the_ranks_start(tmp_path, forked):
    # The ranks asked to die with the launcher only after their checks: killed while they
    # checked, the launcher left them retrying its store for minutes.
    env = {**USER, **({} if forked else {"PARALLELKIT_FORK_RANKS": "0"})}
    args = [*TINY, "data.name=startup_code:Hangs", "parallel.timeout=300"]
    with Job(tmp_path / "run", *args, env=env) as job:
        job.wait_until(lambda: all(rank_pid(job, r) for r in range(2)), 120, "both ranks")
        if forked:
            time.sleep(3)  # in their checks, where the data set hangs (a fork starts at once)
        job.track()  # new processes: still starting Python
        names = [Path(f"/proc/{rank_pid(job, r)}/comm").read_text().strip() for r in range(2)]
        os.kill(job.proc.pid, signal.SIGKILL)
        _, seconds = job.gone_within(20, time.monotonic())
    assert (names == ["pk-rank-0", "pk-rank-1"]) == forked, names
    print(f"\nFAULT-TIME launcher SIGKILLed at start-up (forked={forked}): {seconds:.2f} s")


def test_a_check_failing_on_rank_1_is_printed(tmp_path):
    # A network whose constructor raises on rank 1 only: the launcher's own checks pass, rank
    # 1's fail; its line was lost (exit status 2, nothing printed).
    args = [*ONE_STEP, "model.name=startup_code:failing"]
    with Job(tmp_path / "run", *args, env=USER) as job:
        status, _ = job.gone_within(BOUND_S, time.monotonic())
    out = job.output()
    assert status == 2, out[-3000:]
    assert "error on rank 1 (exit status 2):" in out and "missing on this node" in out, out
    assert "Traceback" not in out


def test_a_check_failing_on_rank_1_under_a_users_launcher(tmp_path):
    # torchrun's variables, set as torchrun sets them: each rank prints its own failed check.
    envs = [dict(os.environ, **USER, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                 WORLD_SIZE="2", MASTER_PORT="29999") for r in range(2)]  # fmt: skip
    args = [*CLI, "--check", *TINY, "model.name=startup_code:failing"]
    procs = [subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path) for env in envs]  # fmt: skip
    assert [p.returncode for p in procs] == [0, 2], [p.stderr for p in procs]
    assert "error on rank 1: config: model.name=startup_code:failing" in procs[1].stderr


def test_leftover_torchrun_variables_are_refused(tmp_path):
    # WORLD_SIZE, RANK and MASTER_PORT left in a shell made a plain run act as torchrun's rank
    # 0: it listened on every interface and died in a DistStoreError traceback.
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29500"}
    with Job(tmp_path / "run", *ONE_STEP, env=env) as job:
        status, _ = job.gone_within(120, time.monotonic())
    out = job.output()
    assert status == 2, out
    assert out.strip().count("\n") == 0, out  # one line
    # MASTER_ADDR joins the list where the test process has it (an earlier in-process group).
    assert re.search(r"RANK, WORLD_SIZE, MASTER_PORT(, MASTER_ADDR)? set in the environment, "
                     r"but not LOCAL_RANK", out), out
    assert "unset RANK WORLD_SIZE MASTER_PORT" in out
    assert not (tmp_path / "run").exists()


def _srun_task(rank: int) -> dict[str, str]:
    """A task of a simulated 2-task srun step, started without PMI (no srun --mpi)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "PMI", "OMPI", "PMIX")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}  # fmt: skip
    return {**env, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_JOB_NODELIST": "localhost"}  # fmt: skip


@pytest.mark.skipif(not mpi_available(), reason="needs mpi4py and an mpiexec")
@pytest.mark.parametrize("check", [False, True])
def test_srun_without_pmi_stops_on_every_task(tmp_path, check):
    # MPI without srun's PMI sees each task alone: each trained as "1 ranks (mpi)", the second
    # failed on the run directory's lock, and --check passed.
    args = [*CLI, *(["--check"] if check else []), f"train.run_dir={tmp_path / 'run'}", *TINY,
            "train.max_steps=1"]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(args, env=_srun_task(r), cwd=tmp_path, **pipes) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    want = "srun started 2 tasks but MPI sees 1: run srun with --mpi=pmi2/pmix, or parallel."
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, out + err
        assert len(err.strip().splitlines()) == 1 and want in err, err
        assert "check passed" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not mpi_available(), reason="needs mpi4py and an mpiexec")
def test_an_mpi_world_that_is_not_its_launchers_is_refused(tmp_path):
    # MPI's variables of a 2-rank job, but no way to reach its process manager: MPI starts
    # this process alone, as an MPI library other than the launcher's would. It would have
    # trained alone as "rank 0 of 2".
    env = {**_srun_task(0), "PMI_RANK": "0", "PMI_SIZE": "2"}
    for k in [k for k in env if k.startswith("SLURM")]:
        del env[k]
    proc = subprocess.run([*CLI, f"train.run_dir={tmp_path / 'run'}", *ONE_STEP], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    want = "an MPI launcher started 2 ranks (MPI's PMI_RANK set), but MPI sees 1: mpi4py's MPI"
    assert want in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_new_rank_process_dies_with_its_launcher_before_it_imports(tmp_path):
    # The new process's first statements: the death request, then the parent check. A parent
    # that is not the launcher named in the environment means it died already: exit at once.
    from parallelkit.train.ranks.rankproc import LAUNCHER_PID, rank_command

    command = rank_command([sys.executable, "-m", "json.tool", "--help"])
    env = dict(os.environ, **{LAUNCHER_PID: "1"})  # not this test's pid
    started = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, timeout=60)
    assert proc.returncode == 137 and proc.stdout == b""
    assert time.monotonic() - started < 10
    proc = subprocess.run(command, env=dict(env, **{LAUNCHER_PID: str(os.getpid())}),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "usage" in proc.stdout
