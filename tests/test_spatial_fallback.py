"""``pk.parallelize(..., fallback="gather")``: refused modules run on whole images, exactly.

A hybrid network (global attention over H x W tokens, space-to-depth, dropout and BatchNorm
around them) trains 2 SGD steps against the dense model on row, column, 2-D and data x rows
grids, uneven splits among them: outputs, every parameter gradient, parameters and running
statistics after each step. The negative control shows the comparison would see a forward
that started again without putting the buffers and generators back.
"""

from __future__ import annotations

import pytest
from torch import nn

import parallelkit as pk
from parallelkit.comm.local import LocalCommunicator

from cases import assert_triples, mismatches
from fallback_cases import hybrid_parity, hybrid_refused


@pytest.mark.parametrize(
    ("size", "grid"),
    [(2, dict(rows=2)), (3, dict(cols=3)), (4, dict(rows=2, cols=2)), (4, dict(data=2, rows=2))],
)
def test_refused_modules_run_on_whole_images_exactly(ranks, size, grid):
    for triples, warned in ranks(size).run(hybrid_parity, grid, timeout=300):
        assert_triples(triples)
        # One warning per module, for the region's life: its path, class and memory.
        assert len(warned) == 2, warned
        assert "'mixer' (TokenMixer) runs on the whole images" in warned[0], warned
        assert "'down' (SpaceToDepth)" in warned[1] and "MiB per rank" in warned[1], warned


def test_negative_control_a_forward_started_again_without_restoring(ranks):
    """Without putting back the running statistics and the dropout generator that the
    abandoned forwards used, the comparison fails."""
    for triples, _ in ranks(2).run(hybrid_parity, dict(rows=2), restore=False, timeout=300):
        bad = mismatches([(label, got, want, {}) for label, got, want in triples])
        assert any("num_batches_tracked" in label for label in bad), bad
        assert any("output" in label for label in bad), bad


def test_the_default_refuses_and_names_the_way_out(ranks):
    for message in ranks(2).run(hybrid_refused):
        assert message.startswith("spatial parallelism: Tensor.flatten in 'mixer' (TokenMixer)")
        assert "keep_dense=['mixer']" in message and 'fallback="gather"' in message, message


def test_fallback_must_be_refuse_or_gather():
    with pytest.raises(ValueError, match="fallback must be one of"):
        pk.parallelize(nn.Conv2d(1, 1, 1), LocalCommunicator(), "spatial", fallback="whole")
