"""Launchers as a cluster user meets them: the batch script of ``sbatch``, ``srun`` steps,
mpiexec inside an allocation, torchrun; ``parallelkit train --check`` as a login-node dry run.

The Slurm environments are simulated with the variables Slurm sets (no Slurm here): the batch
step of ``sbatch --ntasks 4`` has SLURM_PROCID=0 and SLURM_NTASKS=4 but no step id; an srun
step has SLURM_STEP_ID, SLURM_PROCID, SLURM_LOCALID and its task count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parallelkit.comm import detect_backend
from parallelkit.comm.launcher import Launcher, detect, first_host, torch_variables
from parallelkit.testing import free_port
from parallelkit.train import keys
from parallelkit.train.ranks.launch import mpich_available

BATCH = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
         "SLURM_JOB_NODELIST": "localhost"}  # fmt: skip
TINY = [
    "model.width=4", "model.stem=cifar", "data.image_size=16", "data.channels=1",
    "train.batch_size=16", "train.max_steps=2", "train.progress=false",
    "train.tensorboard=false", "train.plot=false", "parallel.timeout=60",
]  # fmt: skip
LAUNCHER_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
    "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
    "PARALLELKIT_STARTED",
)  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM")
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "parallelkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def side_by_side(args: list[str], envs: list[dict[str, str]], cwd: Path, timeout: float):
    """``parallelkit ARGS`` once per environment, all at once, as a launcher starts ranks:
    each one's (exit status, stdout, stderr)."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "parallelkit.cli", *args], env=env, cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]  # fmt: skip
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, Launcher("none")),
        (BATCH, ("none", 0, 1)),  # the batch script: one process, not four
        ({**BATCH, "SLURM_STEP_ID": "4294967291"}, ("none", 0, 1)),  # the batch step's id
        ({**BATCH, "SLURM_STEP_ID": "extern"}, ("none", 0, 1)),
        (
            {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1"},
            ("srun", 3, 4, 1),
        ),
        ({**BATCH, "SLURM_STEP_ID": "2", "SLURM_STEP_NUM_TASKS": "1"}, ("none", 0, 1)),
        # mpiexec in an allocation: its proxies are an srun step of one task per node
        (
            {
                **BATCH,
                "SLURM_STEP_ID": "1",
                "SLURM_NTASKS": "2",
                "PMI_RANK": "5",
                "PMI_SIZE": "8",
                "MPI_LOCALRANKID": "1",
            },
            ("mpiexec", 5, 8, 1),
        ),
        # srun --mpi=pmi2: the PMI variables and the step agree, one rank per task
        (
            {
                **BATCH,
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "2",
                "SLURM_LOCALID": "0",
                "PMI_RANK": "2",
                "PMI_SIZE": "4",
            },
            ("srun", 2, 4, 0),
        ),
        (
            {
                "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            },
            ("mpiexec", 1, 3, 1),
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500", **BATCH},
            ("torchrun", 1, 2, 1),
        ),
    ],
)
def test_detect(env, want):
    got = detect(env)
    if isinstance(want, Launcher):
        assert got == want
    else:
        assert (got.name, got.rank, got.world, got.local_rank)[: len(want)] == want, got


def test_batch_script_is_named_in_why():
    assert "Slurm batch script" in detect(BATCH).why
    assert "SLURM_STEP_ID=0" in detect({**BATCH, "SLURM_STEP_ID": "0"}).why


@pytest.mark.parametrize(
    ("env", "want"),
    [({}, "local"), (BATCH, "local"), ({**BATCH, "SLURM_STEP_ID": "0"}, "mpi"),
     ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi")],
)  # fmt: skip
def test_auto_backend(monkeypatch, env, want):
    for var in [*LAUNCHER_VARS, *(k for k in os.environ if k.startswith("SLURM"))]:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert detect_backend() == want


@pytest.mark.parametrize(
    ("nodes", "first"),
    [("node[07-09,12],gpu3", "node07"), ("cn003", "cn003"), ("a,b", "a"),
     ("rack[2-3]n[01-04]", "rack2n01"), ("gpu[5]", "gpu5")],
)  # fmt: skip
def test_first_host(nodes, first):
    assert first_host(nodes) == first


def test_torch_variables_from_an_srun_step():
    env = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "cn[003-004]", "SLURM_JOB_ID": "123456"}  # fmt: skip
    got = torch_variables(detect(env), env)
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "cn003",
                   "MASTER_PORT": "18456"}  # fmt: skip
    assert torch_variables(detect(env), {**env, "MASTER_PORT": "2000"})["MASTER_PORT"] == "2000"


