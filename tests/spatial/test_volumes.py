"""Spatial parallelism of signals (N, C, L) and volumes (N, C, D, H, W): a small 3-D U-Net-like
network and a 1-D one against the dense model over 2 SGD steps, on the plain communicator
(the first spatial dimension split), depth, rows, a 2-D grid over D and W, a 2x2x2 grid of 8
ranks, data x depth, uneven blocks (3 ranks), with a negative control; and the grids that
cannot split a sample, refused with the same message on every rank."""

from __future__ import annotations

import pytest

from cases import assert_triples, mismatches
from volume_cases import refused_grid, volume_parity


@pytest.mark.parametrize(
    ("size", "grid"),
    [
        (2, None),  # D over 2 ranks
        (2, dict(depth=2)),
        (3, dict(depth=3)),  # 8 planes: 3 3 2; 4 after the strided conv: 2 1 1
        (2, dict(rows=2)),
        (4, dict(depth=2, cols=2)),  # faces and edges
        (8, dict(depth=2, rows=2, cols=2)),  # faces, edges and corners of a 3-D grid
        (4, dict(data=2, depth=2)),
    ],
)
def test_volumes_are_exact(ranks, size, grid):
    for triples in ranks(size).run(volume_parity, "volume", grid, timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize(("size", "grid"), [(2, None), (3, dict(rows=3)), (4, None)])
def test_signals_are_exact(ranks, size, grid):
    for triples in ranks(size).run(volume_parity, "signal", grid, timeout=300):
        assert_triples(triples)


def test_negative_control_volumes_without_halo_terms(ranks):
    """The comparison sees a missing halo in the edge path."""
    for triples in ranks(2).run(volume_parity, "volume", dict(depth=2), tamper=True, steps=1):
        assert mismatches([(label, got, want, {}) for label, got, want in triples])


def test_grids_that_cannot_split_the_sample_are_refused(ranks):
    for message in ranks(2).run(refused_grid, "signal", dict(cols=2)):
        assert "a spatial grid of 2 cols cannot split samples with 1 spatial dimensions" in message
        assert "signals (N, C, L) are split by rows only" in message
