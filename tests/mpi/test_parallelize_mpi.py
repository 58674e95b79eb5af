"""Whole networks under mpiexec: the parallelized ResNet-18-style network and DCGAN pair
against the dense ones over 3 SGD steps, spatial and channel, plus a data x spatial grid; and
the spatial guard's rules that communicate, in forward code split over every rank's rows
(uneven blocks on 3 and 4 ranks)."""

from __future__ import annotations

import pytest

from cases import assert_triples
from network_cases import FORWARD_CODE, NETWORKS, network_parity

GUARD_RULES = [
    f"forward code: {kind}"
    for kind in (
        "se pool", "global max", "padding modes", "functional conv", "same padding",
        "pyramid pooling", "unet up",
        # token mixing and windows: keys of one window, a whole gather, sums over tokens
        "halo attention", "relative logits", "token pooling", "flatten", "lambda positions",
        "global query", "pooled windows", "flips and running sums", "warp", "axis mixing",
    )
]  # fmt: skip
assert set(GUARD_RULES) <= set(FORWARD_CODE)


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("strategy", ["spatial", "channel"])
def test_network_matches_dense(comm, strategy, name):
    assert_triples(network_parity(comm, name, strategy))


def test_data_times_spatial(comm):
    if comm.size % 2:
        pytest.skip("needs an even number of ranks")
    assert_triples(network_parity(comm, "resnet18", "spatial", dict(data=2, rows=comm.size // 2)))


@pytest.mark.parametrize("name", GUARD_RULES)
def test_forward_code_matches_dense(comm, name):
    assert_triples(network_parity(comm, name, "spatial", steps=2))


def test_sampling_noise_is_the_dense_models(comm):
    """A VAE's ``randn_like`` on blocks: each rank's block of the dense model's noise, on
    uneven blocks too."""
    assert_triples(network_parity(comm, "forward code: sampling", "spatial", steps=2))