def test_batch_script_runs_the_local_ranks_it_was_asked_for(tmp_path):
    """``sbatch --ntasks 4`` whose script runs ``parallelkit train parallel.ranks=2``: two
    local ranks, said so in the header (before: one rank, silently)."""
    proc = cli("train", f"train.run_dir={tmp_path / 'run'}", "parallel.ranks=2", *TINY,
               env=clean_env(**BATCH), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"2 ranks ({'mpi' if mpich_available() else 'gloo'})" in proc.stdout, proc.stdout
    assert "2 local ranks started by parallelkit" in proc.stdout
    assert "Slurm batch script" in proc.stdout


def test_srun_step_ranks_join_by_slurm_variables(tmp_path):
    """Two tasks of a simulated srun step with gloo: rank, world and the store's address come
    from Slurm's variables, and the header says srun started them."""
    port = str(free_port())
    step = {**BATCH, "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    envs = [clean_env(**{**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                      MASTER_PORT=port) for r in range(2)]  # fmt: skip
    args = ["train", f"train.run_dir={tmp_path}/run", "parallel.backend=gloo", *TINY]
    (rc0, out0, err0), (rc1, _, err1) = side_by_side(args, envs, tmp_path, 240)
    assert [rc0, rc1] == [0, 0], err0[-3000:] + err1[-3000:]
    assert "2 ranks (gloo)" in out0 and "ranks started by srun" in out0


@pytest.mark.parametrize("rank", [0, 1])
def test_srun_step_refuses_ranks_it_did_not_start(tmp_path, rank):
    env = clean_env(**{**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank)})
    proc = cli("train", "--check", "parallel.ranks=2", *TINY, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # every rank says it in one line (a check that fails on one node only is that node's news)
    assert len(lines) == 1 and "parallel.ranks=2, but srun started 4 ranks" in lines[0]
    assert ("error on rank 1:" in lines[0]) == (rank == 1)


def test_ranks_of_a_launcher_report_a_config_mistake_once(tmp_path):
    """torchrun's ranks with a batch that does not split: one line from each rank (rank 1 names
    itself), every rank exits 2, before any collective (no store is listening on the port)."""
    port = str(free_port())
    envs = [clean_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), MASTER_PORT=port)
            for r in range(2)]  # fmt: skip
    (rc0, _, err0), (rc1, _, err1) = side_by_side(
        ["train", *TINY, "train.batch_size=15"], envs, tmp_path, 120
    )
    assert [rc0, rc1] == [2, 2]
    assert len(err0.strip().splitlines()) == 1 and "must split" in err0
    assert err1.strip() == err0.strip().replace("error:", "error on rank 1:")


def test_check_is_a_dry_run(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", "--check", f"train.run_dir={run}", *TINY, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "check passed for 2 ranks" in proc.stdout
    assert not run.exists()  # nothing written, no rank started


def test_check_finds_a_crop_larger_than_the_images(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "test"):
        for sub, arr in (("images", np.zeros((1, 16, 16), np.float32)),
                         ("masks", np.zeros((16, 16), np.uint8))):  # fmt: skip
            (root / split / sub).mkdir(parents=True)
            for i in range(2):
                np.save(root / split / sub / f"s{i}.npy", arr)
    args = ["train", "--check", f"data.name=npy:{root}", "data.image_size=24",
            "data.channels=1", "train.task=segment", "model.name=unet", "train.batch_size=2",
            "data.num_classes=2", f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
    proc = cli(*args, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "data.image_size" in proc.stderr
    assert not (tmp_path / "run").exists()
    proc = cli(*args[:3], "data.image_size=16", *args[4:], env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # a crop that fits: passes, and reads no values
    assert sorted(p.name for p in root.iterdir()) == ["test", "train"]  # no statistics written


def test_default_run_dir_is_one_clean_name(tmp_path):
    proc = cli("train", "--print-config", "train.task=segment", "data.name=npy:/data/ct/",
               "data.dims=3", env=clean_env(), cwd=tmp_path)  # fmt: skip
    assert "run_dir: runs/unet-npy-ct-data\n" in proc.stdout, proc.stdout + proc.stderr


def test_help_lists_every_key_with_its_default(tmp_path):
    proc = cli("train", "--help", env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0
    for key in keys.defaults():
        assert f"  {key} = " in proc.stdout, key
    assert "  train.epochs = 6\n" in proc.stdout
    assert "  model.name = (by train.task)\n" in proc.stdout


def test_docs_key_table_matches_the_schema():
    """docs/training.md's table names every key of the schema, and only those."""
    text = (Path(__file__).parents[3] / "docs" / "training.md").read_text()
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        section = ""
        for name in row.split("|")[1].replace("`", " ").replace(",", " ").split():
            if "." not in name or name.startswith(("-", "(")):
                continue  # (`--resume`): the flag beside its key
            if name.startswith("."):
                name = section + name
            section = name.split(".")[0]
            documented.add(name)
    schema = set(keys.defaults())
    covered = {k for k in schema if k in documented or f"{k.split('.')[0]}.*" in documented}
    assert schema - covered == set(), "keys missing from docs/training.md"
    assert {d for d in documented if not d.endswith(".*")} - schema == set(), "not keys"
