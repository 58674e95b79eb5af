"""Run under ``mpiexec -n N``: the MPI communicator on CUDA tensors, staged through host memory
(or passed straight to a CUDA-aware MPI), against the CPU reference. Exits non-zero on a
mismatch. Started by test_gpu.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import parallelkit as pk
from parallelkit.testing import on_host

from bn_cases import parity as bn_parity
from cases import assert_results, assert_triples
from device_cases import collectives, host_tensors_refused
from network_cases import network_parity


def main() -> None:
    world = pk.init("mpi")
    from parallelkit.comm.mpi import MPICommunicator

    comm = MPICommunicator(world.comm, timeout=world.timeout, device="cuda:0")
    staged = "CUDA-aware" if comm.cuda_aware else "staged through host memory"
    assert_triples(on_host(collectives(comm)))
    host_tensors_refused(comm)
    assert_results(on_host(bn_parity(comm, "(N, C, H, W)", device="cuda:0")))
    for strategy in ("data", "spatial", "channel"):
        assert_triples(
            on_host(network_parity(comm, "resnet18", strategy, steps=2, device="cuda:0"))
        )
    if comm.rank == 0:
        print(f"mpi on cuda ({staged}), {comm.size} ranks: ok")


if __name__ == "__main__":
    main()
