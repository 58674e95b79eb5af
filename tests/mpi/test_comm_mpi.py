"""MPI communicator under mpiexec: the same cases as the gloo tier, asserted on each rank.

Cases compute every collective before returning, so a failed assertion on one rank cannot
leave another rank waiting in a collective.
"""

from __future__ import annotations

import pytest
import torch

from parallelkit.comm.dtypes import DTYPES

import cases


@pytest.mark.parametrize("case", cases.COLLECTIVES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_collective(comm, dtype, case):
    cases.assert_triples(case(comm, dtype))


def test_async_split_exchange(comm):
    cases.assert_triples(cases.many_async(comm) + cases.grid_split(comm))
    cases.assert_triples(cases.neighbor_exchange(comm, False) + cases.neighbor_exchange(comm, True))


def test_bad_input(comm):
    messages = cases.bad_inputs(comm)
    assert "not supported" in messages["bool dtype"]


def test_bad_out(comm):
    assert "out must be a contiguous" in cases.bad_out(comm)["dtype"]


def test_debug_mode(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    messages = cases.debug_mismatches(comm)
    assert "rank 0: all_reduce(shape=(4,)" in messages["shape"]


def test_half_precision_reduces_in_float32(comm):
    """16-bit floats are summed in float32 and rounded once (MPI has no 16-bit float type).

    Sums of three or more bfloat16 values rounded after every step differ from this.
    """
    for dtype in (torch.bfloat16, torch.float16):
        everyone = torch.stack(
            [
                torch.randn(1000, generator=torch.Generator().manual_seed(r))
                for r in range(comm.size)
            ]
        ).to(dtype)
        expected = everyone.double().sum(0).to(dtype)
        assert torch.equal(comm.all_reduce(everyone[comm.rank]), expected)
        if comm.size >= 3:  # negative control: rounding after every step is different
            stepwise = everyone[0].clone()
            for row in everyone[1:]:
                stepwise += row
            assert not torch.equal(stepwise, expected)


def test_buffers_are_zero_copy_views():
    """MPI reads and writes the tensors' own memory: no pickling, no staging on the CPU."""
    from parallelkit.comm.mpi import _buf

    for dtype in DTYPES:
        t = torch.zeros(6, dtype=dtype)[2:]  # an offset into its storage
        spec = _buf(t)[0]
        assert spec.address == t.data_ptr()
        assert spec.nbytes == t.numel() * t.element_size()
    assert _buf(torch.zeros(0))[0].nbytes == 0  # no memory: an empty view
    with pytest.raises(ValueError, match="not contiguous"):  # an address would read wrongly
        _buf(torch.zeros(4, 4).t())
