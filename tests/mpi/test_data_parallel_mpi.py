"""DataParallel under mpiexec: training parity with one process on the global batch, gradient
accumulation, compression and unused parameters, as in the gloo tier."""

from __future__ import annotations

import pytest
import torch

from cases import assert_triples
from dp_cases import BATCHES, training_parity, unused_parameters


@pytest.mark.parametrize("batches", list(BATCHES))
def test_training_matches_one_process_on_the_global_batch(comm, batches):
    assert_triples(training_parity(comm, batches))


def test_no_sync_accumulation_equals_the_big_batch(comm):
    assert_triples(training_parity(comm, "equal", steps=3, micro=2))


def test_bucket_per_parameter(comm):
    assert_triples(training_parity(comm, "uneven", steps=2, bucket_cap_mb=0))


def test_bf16_compression(comm):
    triples = training_parity(comm, "uneven", 1, torch.float32, compression="bf16")
    for label, got, expected in triples:
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3, msg=label)


def test_parameters_unused_on_some_ranks(comm):
    assert_triples(unused_parameters(comm))
