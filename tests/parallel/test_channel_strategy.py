"""``pk.parallelize(model, comm, "channel")`` on signals and volumes: every Conv1d/3d and
ConvTranspose1d/3d is split by channels, the 3-D and 1-D test networks train exactly as the
dense ones do (outputs, input and parameter gradients, parameters and BatchNorm running
statistics after each SGD step, on 2-4 ranks, uneven channel splits on 3 and 4, and data x
channel on 4), and a model in which nothing can be split is refused on every rank instead of
running whole on each of them."""

from __future__ import annotations

import pytest

from cases import assert_triples
from channel_cases import channel_refusal, swapped_layers, volume_parity_without_input_sum
from volume_cases import volume_parity


@pytest.mark.parametrize("net", ["volume", "signal"])
@pytest.mark.parametrize(
    ("size", "grid"),
    [(2, dict(channel=2)), (3, dict(channel=3)), (4, dict(channel=4)),
     (4, dict(data=2, channel=2))],
    ids=["channel2", "channel3", "channel4", "data2xchannel2"],
)  # fmt: skip
def test_3d_and_1d_networks_match_dense_under_the_channel_strategy(ranks, size, grid, net):
    for triples in ranks(size).run(volume_parity, net, grid, timeout=300):
        assert_triples(triples)


def test_3d_and_1d_layers_are_swapped(ranks):
    for kinds in ranks(3).run(swapped_layers):
        assert kinds == [
            "ChannelParallelConv3d", "ChannelParallelConvTranspose3d", "ChannelParallelConv3d",
            "Conv3d", "ChannelParallelConv1d", "ChannelParallelConvTranspose1d",
        ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("no convolutions", "Sequential: it has no nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d"),
        ("narrow 3-D convolutions", "each of its 2 convolutions has fewer than 4 channels"),
        ("everything kept dense", "or named in keep_dense=['0']"),
    ],
)
def test_a_model_with_nothing_to_split_is_refused_on_every_rank(ranks, name, why):
    messages = ranks(4).run(channel_refusal, name)
    assert all(m == messages[0] for m in messages)
    assert "the channel strategy over 4 ranks splits nothing in" in messages[0]
    assert why in messages[0] and "use the data strategy" in messages[0], messages[0]


@pytest.mark.parametrize("net", ["volume", "signal"])
def test_negative_control_unsummed_input_gradients_do_not_match(ranks, net):
    for bad in ranks(2).run(volume_parity_without_input_sum, net, dict(channel=2)):
        assert "step 0 input grad" in bad and not any("output" in label for label in bad), bad
