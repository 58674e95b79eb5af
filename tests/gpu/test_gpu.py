"""The GPU tier (one GPU is enough): NCCL at world size 1, 2 and 4 gloo ranks sharing the GPU
with CUDA tensors, mpiexec ranks on CUDA tensors, and ``parallelkit train`` on cuda.

Parity is with the dense model on the CPU: float64 for the layer and network cases (as in the
CPU tiers), fp32 with TF32 off for training, bf16 autocast at bf16 tolerances. The NCCL rank
also exercises the primitives behind the size-1 fast paths and the host path on its gloo half.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_cases import autocast_channels_last, nccl_primitives

from bn_cases import parity as bn_parity
from cases import assert_results, assert_triples
from channel_cases import parity as channel_parity
from device_cases import collectives, host_tensors_refused
from dp_cases import training_parity
from network_cases import NETWORKS, STRATEGY_GRIDS, network_parity
from spatial_cases import layer_parity

GPU = "cuda:0"


def test_nccl_world_size_one(cuda_ranks):
    (triples,) = cuda_ranks(1, "nccl").run(nccl_primitives)
    assert_triples(triples)
    (triples,) = cuda_ranks(1, "nccl").run(collectives)
    assert_triples(triples)
    (messages,) = cuda_ranks(1, "nccl").run(host_tensors_refused)
    assert "moves tensors on cuda:0, got a (2,) tensor on cpu" in messages[0]


@pytest.mark.parametrize("strategy", ["data", "spatial", "channel"])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_nccl_networks(cuda_ranks, name, strategy):
    (triples,) = cuda_ranks(1, "nccl").run(network_parity, name, strategy, steps=2, device=GPU)
    assert_triples(triples)


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_collectives_on_cuda(cuda_ranks, size):
    for triples in cuda_ranks(size).run(collectives):
        assert_triples(triples)
    for messages in cuda_ranks(size).run(host_tensors_refused):
        assert "moves tensors on cuda:0" in messages[0]


@pytest.mark.parametrize(
    "name", ["(N, C, H, W)", "(N, C, L), empty rank", "bfloat16", "channels_last"]
)
def test_sync_batchnorm_on_cuda(cuda_ranks, name):
    for results in cuda_ranks(2).run(bn_parity, name, device=GPU):
        assert_results(results)


@pytest.mark.parametrize(
    ("split", "options"), [("out", {}), ("in", {}), ("in", {"scatter_output": True})]
)
def test_channel_parallel_on_cuda(cuda_ranks, split, options):
    for results in cuda_ranks(2).run(channel_parity, "k3 p1", split, device=GPU, **options):
        assert_results(results)


@pytest.mark.parametrize(
    ("kind", "grid", "kw"),
    [
        ("conv", None, dict(kernel_size=3, padding=1)),
        ("conv", (2, 2), dict(kernel_size=3, stride=2, padding=1)),
        ("maxpool", (2, 2), dict(kernel_size=3, stride=2, padding=1)),
        ("upsample", None, dict(scale_factor=2, mode="bilinear")),
        ("convT", (2, 2), dict(kernel_size=4, stride=2, padding=1)),
    ],
)
def test_spatial_layers_on_cuda(cuda_ranks, kind, grid, kw):
    size = 4 if grid == (2, 2) else 2
    for triples in cuda_ranks(size).run(layer_parity, kind, (9, 8), grid, device=GPU, **kw):
        assert_triples(triples)


def test_data_parallel_on_cuda(cuda_ranks):
    for triples in cuda_ranks(2).run(training_parity, "uneven", steps=3, device=GPU):
        assert_triples(triples)


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize(("size", "strategy", "grid"), STRATEGY_GRIDS)
def test_networks_on_cuda(cuda_ranks, name, size, strategy, grid):
    for triples in cuda_ranks(size).run(
        network_parity, name, strategy, grid, steps=2, device=GPU, timeout=600
    ):
        assert_triples(triples)


@pytest.mark.parametrize("strategy", ["data", "spatial", "channel"])
def test_bf16_autocast_channels_last(cuda_ranks, strategy):
    for (_, mine, exact), (_, dense, _) in cuda_ranks(2).run(autocast_channels_last, strategy):
        # Within twice the dense model's own bf16 error (and 0.01) of the float32 output.
        bound = 2 * (dense - exact).abs().max().item() + 1e-2
        torch.testing.assert_close(mine, exact, rtol=0, atol=bound)


MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
@pytest.mark.parametrize("size", [2, 4])
def test_mpi_on_cuda(size):
    script = Path(__file__).with_name("mpi_cuda.py")
    env = dict(os.environ, PARALLELKIT_TIMEOUT="120", OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(size), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"{size} ranks: ok" in proc.stdout


TRAIN = [
    "model.width=8",
    "model.stem=cifar",
    "data.name=synthetic",
    "data.image_size=32",
    "train.batch_size=16",
    "train.max_steps=4",
    "train.log_every=1",
    "train.progress=false",
    "train.tensorboard=false",
    "parallel.timeout=120",
]


def _train(run_dir: Path, *overrides: str) -> list[float]:
    cmd = [sys.executable, "-m", "parallelkit.cli", "train", f"train.run_dir={run_dir}"]
    proc = subprocess.run(
        [*cmd, *TRAIN, *overrides], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}
    return [steps[k] for k in sorted(steps)]


# Several gloo or MPI ranks share the one GPU (NCCL needs a GPU per rank).
@pytest.mark.parametrize(
    "parallel",
    [
        ["parallel.ranks=1", "parallel.backend=nccl"],
        ["parallel.ranks=2", "parallel.backend=gloo", "parallel.device=cuda"],
        [
            "parallel.ranks=2",
            "parallel.backend=gloo",
            "parallel.device=cuda",
            "parallel.strategy=spatial",
        ],
        [
            "parallel.ranks=2",
            "parallel.backend=gloo",
            "parallel.device=cuda",
            "parallel.strategy=channel",
        ],
        ["parallel.ranks=4", "parallel.backend=gloo", "parallel.device=cuda", "parallel.rows=2"],
        [
            "parallel.ranks=2",
            "parallel.backend=mpi",
            "parallel.device=cuda",
            "parallel.strategy=spatial",
        ],
        ["parallel.ranks=1", "parallel.backend=nccl", "train.precision=bf16"],
    ],
)
def test_train_on_cuda(tmp_path, parallel):
    if "parallel.backend=mpi" in parallel and MPIEXEC is None:
        pytest.skip("no mpiexec (pip install mpich)")
    reference = _train(tmp_path / "cpu", "parallel.ranks=1", "parallel.device=cpu")
    got = _train(tmp_path / "cuda", *parallel)
    tol = 5e-2 if "train.precision=bf16" in parallel else 1e-3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=tol, atol=tol)
