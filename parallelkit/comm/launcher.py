"""Which launcher started this process, read from the variables each one sets.

One process can be one rank of a job that ``torchrun``, ``mpiexec`` or ``srun`` started, or a
plain process (a shell, or the batch script of ``sbatch``). The difference decides everything
after it: a rank joins the job; a plain process starts its own local ranks. Reading it wrong
runs a different number of ranks than the user asked for, so each rule below says why.

    torchrun   WORLD_SIZE and MASTER_PORT (or TORCHELASTIC_RUN_ID): RANK, LOCAL_RANK
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

A one-task ``srun`` step is a plain process too: it may start local ranks itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# Slurm's reserved step ids (slurm.h) start here: the batch script, the extern step, pending
# and interactive steps. A real ``srun`` step is numbered from 0.
_RESERVED_STEP = 0xFFFFFFF0


@dataclass(frozen=True)
class Launcher:
    """What started this process. ``name`` is ``torchrun``, ``srun``, ``mpiexec`` or ``none``
    (a plain process); ``why`` names the variables that said so, for the run's header."""

    name: str
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    why: str = "no launcher's variables are set"


def detect(env: dict[str, str] | None = None) -> Launcher:
    """The launcher of this process (``env``: the environment to read, default os.environ)."""
    env = dict(os.environ if env is None else env)
    if ("WORLD_SIZE" in env and "MASTER_PORT" in env) or "TORCHELASTIC_RUN_ID" in env:
        return Launcher(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE", 1),
            _int(env, "LOCAL_RANK"),
            "WORLD_SIZE and MASTER_PORT are set",
        )
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
