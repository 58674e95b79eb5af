"""Which launcher started this process, read from the variables each one sets.

One process can be one rank of a job that ``torchrun``, ``mpiexec`` or ``srun`` started, or a
plain process (a shell, or the batch script of ``sbatch``). The difference decides everything
after it: a rank joins the job; a plain process starts its own local ranks. Reading it wrong
runs a different number of ranks than the user asked for, so each rule below says why.

    torchrun   RANK, LOCAL_RANK, WORLD_SIZE and MASTER_PORT, all four (torchrun, and every
               launcher that copies it, sets them all). A part of the set (WORLD_SIZE or RANK
               left in a shell by another job, without LOCAL_RANK) is not a launcher: it is
               ``inconsistent``, and refused with a line naming the variables, since following
               it would make a plain process wait for ranks that never come. An srun step whose
               task's RANK and WORLD_SIZE were copied from Slurm's (a common batch script) is
               srun.
    mpiexec    MPICH/Hydra's PMI_RANK and PMI_SIZE (MPI_LOCALRANKID), Open MPI's
               OMPI_COMM_WORLD_*, or PMIx's PMIX_RANK. Read before Slurm's: inside an
               allocation, mpiexec starts its per-node proxies with srun, so the ranks also
               see an srun step, of one task per node. (``srun --mpi=pmi2`` sets both, with
               one rank per task: that is srun.)
    srun       a real job step: SLURM_STEP_ID a step number, SLURM_PROCID, and more than
               one task (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS): SLURM_LOCALID is the
               local rank. The batch script of ``sbatch --ntasks 4`` has SLURM_PROCID=0 and
               SLURM_NTASKS=4 as well, but no step of its own (no SLURM_STEP_ID, or the batch
               or extern step's reserved number): it is one process, not four.

A one-task ``srun`` step is a plain process too: it may start local ranks itself. An srun
step whose ranks use MPI needs srun's PMI (``--mpi=pmi2``/``pmix``): without it MPI sees each
task alone (:func:`mpi_mismatch`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# Slurm's reserved step ids (slurm.h) start here: the batch script, the extern step, pending
# and interactive steps. A real ``srun`` step is numbered from 0.
_RESERVED_STEP = 0xFFFFFFF0
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
"""torchrun's variables that make a process a rank, all together."""


@dataclass(frozen=True)
class Launcher:
    """What started this process. ``name`` is ``torchrun``, ``srun``, ``mpiexec`` or ``none``
    (a plain process); ``why`` names the variables that said so, for the run's header."""

    name: str
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    why: str = "no launcher's variables are set"


STARTED = "PARALLELKIT_STARTED"
"""Set in the ranks that ``parallelkit train`` starts: why it started them, for the header."""


def started_by(job: Launcher) -> str:
    """Who started the ranks, and why it was read so: a line of the run's header."""
    if STARTED in os.environ:
        return os.environ[STARTED]
    if job.name == "none":
        return f"one rank, in this process ({job.why})"
    return f"ranks started by {job.name} ({job.why})"


def detect(env: dict[str, str] | None = None) -> Launcher:
    """The launcher of this process (``env``: the environment to read, default os.environ)."""
    env = dict(os.environ if env is None else env)
    if all(v in env for v in TORCHRUN):
        return Launcher(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE", 1),
            _int(env, "LOCAL_RANK"),
            "RANK, LOCAL_RANK, WORLD_SIZE and MASTER_PORT are set",
        )
    job = _slurm_or_mpi(env)
    partial = [v for v in (*TORCHRUN[:3], "TORCHELASTIC_RUN_ID") if v in env]
    if partial and not _copied_from(job, env):
        return Launcher("inconsistent", why=inconsistent(env))
    return job


def inconsistent(env: dict[str, str]) -> str:
    """The line that refuses a part of torchrun's variables."""
    found = [v for v in (*TORCHRUN, "MASTER_ADDR", "TORCHELASTIC_RUN_ID") if v in env]
    missing = [v for v in TORCHRUN if v not in env]
    return (f"{', '.join(found)} set in the environment, but not {', '.join(missing)}: not a "
            f"rank of torchrun (left over from another job?); clear them with `unset "
            f"{' '.join(found)}`, or start the job with torchrun")  # fmt: skip


