"""Adaptive maximum pooling to any size on blocks, with nothing gathered: against torch on
the whole input (output, indices, input gradient, exactly) for 1-D, 2-D and 3-D samples over
rows, columns, a 2x2 grid, depth, uneven splits and empty blocks, with ties (the gradient goes
to the first maximum) and NaNs (the last NaN); a small CNN through ``pk.parallelize``; and no
rank creating a tensor as large as a sample. Each has a negative control."""

from __future__ import annotations

import pytest
from adaptive_max_cases import CASES, largest_tensor, model_parity, pool_parity

from parallelkit.spatial.adaptive_max import bins

from cases import assert_results, mismatches


def test_bins_are_torchs():
    import torch
    import torch.nn.functional as F

    for n in range(1, 12):
        for o in range(1, 2 * n + 3):
            x = torch.eye(n, dtype=torch.float64).view(n, 1, n)
            reads = F.adaptive_max_pool1d(x, o).reshape(n, o).ne(0)  # output o reads row i
            assert [tuple(r.nonzero().flatten()[[0, -1]].tolist()) for r in reads.T] == [
                (lo, hi - 1) for lo, hi in bins(n, o)
            ], (n, o)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_pooled_blocks_are_torchs_exactly(ranks, size):
    results = ranks(size).run(pool_parity, size, timeout=300)
    for quads in results:
        assert_results(quads)
    assert len(results[0]) == 3 * len(CASES[size])


def test_negative_control_ties_kept_last_are_seen(ranks):
    for quads in ranks(2).run(pool_parity, 2, tamper=True, timeout=300):
        bad = mismatches(quads)
        assert any(label.endswith("input grad") for label in bad), bad
        assert any(label.endswith("indices") for label in bad), bad


@pytest.mark.parametrize(
    ("size", "grid", "indices"),
    [(2, dict(rows=2), False), (3, dict(rows=3), True), (4, dict(rows=2, cols=2), False),
     (4, dict(rows=4), True)],
)  # fmt: skip
def test_a_parallelized_cnn_pools_on_blocks(ranks, size, grid, indices):
    for quads, said in ranks(size).run(model_parity, grid, indices, timeout=300):
        assert_results(quads)
        assert not [w for w in said if "gather" in w.lower()], said


def test_no_rank_holds_a_whole_sample(ranks):
    for largest, op, whole, said in ranks(4).run(largest_tensor, timeout=300):
        assert 0 < largest < whole, f"{op} made a tensor of {largest} elements (a sample: {whole})"
        assert not [w for w in said if "gather" in w.lower()], said


def test_negative_control_the_pool_kept_dense_is_seen(ranks):
    for largest, _, whole, _ in ranks(4).run(largest_tensor, keep_dense=True, timeout=300):
        assert largest >= whole
