"""DataParallel on 1-4 gloo ranks: training parity with one process on the global batch (SGD
with momentum, SyncBatchNorm), gradient accumulation, bucketing, overlap, unused parameters,
compression and per-parameter communicators; bucket assignment as pure code."""

from __future__ import annotations

import pytest
import torch

from parallelkit.parallel.buckets import assign_buckets

from cases import WORLD_SIZES, assert_triples
from dp_cases import (
    BATCHES,
    broadcast_buffers,
    bucket_counts,
    bucket_order,
    dropped_wrapper_is_freed,
    globally_unused_keeps_none,
    launch_progress,
    reduce_over,
    small_cnn,
    state_dict_after_backward,
    training_parity,
    unused_parameters,
    unused_without_flag_raises,
)


@pytest.mark.parametrize("batches", list(BATCHES))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_training_matches_one_process_on_the_global_batch(ranks, size, batches):
    for triples in ranks(size).run(training_parity, batches):
        assert_triples(triples)


@pytest.mark.parametrize("size", [2, 4])
def test_float32_training(ranks, size):
    for triples in ranks(size).run(training_parity, "uneven", dtype=torch.float32):
        assert_triples(triples)


@pytest.mark.parametrize("size", [2, 3])
def test_no_sync_accumulation_equals_the_big_batch(ranks, size):
    for triples in ranks(size).run(training_parity, "equal", micro=3):
        assert_triples(triples)


@pytest.mark.parametrize("cap", [0, 0.0005, 25])
def test_bucket_sizes_give_the_same_training(ranks, cap):
    for triples in ranks(3).run(training_parity, "uneven", steps=3, bucket_cap_mb=cap):
        assert_triples(triples)


def test_bucket_cap_changes_the_buckets(ranks):
    """Not vacuous: 0 MiB is one bucket per parameter, 25 MiB one bucket for the small model."""
    assert ranks(2).run(bucket_counts, 0) == [9, 9]
    assert ranks(2).run(bucket_counts, 25) == [1, 1]


def test_buffers_a_sync_batchnorm_keeps_equal_are_not_broadcast(ranks):
    """A plain BatchNorm's buffers are broadcast before a training forward (running_mean,
    running_var: 8 floats; num_batches_tracked: 1); a SyncBatchNorm over the same ranks keeps
    its own equal, so the second running mean updates from rank 1's perturbed value there."""
    (sizes, means), (_, means_1) = ranks(2).run(broadcast_buffers, True)
    assert sizes == [8, 1]
    assert means[0] == means_1[0] and means[1] != means_1[1]
    # Negative control: a SyncBatchNorm over another communicator object is broadcast too.
    (sizes, means), (_, means_1) = ranks(2).run(broadcast_buffers, False)
    assert sizes == [16, 2] and means == means_1


def test_state_dict_after_backward(ranks):
    keys = ranks(2).run(state_dict_after_backward)[0]
    assert keys == [f"module.{k}" for k in small_cnn().state_dict()]


def test_all_reduce_starts_during_backward(ranks):
    for seen in ranks(2).run(launch_progress):
        assert len(seen) == 9
        assert seen[0] < 9  # the first bucket left before the last gradient was ready


def test_buckets_rebuilt_in_arrival_order(ranks):
    for before, after in ranks(2).run(bucket_order):
        assert before[0] == ["extra.bias"]  # reverse registration order
        assert [b[0] for b in after[:4]] == ["head.bias", "head.weight", "body.bias", "body.weight"]


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_all_reduce(ranks, compression):
    for triples in ranks(2).run(
        training_parity, "uneven", steps=1, dtype=torch.float32, compression=compression
    ):
        for label, got, expected in triples:
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3, msg=label)


@pytest.mark.parametrize("size", [2, 3])
def test_parameters_unused_on_some_ranks(ranks, size):
    for triples in ranks(size).run(unused_parameters):
        assert_triples(triples)


def test_parameters_unused_everywhere_keep_no_grad(ranks):
    assert ranks(2).run(globally_unused_keeps_none) == [True, True]


def test_unused_parameters_without_the_flag_raise_on_every_rank(ranks):
    for message in ranks(2).run(unused_without_flag_raises):
        assert "['extra.weight', 'extra.bias']" in message
        assert "find_unused_parameters=True" in message


def test_reduce_over_other_communicators(ranks):
    for triples in ranks(4).run(reduce_over):
        assert_triples(triples)


def test_assign_buckets_caps_orders_and_separates_keys():
    numels, keys = [10, 300, 20, 40, 5], ["a", "a", "b", "a", "a"]
    buckets = assign_buckets(
        numels, keys, [4] * 5, [4, 3, 2, 1, 0], cap_bytes=400, first_cap_bytes=200
    )
    # The first bucket (cap 200 B) closes once it reaches its cap: with parameter 1 (1200 B).
    assert [(b.key, b.params) for b in buckets] == [("a", [4, 3, 1]), ("b", [2]), ("a", [0])]
    assert buckets[0].offsets == [0, 5, 45] and buckets[0].numel == 345
    assert [b.params for b in assign_buckets(numels, keys, [4] * 5, range(5), 0)] == [
        [i] for i in range(5)
    ]


def test_a_dropped_wrapper_is_freed(ranks):
    assert all(ranks(2).run(dropped_wrapper_is_freed))