def _copied_from(job: Launcher, env: dict[str, str]) -> bool:
    """Whether torchrun's RANK and WORLD_SIZE, where set, are srun's or MPI's own."""
    if job.name not in ("srun", "mpiexec"):
        return False
    return _int(env, "RANK", job.rank) == job.rank and _int(env, "WORLD_SIZE", job.world) == (
        job.world
    )


def mpi_mismatch(job: Launcher, mpi_world: int) -> str | None:
    """Why ranks whose MPI world has ``mpi_world`` ranks cannot be ``job``'s, or None."""
    if job.name not in ("srun", "mpiexec") or mpi_world == job.world:
        return None
    if job.name == "mpiexec":  # an MPI library that does not speak its launcher's PMI
        return (f"an MPI launcher started {job.world} ranks ({job.why}), but MPI sees "
                f"{mpi_world}: mpi4py's MPI library is not the one whose launcher started "
                "them; use that library's mpiexec, or parallel.backend=gloo")  # fmt: skip
    return (f"srun started {job.world} tasks but MPI sees {mpi_world}: run srun with "
            "--mpi=pmi2/pmix, or parallel.backend=gloo")  # fmt: skip


def _slurm_or_mpi(env: dict[str, str]) -> Launcher:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    srun = step.isdigit() and int(step) < _RESERVED_STEP and "SLURM_PROCID" in env
    mpi = _mpi(env)
    if mpi is not None:  # before srun's: mpiexec inside an allocation starts its proxies by srun
        if srun and tasks == mpi.world:  # srun --mpi=pmi2/pmix: one rank per task
            why = f"an srun step (SLURM_STEP_ID={step}) of {tasks} tasks, {mpi.why}"
            return Launcher("srun", mpi.rank, mpi.world, _int(env, "SLURM_LOCALID"), why)
        return mpi
    if srun and tasks > 1:
        return Launcher(
            "srun",
            _int(env, "SLURM_PROCID"),
            tasks,
            _int(env, "SLURM_LOCALID"),
            f"an srun step (SLURM_STEP_ID={step}) of {tasks} tasks",
        )
    if "SLURM_PROCID" in env and tasks > 1:
        return Launcher("none", why=f"a Slurm batch script, not an srun step (SLURM_STEP_ID "
                        f"{step or 'unset'}): one process")  # fmt: skip
    return Launcher("none")


def _mpi(env: dict[str, str]) -> Launcher | None:
    """An MPI launcher's rank, from MPICH/Hydra's, Open MPI's or PMIx's variables."""
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        rank, world, local = "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"
    elif "OMPI_COMM_WORLD_SIZE" in env:
        rank, world, local = (f"OMPI_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK"))
    elif "PMIX_RANK" in env:
        rank, world, local = "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"
    else:
        return None
    return Launcher(
        "mpiexec", _int(env, rank), _int(env, world, 1), _int(env, local), f"MPI's {rank} set"
    )


def torch_variables(launcher: Launcher, env: dict[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables for a rank that ``srun`` started, so that gloo and NCCL join as
    under torchrun: rank and world from Slurm, the store on the step's first node, its port
    ``MASTER_PORT`` if set, else 15000 + the job id's last four digits (the same on every
    task of the job, and different for jobs sharing a node)."""
    env = dict(os.environ if env is None else env)
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    job = env.get("SLURM_JOB_ID", "0")
    return {
        "RANK": str(launcher.rank),
        "WORLD_SIZE": str(launcher.world),
        "LOCAL_RANK": str(launcher.local_rank),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
        "MASTER_PORT": env.get("MASTER_PORT") or str(15000 + int(job[-4:] or 0)),
    }


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu3`` gives ``node07``."""
    first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodelist).group(0)  # up to a top comma
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first)


def _int(env: dict[str, str], var: str, default: int = 0) -> int:
    value = env.get(var, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default
