"""Volumes and signals under mpiexec: the 3-D network split over every rank's depth planes
(8 planes: uneven on 3 ranks, 2 planes each on 4), then over rows, and the 1-D one over L,
against the dense model over 2 SGD steps; on one rank the region is the dense model itself."""

from __future__ import annotations

import pytest

from cases import assert_triples
from volume_cases import volume_parity


@pytest.mark.parametrize("grid", ["depth", "rows"])
def test_volumes_are_exact(comm, grid):
    assert_triples(volume_parity(comm, "volume", {grid: comm.size}))


def test_signals_are_exact(comm):
    assert_triples(volume_parity(comm, "signal", None))
