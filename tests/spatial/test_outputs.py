"""Outputs that are not (N, C, *spatial): stacked deep-supervision heads (N, heads, C, D, H, W)
and a channels-last head come back whole on every rank, with the dense input gradient."""

from __future__ import annotations

import pytest
from output_cases import outputs


@pytest.mark.parametrize(
    ("size", "dims"), [(2, dict(depth=2)), (2, dict(rows=2)), (4, dict(depth=2, cols=2))]
)
def test_stacked_and_channels_last_outputs_are_gathered_whole(ranks, size, dims):
    for rank in ranks(size).run(outputs, dims, timeout=120):
        for label, diff in rank:
            assert diff < 1e-12, (label, diff)
