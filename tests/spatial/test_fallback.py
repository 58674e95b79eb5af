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
        # One warning per module, for the region's life: its path, class and memory. The
        # space-to-depth view runs split: on blocks of 6 rows as they are, on columns of 5 or
        # of 4, 3 and 3 with whole pairs of columns moved to each rank first.
        assert len(warned) == 1, warned
        assert "'mixer' (TokenMixer) runs on the whole images" in warned[0], warned
        assert "MiB per rank" in warned[0], warned


@pytest.mark.parametrize(
    ("size", "grid", "net"),
    [
        (2, dict(rows=2), "windows"),
        (3, dict(rows=3), "windows"),
        (2, dict(cols=2), "windows"),
        (3, dict(rows=3), "windows of 8"),
    ],
)
def test_a_module_that_asserts_on_its_blocks_shape_runs_split(ranks, size, grid, net):
    """Windowed attention asserting that the window divides the height it reads (the whole
    height, 16, on every block) runs split, nothing gathered: on blocks of whole windows (8
    rows of windows of 4) its partition folds them into the batch as they are; on blocks of
    6, 5 and 5 rows, or 6 and 6 columns (3 windows of 4), rows move to whole windows first (8,
    4 and 4 rows; 8 and 4 columns) and back after the window reverse; with 2 windows of 8 on
    3 ranks, the third holds none while they are folded."""
    for triples, warned in ranks(size).run(hybrid_parity, grid, net=net, timeout=300):
        assert_triples(triples)
        assert warned == [], warned


@pytest.mark.parametrize(("size", "grid"), [(2, dict(rows=2)), (2, dict(cols=2))])
def test_window_partitions_shaped_like_images_run_on_blocks(ranks, size, grid):
    """A window partition and its inverse in sibling modules, the partitioned tensor of the
    image's very shape: it is a fold of the window grid (not an image), the linear map on it
    is local, and the inverse, to the whole window grid written in the network, unfolds it.
    Nothing is gathered."""
    for triples, warned in ranks(size).run(hybrid_parity, grid, net="partitions", timeout=300):
        assert_triples(triples)
        assert warned == [], warned


def test_a_modules_own_error_on_a_block_is_a_refusal(ranks):
    """The window's assertion reads the whole height, 16, on every rank's block of 6 or 5
    rows: it fails for a window of 5 alone, as on the dense model, and is refused."""
    for message in ranks(3).run(hybrid_refused, "windows of 5"):
        assert message.startswith("spatial parallelism: the forward in 'mixer' (WindowMixer) "
                                  "raised AssertionError (height (16) must be divisible by "
                                  "window (5))"), message  # fmt: skip
        assert "keep_dense=['mixer']" in message and 'fallback="gather"' in message, message


def test_errors_raised_by_parallelkit_itself_are_not_dressed_as_refusals():
    """A RuntimeError from a frame inside the package (a rule, a layer, a communicator) is a
    defect or a fault of parallelkit's, and stays what it is; from model code it is refused."""
    from pathlib import Path

    import parallelkit
    from parallelkit.spatial.refusal import model_failure

    module = nn.Identity()
    inside = str(Path(parallelkit.__file__).parent / "spatial" / "rules" / "windows.py")
    for filename, refused in ((inside, False), ("/somewhere/timm/models/maxxvit.py", True)):
        try:
            exec(compile("raise RuntimeError('size mismatch')", filename, "exec"))
        except RuntimeError as e:
            got = model_failure({module: "m"}, module, e)
        assert (got is not None) == refused, filename
        assert got is None or "raised RuntimeError (size mismatch)" in str(got)


def test_negative_control_a_forward_started_again_without_restoring(ranks):
    """Without putting back the running statistics and the dropout generator that the
    abandoned forwards used, the comparison fails."""
    for triples, _ in ranks(2).run(hybrid_parity, dict(rows=2), restore=False, timeout=300):
        bad = mismatches([(label, got, want, {}) for label, got, want in triples])
        assert any("num_batches_tracked" in label for label in bad), bad
        assert any("output" in label for label in bad), bad


def test_the_default_refuses_and_names_the_way_out(ranks):
    for message in ranks(2).run(hybrid_refused):
        # a causal scan along the (split) H x W tokens
        assert message.startswith("spatial parallelism: Tensor.cumsum in 'mixer' (TokenMixer)")
        assert "keep_dense=['mixer']" in message and 'fallback="gather"' in message, message


def test_fallback_must_be_refuse_or_gather():
    with pytest.raises(ValueError, match="fallback must be one of"):
        pk.parallelize(nn.Conv2d(1, 1, 1), LocalCommunicator(), "spatial", fallback="whole")
