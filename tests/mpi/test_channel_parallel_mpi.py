"""ChannelParallelConv2d under mpiexec: the gloo tier's parity cases, chains, negative control,
round trip, bad input and collective counts, with the MPI communicator."""

from __future__ import annotations

import zlib

import pytest
import torch

from cases import assert_results, mismatches
from channel_cases import (
    CASES,
    CHAINS,
    OPTIONS,
    chain,
    collective_counts,
    errors,
    grouped_shortcut,
    parity,
    round_trip,
    spec_of,
    valid,
)


@pytest.mark.parametrize("split", ["out", "in"])
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_dense_conv(comm, name, split):
    if not valid(spec_of(name), split, {}, comm.size):
        pytest.skip(f"{name} cannot be split over {comm.size} ranks")
    assert_results(parity(comm, name, split))


@pytest.mark.parametrize(
    ("name", "split", "options"), OPTIONS, ids=[f"{n}-{s}-{o}" for n, s, o in OPTIONS]
)
def test_parity_split_input_or_output(comm, name, split, options):
    if not valid(spec_of(name), split, options, comm.size):
        pytest.skip(f"{name} cannot be split over {comm.size} ranks")
    assert_results(parity(comm, name, split, **options))


@pytest.mark.parametrize("name", list(CHAINS))
def test_chained_layers_equal_dense_convs(comm, name):
    assert_results(chain(comm, name))


def test_grouped_shortcut_does_not_match(comm):
    assert ("output" in mismatches(grouped_shortcut(comm, "k3 p1"))) == (comm.size > 1)


@pytest.mark.parametrize("split", ["out", "in"])
def test_round_trip_and_initialization(comm, split):
    assert_results(round_trip(comm, "k3 p1", split))


def test_bad_splits_and_inputs_raise_alike_on_every_rank(comm):
    if comm.size != 3:
        pytest.skip("the bad configurations are written for 3 ranks")
    digest = zlib.crc32("\n".join(errors(comm)).encode())
    digests = comm.all_gather(torch.tensor([digest], dtype=torch.int64)).tolist()
    assert digests == [digest] * comm.size, "ranks raised different errors"


@pytest.mark.parametrize(
    ("split", "options", "counts"),
    [("out", {}, (1, 1)), ("in", {}, (1, 1)), ("in", dict(scatter_output=True), (1, 3))],
)
def test_collective_counts(comm, split, options, counts):
    if comm.debug:
        pytest.skip("debug mode adds a signature check before each collective")
    want = counts if comm.size > 1 else (0, 0)
    assert collective_counts(comm, split, **options) == want
