"""Whole networks under mpiexec: the parallelized ResNet-18-style network and DCGAN pair
against the dense ones over 3 SGD steps, spatial and channel, plus a data x spatial grid."""

from __future__ import annotations

import pytest

from cases import assert_triples
from network_cases import NETWORKS, network_parity


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("strategy", ["spatial", "channel"])
def test_network_matches_dense(comm, strategy, name):
    assert_triples(network_parity(comm, name, strategy))


def test_data_times_spatial(comm):
    if comm.size % 2:
        pytest.skip("needs an even number of ranks")
    assert_triples(network_parity(comm, "resnet18", "spatial", dict(data=2, rows=comm.size // 2)))
