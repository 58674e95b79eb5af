"""``spatial_input="blocks"``: every rank passes only its block of the input, and no rank ever
holds a whole sample. Exact against the dense model (output block, input block gradient,
parameter gradients, BatchNorm statistics) for images and volumes, with the whole size
all-gathered or given; a torch dispatch mode records the largest tensor any operation
creates on each rank, forward and backward, and it stays below one whole sample: 2-D on 4
ranks, 3-D on 8."""

from __future__ import annotations

import pytest

from blocks_cases import blocks_parity, largest_tensor, wrong_block
from cases import assert_triples


@pytest.mark.parametrize(
    ("size", "net", "grid", "sized"),
    [
        (2, "image", dict(rows=2), False),
        (4, "image", dict(rows=2, cols=2), True),
        (3, "volume", dict(depth=3), False),
        (4, "volume", dict(data=2, depth=2), True),
    ],
)
def test_blocks_in_are_exact(ranks, size, net, grid, sized):
    for triples in ranks(size).run(blocks_parity, net, grid, sized, timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize(
    ("size", "net", "grid"),
    [(4, "image", dict(rows=2, cols=2)), (8, "volume", dict(depth=2, rows=2, cols=2))],
)
def test_no_rank_holds_a_whole_sample(ranks, size, net, grid):
    for largest, op, whole in ranks(size).run(largest_tensor, net, grid, timeout=300):
        assert 0 < largest < whole, f"{op} made a tensor of {largest} elements (a sample: {whole})"


def test_negative_control_a_layer_on_gathered_samples_is_seen(ranks):
    """A last convolution kept dense runs on the gathered whole samples: the record sees it."""
    for largest, _, whole in ranks(4).run(largest_tensor, "image", dict(rows=4), gathers=True):
        assert largest >= whole


def test_a_block_that_does_not_fit_the_size_is_a_value_error(ranks):
    for message in ranks(2).run(wrong_block):
        assert "block has spatial size (32, 24), but its block of a (32, 24) sample is" in message
