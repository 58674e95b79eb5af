"""Communicators on gloo, 1-4 ranks: every operation and dtype against NumPy (see cases.py)."""

from __future__ import annotations

import pytest
import torch

import parallelkit as pk
from parallelkit.comm.dtypes import DTYPES

import cases
from cases import WORLD_SIZES

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.mark.parametrize("case", cases.COLLECTIVES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_collective(ranks, size, dtype, case):
    for triples in ranks(size).run(case, dtype):
        cases.assert_triples(triples)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_async_all_reduce_in_flight(ranks, size):
    for triples in ranks(size).run(cases.many_async):
        cases.assert_triples(triples)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_split_grid(ranks, size):
    for triples in ranks(size).run(cases.grid_split):
        cases.assert_triples(triples)


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_neighbor_exchange(ranks, size, periodic):
    for triples in ranks(size).run(cases.neighbor_exchange, periodic):
        cases.assert_triples(triples)


@pytest.mark.parametrize("size", [1, 3])
def test_bad_input_raises_on_every_rank(ranks, size):
    per_rank = ranks(size).run(cases.bad_inputs)
    assert all(m.keys() == per_rank[0].keys() for m in per_rank)
    messages = per_rank[0]
    assert "not supported" in messages["bool dtype"] and "float32" in messages["bool dtype"]
    assert "src=" in messages["src out of range"]
    assert "dim=2" in messages["dim out of range"]
    assert "op=" in messages["unknown op"] or "prod" in messages["unknown op"]


@pytest.mark.parametrize("size", [1, 2])
def test_bad_out_buffers_raise(ranks, size):
    messages = ranks(size).run(cases.bad_out)
    assert "out must be a contiguous (4, 3) torch.float32 tensor" in messages[0]["shape"]


@pytest.mark.parametrize("size", [2, 4])
def test_debug_mode_catches_mismatched_calls(ranks, size):
    per_rank = ranks(size).run(cases.debug_mismatches)
    for name, message in per_rank[0].items():
        # The same diagnosis on every rank, so every rank stops.
        assert all(m[name] == message for m in per_rank), name
    assert "rank 0: all_reduce(shape=(4,)" in per_rank[0]["shape"]
    assert "rank 1: all_reduce(shape=(3,)" in per_rank[0]["shape"]
    assert "broadcast" in per_rank[0]["collective"]
    assert "0 -> 1" in per_rank[0]["exchange size"]


def test_cases_can_fail():
    """Negative control: assert_triples rejects a wrong value and a wrong dtype."""
    with pytest.raises(AssertionError):
        cases.assert_triples([("x", torch.ones(2), torch.tensor([1.0, 2.0]))])
    with pytest.raises(AssertionError):
        cases.assert_triples([("x", torch.ones(2), torch.ones(2, dtype=torch.float64))])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_local_communicator(dtype):
    """pk.init("local") in this process: the size-1 results of the same cases."""
    comm = pk.init("local")
    for case in cases.COLLECTIVES:
        cases.assert_triples(case(comm, dtype))
    cases.assert_triples(cases.many_async(comm) + cases.grid_split(comm))
    cases.assert_triples(cases.neighbor_exchange(comm, True) + cases.neighbor_exchange(comm, False))
