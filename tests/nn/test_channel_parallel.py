"""ChannelParallelConv1d/2d/3d: parity with nn.Conv1d/2d/3d on the whole input over 1-4 gloo
ranks (both splits, split inputs and outputs, chains), a negative control (the
grouped-convolution shortcut), collective counts, initialization and the dense round trip, and
bad input; ChannelParallelConvTranspose1d/2d/3d's parity with the dense layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.nn import (
    ChannelParallelConv1d,
    ChannelParallelConv2d,
    ChannelParallelConv3d,
    ChannelParallelConvTranspose3d,
)

from cases import WORLD_SIZES, assert_results, mismatches
from channel_cases import (
    BAD_SPLITS,
    CASES,
    CHAINS,
    OPTIONS,
    TRANSPOSED_CASES,
    chain,
    collective_counts,
    errors,
    grouped_shortcut,
    parity,
    replicated_bias,
    round_trip,
    spec_of,
    transposed_parity,
    valid,
)


def _params(combos):
    return [
        pytest.param(size, *combo, id=f"{size}-" + "-".join(map(str, combo)))
        for combo in combos
        for size in WORLD_SIZES
        if valid(spec_of(combo[0]), combo[1], combo[2] if len(combo) > 2 else {}, size)
    ]


@pytest.mark.parametrize(
    ("size", "name", "split"), _params([(n, s) for n in CASES for s in ("out", "in")])
)
def test_parity_with_dense_conv(ranks, size, name, split):
    for results in ranks(size).run(parity, name, split):
        assert_results(results)


@pytest.mark.parametrize(("size", "name", "split", "options"), _params(OPTIONS))
def test_parity_split_input_or_output(ranks, size, name, split, options):
    for results in ranks(size).run(parity, name, split, **options):
        assert_results(results)


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_chained_layers_equal_dense_convs(ranks, size, name):
    for results in ranks(size).run(chain, name):
        assert_results(results)


@pytest.mark.parametrize("name", ["k3 p1", "3d k3 p1", "1d k5 s2 p2"])
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_grouped_shortcut_does_not_match(ranks, size, name):
    """Negative control: the harness catches a grouped conv sold as a channel-parallel one
    (and, on one rank, where it is the dense conv, passes it)."""
    for results in ranks(size).run(grouped_shortcut, name):
        assert ("output" in mismatches(results)) == (size > 1)


@pytest.mark.parametrize("split", ["out", "in"])
@pytest.mark.parametrize("name", list(TRANSPOSED_CASES))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_transposed_parity_with_dense(ranks, size, name, split):
    for results in ranks(size).run(transposed_parity, name, split):
        assert_results(results)


@pytest.mark.parametrize(
    ("split", "options", "counts"),
    [
        ("out", {}, (1, 1)),  # all-gather / all-reduce
        ("in", {}, (1, 1)),  # all-reduce / all-gather
        # reduce-scatter / all-gathers of the output, input and bias gradients
        ("in", dict(scatter_output=True), (1, 3)),
        ("out", dict(gather_output=False), (0, 1)),
    ],
)
@pytest.mark.parametrize("name", ["k3 p1", "3d k3 p1"])
@pytest.mark.parametrize("size", [1, 3])
def test_collective_counts(ranks, size, name, split, options, counts):
    want = counts if size > 1 else (0, 0)
    assert ranks(size).run(collective_counts, split, name, **options) == [want] * size


@pytest.mark.parametrize(
    ("name", "split"),
    [("k3 p1", "out"), ("k3 p1", "in"), ("depthwise", "in"), ("k1 p0", "out"),
     ("3d k3 p1", "out"), ("3d same d2 reflect, no bias", "in"), ("1d k5 s2 p2", "in")],
)  # fmt: skip
@pytest.mark.parametrize("size", [1, 3, 4])
def test_round_trip_and_initialization(ranks, size, name, split):
    for results in ranks(size).run(round_trip, name, split):
        assert_results(results)


def test_replicated_bias_agrees_across_differently_seeded_ranks(ranks):
    biases = ranks(3).run(replicated_bias)
    assert not torch.equal(biases[0], torch.zeros_like(biases[0]))
    for b in biases[1:]:
        torch.testing.assert_close(b, biases[0], rtol=0, atol=0)


def test_bad_splits_and_inputs_raise_alike_on_every_rank(ranks):
    messages = ranks(3).run(errors)
    assert all(m == messages[0] for m in messages), "ranks raised different errors"
    assert all("ChannelParallelConv2d(" in m for m in messages[0])
    assert len(messages[0]) == len(BAD_SPLITS) + 2 * 3 + 1
    assert ranks(3).run(collective_counts, "out") == [(1, 1)] * 3  # nobody is left hanging


# ----------------------------------------------------------------------------- one process
def _local(**kw) -> ChannelParallelConv2d:
    return ChannelParallelConv2d(4, 6, 3, comm=LocalCommunicator(), **kw)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(split="both"), "split must be one of"),
        (dict(padding_mode="mirror"), "padding_mode must be one of"),
        (dict(padding="full"), "padding must be 'same', 'valid' or ints"),
        (dict(padding="same", stride=2), "padding='same' needs stride 1"),
        (dict(padding=-1), "padding must be >= 0"),
        (dict(groups=3), "positive multiples of groups"),
        (dict(split="in", gather_output=False), "use scatter_output=True"),
        (dict(split="out", scatter_output=True), "use gather_output=False"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=r"ChannelParallelConv2d\(4, 6.*" + message):
        _local(**kwargs)


def test_split_input_of_the_wrong_size_raises():
    layer = _local(split="in", input_is_split=True)
    with pytest.raises(ValueError, match="with input_is_split"):
        layer(torch.zeros(1, 3, 5, 5))


def test_from_dense_needs_a_conv2d():
    with pytest.raises(ValueError, match=r"expected an nn\.Conv2d"):
        ChannelParallelConv2d.from_dense(nn.Conv1d(2, 2, 3), LocalCommunicator())
    with pytest.raises(ValueError, match=r"Conv3d.from_dense: expected an nn\.Conv3d"):
        ChannelParallelConv3d.from_dense(nn.Conv2d(2, 2, 3), LocalCommunicator())
    with pytest.raises(ValueError, match=r"expected an nn\.ConvTranspose3d"):
        ChannelParallelConvTranspose3d.from_dense(nn.Conv3d(2, 2, 3), LocalCommunicator())


@pytest.mark.parametrize(
    ("kind", "shape", "message"),
    [
        (ChannelParallelConv3d, (2, 4, 5, 5), r"expected an \(N, C, D, H, W\) input"),
        (ChannelParallelConv1d, (2, 4, 5, 5), r"expected an \(N, C, L\) input"),
        (ChannelParallelConv3d, (2, 4, 5, 1, 5), "smaller than the dilated kernel"),
    ],
)
def test_volumes_and_signals_check_their_input(kind, shape, message):
    layer = kind(4, 6, 3, comm=LocalCommunicator())
    with pytest.raises(ValueError, match=rf"{kind.__name__}\(4, 6.*{message}"):
        layer(torch.zeros(shape))


def test_3d_same_padding_needs_stride_1_and_repr_names_the_kind():
    with pytest.raises(ValueError, match=r"ChannelParallelConv3d.*padding='same' needs stride"):
        ChannelParallelConv3d(4, 6, 3, (1, 2, 1), "same", comm=LocalCommunicator())
    layer = ChannelParallelConv3d(4, 6, 3, dilation=(1, 2, 1), comm=LocalCommunicator())
    assert layer.weight.shape == (6, 4, 3, 3, 3)
    assert "dilation=(1, 2, 1)" in repr(layer) and layer.to_dense().__class__ is nn.Conv3d


def test_world_communicator_needed_when_comm_is_none(monkeypatch):
    import parallelkit.comm as pkc

    monkeypatch.setattr(pkc, "_WORLD", None)
    with pytest.raises(ValueError, match=r"pk.init\(\)"):
        ChannelParallelConv2d(3, 3, 1)


def test_from_dense_keeps_dtype_requires_grad_and_mode():
    dense = nn.Conv2d(4, 6, 3, dtype=torch.float64).eval()
    dense.bias.requires_grad_(False)
    layer = ChannelParallelConv2d.from_dense(dense, LocalCommunicator(), split="in")
    assert layer.weight.dtype == torch.float64 and layer.weight.device.type == "cpu"
    assert layer.weight.requires_grad and not layer.bias.requires_grad and not layer.training
    assert layer.weight.data_ptr() != dense.weight.data_ptr()  # a copy
    assert set(layer.state_dict()) == set(dense.state_dict())
    assert "split='in'" in repr(layer)
