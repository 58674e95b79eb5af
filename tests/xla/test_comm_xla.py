"""The XLA communicator at world size 1 on an XLA CPU device, against torch on the CPU.

The public operations take the size-1 fast path of the base class, so the backend's own
primitives (``_all_reduce``, ``_all_gather``, ...) are also called directly: with one replica
XLA runs their collectives (a group of one), which checks their lowering and bookkeeping.
The pure helpers that shape multi-replica messages (padding, permute rounds) are tested here
too; the multi-replica graphs themselves in test_trace_xla.py.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla

import parallelkit as pk
from parallelkit.comm import detect_backend
from parallelkit.comm.xla import XlaCommunicator, _pad_rows, _rounds

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64)


@pytest.fixture(scope="module")
def comm() -> XlaCommunicator:
    return pk.init("xla")


def _input(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)  # small ints: exact sums


def _same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.device.type == "xla", f"result left the device: {got.device}"
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


def test_init_and_detect(comm, monkeypatch):
    assert isinstance(comm, XlaCommunicator)
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert detect_backend() == "xla"
    monkeypatch.delenv("PJRT_DEVICE")
    assert detect_backend() == "local"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_operations(comm, dtype):
    cpu = _input((6, 4), dtype)
    x = cpu.to(torch_xla.device())
    for op in ("sum", "max", "min") + (("mean",) if dtype.is_floating_point else ()):
        _same(comm.all_reduce(x, op), cpu)
        _same(comm.all_reduce_async(x, op).wait(), cpu)
    _same(comm.all_gather(x, dim=1), cpu)
    _same(comm.reduce_scatter(x, dim=0), cpu)
    _same(comm.broadcast(x, src=0), cpu)
    _same(comm.reduce(x, dst=0), cpu)
    buf = torch.zeros(6, 4, dtype=dtype, device=x.device)
    assert comm.all_reduce(x, out=buf) is buf
    _same(buf, cpu)
    comm.barrier()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_primitives_run_on_device(comm, dtype):
    """The backend's own collectives (a group of one replica), run by XLA."""
    cpu = _input((5, 3), dtype, seed=1)
    x = cpu.to(torch_xla.device())

    def out():
        return torch.zeros_like(x)

    for op in ("sum", "max", "min"):
        _same(comm._all_reduce(x, op, out()), cpu)
        _same(comm._reduce_scatter(x, [5], op, out()), cpu)
        _same(comm._reduce(x, 0, op, out()), cpu)
    _same(comm._all_gather(x, [5], out()), cpu)
    _same(comm._broadcast(x.clone(), 0), cpu)


def test_primitives_pin_layout_off(comm):
    """Real all-gather and reduce-scatter operations (not the all-reduce-based ones)."""
    loose = XlaCommunicator(pin_layout=False)
    cpu = _input((4, 2), torch.float32, seed=2)
    x = cpu.to(torch_xla.device())
    _same(loose._all_gather(x, [4], torch.zeros_like(x)), cpu)
    _same(loose._reduce_scatter(x, [4], "sum", torch.zeros_like(x)), cpu)


def test_host_tensors_stay_on_host(comm):
    """Host tensors (sizes, signatures) take the host path: no device, no graph."""
    t = torch.tensor([[3, 4]])
    assert comm._all_gather(t, [1], t.new_empty(1, 2)).tolist() == [[3, 4]]
    assert comm._all_reduce(t, "sum", t.new_empty(1, 2)).tolist() == [[3, 4]]
    assert comm._exchange_sizes(7) == [7]


def test_neighbor_exchange_with_itself(comm):
    """A periodic chain of one rank: the message comes back (the base class copies it)."""
    x = torch.arange(6.0).view(2, 3).to(torch_xla.device())
    buf = torch.zeros(2, 3, device=x.device)
    (got,) = comm.neighbor_exchange([(0, x)], [(0, buf)])
    _same(got, torch.arange(6.0).view(2, 3))


def test_collective_permute_with_one_replica(comm):
    """The exchange primitive itself: a self-permute round of a flattened, padded message."""
    x = torch.arange(6.0).view(3, 2).to(torch_xla.device())
    buf = torch.zeros(3, 2, device=x.device)
    comm._exchange([(0, 0, x)], [(0, 0, buf)])
    _same(buf, torch.arange(6.0).view(3, 2))


def test_split_and_debug_mode(comm):
    sub = comm.split(color=3, key=0)
    assert (sub.rank, sub.size, sub.members, sub.groups) == (0, 1, [0], [[0]])
    checked = XlaCommunicator(debug=True)
    x = torch.ones(2, device=torch_xla.device())
    _same(checked.all_reduce(x), torch.ones(2))


def test_bad_input_raises_before_communicating(comm):
    with pytest.raises(ValueError, match="dtype"):
        comm.all_reduce(torch.ones(2, dtype=torch.bool, device=torch_xla.device()))
    with pytest.raises(ValueError, match="dim"):
        comm.all_gather(torch.ones(2, device=torch_xla.device()), dim=3)


def test_pad_rows():
    t = torch.arange(6.0).view(2, 3)
    padded = _pad_rows(t, 4)
    assert padded.shape == (4, 3)
    assert torch.equal(padded[:2], t) and not padded[2:].any()
    assert _pad_rows(t, 2) is t


def test_rounds_halo_chain():
    """A halo exchange on a chain of 4: both directions fit in one round, every rank sends
    and receives at most once per round, and each round has one dtype."""
    f32 = "torch.float32"
    up = [(r, r + 1, 0, 6, f32) for r in range(3)]
    messages = up + [(r, r - 1, 0, 9, f32) for r in (1, 2, 3)]
    rounds = _rounds(messages)
    assert sorted(m for r in rounds for m in r) == sorted(messages)
    for r in rounds:
        assert len({m[0] for m in r}) == len(r) and len({m[1] for m in r}) == len(r)
    assert len(rounds) == 2  # rank 1 sends twice: at least two rounds
    mixed = _rounds([(0, 1, 0, 1, f32), (1, 0, 0, 1, "torch.float64")])
    assert all(len({m[4] for m in r}) == 1 for r in mixed)


def test_spmd_needs_use_spmd():
    from parallelkit.xla import parallelize

    with pytest.raises(ValueError, match="use_spmd"):
        parallelize(torch.nn.Conv2d(1, 1, 1))


def test_device_ops_are_lowered():
    """No CPU fallback was taken by anything above (a fallback would end the graph)."""
    import torch_xla.debug.metrics as met

    torch_xla.sync()
    assert met.executed_fallback_ops() == []
