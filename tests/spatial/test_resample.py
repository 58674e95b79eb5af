"""Interpolation of any mode, factor or size, and adaptive average pooling to any size, on
blocks: torch's own weights per dimension applied to the rows each output block reads, with
nothing gathered. A network convolving, resampling and convolving again, against the dense
model (output, input gradient, parameter gradients) on rows, columns, a 2x2 grid and uneven
splits; 3-D and 1-D too."""

from __future__ import annotations

import pytest

from cases import assert_triples, mismatches
from resample_cases import OPS, resample_parity

GRIDS = {4: dict(rows=2, cols=2), 3: dict(rows=3), 2: dict(cols=2)}


@pytest.mark.parametrize("op", [op for op, (_, shape) in OPS.items() if len(shape) == 3])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_images_resampled_on_blocks_are_exact(ranks, op, size):
    for triples in ranks(size).run(resample_parity, op, GRIDS[size], timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize("op", [op for op, (_, shape) in OPS.items() if len(shape) != 3])
def test_volumes_and_signals_resampled_on_blocks_are_exact(ranks, op):
    grid = dict(depth=3) if len(OPS[op][1]) == 4 else dict(rows=3)
    for triples in ranks(3).run(resample_parity, op, grid, timeout=300):
        assert_triples(triples)


def test_negative_control_a_fetch_one_row_off_is_seen(ranks):
    for triples in ranks(2).run(resample_parity, "bilinear x2, align_corners", dict(rows=2),
                                tamper=True):  # fmt: skip
        assert mismatches([(label, got, want, {}) for label, got, want in triples])
