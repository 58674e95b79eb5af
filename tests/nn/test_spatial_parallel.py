"""Spatial layers on 1-4 gloo ranks against the dense torch layers on the whole image: output
block, input-gradient block and parameter gradients, over the issue's matrix of kernel sizes,
strides, paddings, dilations and groups, for height, width and 2x2 splits, uneven splits,
one-row shards and shards thinner than the halo. The adjoint test of the row exchange is in
test_functional.py (gather_rows)."""

from __future__ import annotations

import pytest

from cases import assert_triples
from spatial_cases import (
    bad_grid,
    bad_layout,
    constructed_on_every_rank,
    conv_configs,
    conv_transpose_configs,
    edges_left_out,
    failures,
    other_failures,
    overlapped,
    saved_bytes,
    scatter_gather,
    transposed_halos_left_out,
)

CONVS = list(conv_configs())
TRANSPOSED = list(conv_transpose_configs())


def _check(results, at_least):
    for ran, bad in results:
        assert ran >= at_least, f"only {ran} configurations ran"
        assert not bad, "\n".join(bad[:20]) + f"\n({len(bad)} mismatches)"


@pytest.mark.parametrize("size", [2, 3])
def test_conv_height_split_full_matrix(ranks, size):
    """11 rows over 3 ranks is 4 4 3: a 7-tap dilated kernel reads past the neighbours."""
    _check(ranks(size).run(failures, "conv", CONVS, (11, 6), timeout=300), 250)


@pytest.mark.parametrize(("size", "grid"), [(2, (1, 2)), (3, (1, 3)), (4, (2, 2))])
def test_conv_width_and_2x2_splits(ranks, size, grid):
    _check(ranks(size).run(failures, "conv", CONVS[size - 2 :: 3], (9, 11), grid, timeout=300), 80)


@pytest.mark.parametrize(
    ("size", "hw", "grid"),
    [
        (3, (37, 5), None),  # uneven: 13 12 12
        (4, (4, 5), None),  # one-row shards
        (4, (2, 9), (2, 2)),  # one row and 4-5 columns per rank
        (4, (3, 5), None),  # rank 3 holds no rows at all
    ],
)
def test_conv_uneven_and_thin_shards(ranks, size, hw, grid):
    # 1 x 1 with stride 1: the pointwise path, on an empty block too (F.conv refuses one)
    pointwise = [c for c in CONVS if c["kernel_size"] == 1 and c["stride"] == 1]
    configs = pointwise + [c for c in CONVS if c["kernel_size"] in (3, 4, 7) and c["groups"] == 1]
    _check(ranks(size).run(failures, "conv", configs, hw, grid, timeout=300), 20)


@pytest.mark.parametrize(("size", "grid"), [(1, None), (2, None), (3, None), (4, (2, 2))])
def test_conv_transpose(ranks, size, grid):
    configs = TRANSPOSED if size in (1, 2) else TRANSPOSED[::3]
    hw = (1, 1) if size == 1 else (5, 7)
    _check(ranks(size).run(failures, "convT", configs, hw, grid, timeout=300), 50)


def test_dcgan_first_layer_from_one_pixel(ranks):
    """The DCGAN generator starts from 1x1 noise: rank 1 holds no rows and fetches them."""
    configs = [dict(kernel_size=4, stride=1, padding=0)]
    _check(ranks(2).run(failures, "convT", configs, (1, 1)), 1)


@pytest.mark.parametrize(
    ("size", "hw", "grid"),
    [
        (1, (9, 7), None),
        (2, (9, 7), None),
        (3, (13, 6), None),
        (4, (9, 10), (2, 2)),
        (4, (5, 9), (1, 4)),
    ],
)
def test_pooling_upsampling(ranks, size, hw, grid):
    _check(ranks(size).run(other_failures, hw, grid), 19)


@pytest.mark.parametrize("size", [2, 4])
def test_convolving_blocks_without_halo_does_not_match(ranks, size):
    """Negative control: each rank convolving its block alone, zero-padded at its edges."""
    configs = [dict(kernel_size=3, padding=1)]
    for ran, bad in ranks(size).run(failures, "conv", configs, (8, 5), no_halo=True):
        assert ran == 1 and any("output" in b for b in bad)


