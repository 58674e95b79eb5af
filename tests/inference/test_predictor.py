"""Whole-sample prediction (:mod:`parallelkit.inference`) against the dense model.

Every rank reads its block of a sample from disk, runs it and writes its block of the class
map and softmax into the output file; the file must be the dense model's prediction on the
whole sample (float64: softmax within roundoff, class maps equal apart from ties). Images
over rows, rows x cols and 3 rows (uneven blocks), volumes over depth, depth x cols and
data x depth; sizes the network cannot take whole are padded (the same on any grid); zarr
outputs with chunks smaller than the blocks, which ranks share and write in turns. The
negative control switches the halo exchange off, and the file no longer matches.
"""

from __future__ import annotations

import pytest
from predict_cases import largest_in_prediction, predict_parity

from parallelkit.inference.outputs import chunking, final_paths
from parallelkit.inference.turns import boxes

from cases import assert_triples, mismatches


@pytest.mark.parametrize(
    ("size", "net", "grid", "shape", "fmt", "source", "chunks"),
    [
        (1, "image", dict(rows=1), (30, 27), "zarr", "npy", (4, 4)),
        (2, "image", dict(rows=2), (32, 24), "zarr", "zarr", (5, 7)),
        (3, "image", dict(rows=3), (29, 31), "npy", "npy", None),
        (4, "image", dict(rows=2, cols=2), (30, 27), "zarr", "zarr", (3, 4)),
        (2, "volume", dict(depth=2), (16, 16, 8), "nifti", "npy", None),
        (4, "volume", dict(depth=2, cols=2), (13, 16, 10), "zarr", "zarr", (3, 4, 5)),
        (4, "volume", dict(data=2, depth=2), (16, 12, 8), "npy", "npy", None),
    ],
)
def test_prediction_on_blocks_is_the_dense_prediction(ranks, tmp_path, size, net, grid, shape,
                                                      fmt, source, chunks):
    results = ranks(size).run(predict_parity, str(tmp_path), net, grid, shape, fmt, source,
                              chunks, timeout=300)
    assert sum(1 for r in results if r) == grid.get("data", 1)  # one check per spatial group
    for triples in results:
        assert_triples(triples)


@pytest.mark.parametrize("size", [2, 4])
def test_negative_control_without_the_halo_exchange_the_prediction_differs(ranks, tmp_path,
                                                                           size):
    results = ranks(size).run(predict_parity, str(tmp_path), "image", dict(rows=size),
                              (32, 24), "npy", tamper=True)
    bad = mismatches([(label, got, want, {}) for label, got, want in results[0]])
    assert "probabilities" in bad


@pytest.mark.parametrize(
    ("size", "net", "grid", "shape"),
    [(4, "image", dict(rows=2, cols=2), (64, 48)), (8, "volume", dict(depth=2, rows=2, cols=2),
                                                    (32, 32, 16))],
)
def test_no_rank_holds_a_whole_sample_while_predicting(ranks, tmp_path, size, net, grid, shape):
    for largest, op, whole in ranks(size).run(largest_in_prediction, str(tmp_path), net, grid,
                                              shape, timeout=300):
        assert 0 < largest < whole, f"{op} made a tensor of {largest} elements (a sample: {whole})"


def test_boxes_tile_the_block_and_own_only_whole_chunks():
    size, chunks = (23, 17), (4, 5)
    for block in [(slice(0, 12), slice(0, 17)), (slice(12, 23), slice(5, 11)),
                  (slice(3, 6), slice(16, 17))]:
        own, shared = boxes(block, size, chunks)
        cells = set()
        for box in own + shared:
            here = {(r, c) for r in range(box[0].start, box[0].stop)
                    for c in range(box[1].start, box[1].stop)}
            assert not cells & here
            cells |= here
        assert cells == {(r, c) for r in range(block[0].start, block[0].stop)
                         for c in range(block[1].start, block[1].stop)}
        for box in own:  # whole chunks (the last one cut by the sample's end)
            for s, n, c in zip(box, size, chunks, strict=True):
                assert s.start % c == 0 and (s.stop % c == 0 or s.stop == n)


def test_chunks_are_never_larger_than_the_smallest_block():
    assert chunking((100, 50), (3, 1), (64, 64)) == (33, 50)
    assert chunking((100, 50), (1, 1), None) == (100, 50)
    assert chunking((1000, 1000, 80), (1, 1, 8), (128, 128, 32)) == (128, 128, 10)


def test_output_names():
    from pathlib import Path

    assert final_paths("zarr", Path("o/s"), True) == [Path("o/s.zarr")]
    assert final_paths("nifti", Path("o/s"), True) == [Path("o/s_probabilities.nii"),
                                                       Path("o/s.nii")]
    with pytest.raises(ValueError, match=r"predict\.format"):
        final_paths("png", Path("o/s"), False)
