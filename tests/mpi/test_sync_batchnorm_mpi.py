"""SyncBatchNorm under mpiexec: the gloo tier's parity cases and collective counts."""

from __future__ import annotations

import pytest

from bn_cases import CASES, collective_counts, parity
from cases import assert_results, mismatches


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_dense_batchnorm(comm, name):
    assert_results(parity(comm, name))


def test_per_rank_batchnorm_does_not_match(comm):
    if comm.size == 1:
        pytest.skip("one rank: per-rank statistics are the global ones")
    assert any("output" in label for label in mismatches(parity(comm, "(N, C, H, W)", True)))


def test_one_collective_forward_one_backward(comm):
    if comm.debug:
        pytest.skip("debug mode adds a signature check before each collective")
    assert collective_counts(comm) == ((0, 0) if comm.size == 1 else (1, 1))
