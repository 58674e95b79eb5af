"""Device discipline under mpiexec: an MPI communicator declared for torch's lazy-tensor device.

MPI reads host memory, so device tensors are staged through it (the path CUDA tensors take
without a CUDA-aware MPI); host tensors in data collectives are refused, and host metadata
takes ``all_gather_ints``. See tests/comm/test_device_discipline.py for the gloo tier and why
whole networks are compared at a looser tolerance there.
"""

from __future__ import annotations

import pytest

from parallelkit.testing import on_host

from bn_cases import parity as bn_parity
from cases import assert_results, assert_triples
from device_cases import collectives, host_tensors_refused
from dp_cases import training_parity
from network_cases import network_parity
from spatial_cases import layer_parity

LAZY = "lazy"


@pytest.fixture(scope="module")
def device_comm(comm):
    import torch._lazy.ts_backend

    from parallelkit.comm.mpi import MPICommunicator

    torch._lazy.ts_backend.init()
    return MPICommunicator(comm.comm, timeout=comm.timeout, device=LAZY)


def test_collectives_are_staged(device_comm):
    assert_triples(on_host(collectives(device_comm)))


def test_host_tensors_are_refused(device_comm):
    messages = host_tensors_refused(device_comm)
    assert "moves tensors on lazy:0, got a (2,) tensor on cpu" in messages[0]


def _needs_ranks(comm) -> None:
    if comm.size == 1:
        pytest.skip("one rank runs torch's batch_norm, whose buffer update torch._lazy drops")


def test_sync_batchnorm(device_comm):
    _needs_ranks(device_comm)
    assert_results(on_host(bn_parity(device_comm, "(N, C, L), empty rank", device=LAZY)))


def test_spatial_conv(device_comm):
    triples = layer_parity(device_comm, "conv", (9, 8), None, device=LAZY, kernel_size=3)
    assert_triples(on_host(triples))


def test_data_parallel(device_comm):
    _needs_ranks(device_comm)
    assert_triples(on_host(training_parity(device_comm, "uneven", steps=2, device=LAZY)))


def test_spatial_network(device_comm):
    # The smallest network with every collective a spatial model makes (halo exchanges of
    # strided and 1x1 convolutions, SyncBatchNorm statistics of a BatchNorm subclass, the
    # gradient sum of replicated parameters, the global pool): ResNet-18 under lazy tensors
    # took 50 s per run of this tier and moves nothing else through the communicator.
    _needs_ranks(device_comm)
    name = "bottleneck resnet, BatchNormAct2d"
    triples = on_host(network_parity(device_comm, name, "spatial", steps=2, device=LAZY))
    assert_results([(label, got, want, dict(rtol=1e-4, atol=1e-6)) for label, got, want in triples])