def test_grid_must_match_the_communicator(ranks):
    for message in ranks(2).run(bad_grid):
        assert "spatial grid 3 x 1 does not match a communicator of 2 ranks" in message


def test_blocks_must_be_tensor_split(ranks):
    for message in ranks(3).run(bad_layout):
        assert "not the tensor_split layout" in message and "pk.spatial.scatter" in message


@pytest.mark.parametrize(("size", "grid"), [(1, None), (3, None), (4, (2, 2)), (2, (1, 2))])
def test_scatter_gather(ranks, size, grid):
    for triples in ranks(size).run(scatter_gather, grid):
        assert_triples(triples)


def test_parameters_start_as_rank_0s(ranks):
    for triples in ranks(3).run(constructed_on_every_rank):
        assert_triples(triples)


@pytest.mark.parametrize(("size", "grid"), [(2, None), (3, None), (3, (1, 3)), (4, (2, 2))])
def test_conv_with_the_halo_fetched_during_the_block(ranks, size, grid):
    """overlap=True: the halo rows arrive on a helper thread while the block is convolved."""
    configs = [c for c in CONVS if c["stride"] == 1][::2]
    _check(ranks(size).run(overlapped, "conv", configs, (11, 9), grid, timeout=300), 20)


@pytest.mark.parametrize(
    ("size", "hw", "grid"),
    [(2, (8, 5), None), (3, (11, 6), None), (2, (5, 8), (1, 2)), (4, (7, 6), (2, 2))],
)
def test_edge_path_without_the_halo_terms_does_not_match(ranks, size, hw, grid):
    for bad in ranks(size).run(edges_left_out, hw, grid):
        assert any("output" in b for b in bad) and any("input grad" in b for b in bad), bad


@pytest.mark.parametrize(
    ("size", "hw", "grid"), [(2, (8, 5), None), (3, (11, 6), None), (4, (7, 6), (2, 2))]
)
def test_transposed_edge_path_without_the_halo_rows_does_not_match(ranks, size, hw, grid):
    bad = ranks(size).run(transposed_halos_left_out, hw, grid)
    assert all(any("output" in b for b in mine) for mine in bad), bad
    assert any("input grad" in b for mine in bad for b in mine), bad


@pytest.mark.parametrize(("size", "grid"), [(2, None), (2, (1, 2)), (4, (2, 2))])
def test_spatial_conv_transpose_saves_little_beyond_its_block(ranks, size, grid):
    """A 4x4, stride 2 transposed convolution scatters its block as it is: it keeps one halo
    row per side and split dimension (the 2-D grid's rows with their corner columns)."""
    for saved in ranks(size).run(saved_bytes, (24, 20), grid, 1, "convT"):
        rows = 2 * saved["row"] * (saved["w"] + 2) / saved["w"] if size == 4 else 0
        line = saved["column"] if grid == (1, 2) else saved["row"]
        assert 0 < saved["extra"] <= rows + 2 * line, saved


@pytest.mark.parametrize(
    ("size", "grid", "stride"), [(2, None, 1), (2, (1, 2), 1), (4, (2, 2), 1), (2, None, 2)]
)
def test_spatial_conv_saves_little_beyond_its_block(ranks, size, grid, stride):
    """Saved for backward beyond the input block and the weight: the edge path keeps at most
    two slabs of 3 rows per split dimension (a 2-D grid's row slabs with their corner
    columns); a stride-2 convolution assembles the halo-extended block (a control that the
    measurement sees a copy)."""
    for saved in ranks(size).run(saved_bytes, (24, 20), grid, stride):
        if stride == 2:
            assert saved["extra"] > saved["block"], saved
        elif grid == (2, 2):
            rows = 2 * 3 * saved["row"] * (saved["w"] + 2) / saved["w"]
            assert 0 < saved["extra"] <= rows + 2 * 3 * saved["column"], saved
        else:  # rows of the split dimension
            line = saved["column"] if grid == (1, 2) else saved["row"]
            assert 0 < saved["extra"] <= 2 * 3 * line, saved
