"""Whole networks, parallelized, against the dense network over 3 SGD steps on gloo: a
ResNet-18-style classifier and a DCGAN generator and discriminator, with spatial (rows, a 2x2
grid), channel and data parallelism and their mixes with data parallelism on 2-4 ranks. Also
the grid's validation and ``to_dense`` round trips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import parallelkit as pk
from parallelkit.comm.local import LocalCommunicator
from parallelkit.nn import SyncBatchNorm, convert_sync_batchnorm

from cases import assert_triples
from network_cases import (
    FORWARD_CODE,
    NETWORKS,
    REFUSED,
    SWAPS,
    SwapNet,
    accumulated_grads,
    axis_maps_without_the_other_rows,
    block_outputs,
    chained,
    drop_in,
    flips_and_scans_on_their_own_blocks,
    host_exchanges_per_step,
    keep_dense_way_out,
    network_parity,
    parameters_reached_without_a_window,
    refusal,
    se_without_gradient_sum,
    warp_without_the_next_row,
    windows_from_the_other_end,
)


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("strategy", ["spatial", "channel"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_network_matches_dense(ranks, size, strategy, name):
    for triples in ranks(size).run(network_parity, name, strategy, timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize(
    ("strategy", "grid"),
    [
        ("data", None),
        ("spatial", dict(rows=2, cols=2)),
        ("spatial", dict(data=2, rows=2)),
        ("channel", dict(data=2, channel=2)),
    ],
)
def test_network_on_a_grid_of_four(ranks, strategy, grid, name):
    for triples in ranks(4).run(network_parity, name, strategy, grid, timeout=300):
        assert_triples(triples)


def test_grid_rejects_a_wrong_product():
    with pytest.raises(ValueError, match=r"2 x 1 x 2 x 1 x 1 = 4, but the communicator has 1"):
        pk.Grid(LocalCommunicator(), data=2, rows=2)


def test_unknown_strategy_and_names():
    comm = LocalCommunicator()
    with pytest.raises(ValueError, match="strategy must be one of"):
        pk.parallelize(nn.Conv2d(1, 1, 1), comm, "pipeline")
    with pytest.raises(ValueError, match=r"keep_dense names unknown modules \['nope'\]"):
        pk.parallelize(nn.Sequential(nn.Conv2d(1, 1, 1)), comm, "spatial", keep_dense=["nope"])


def test_to_dense_gives_the_same_tree_and_keys():
    model = NETWORKS["resnet18"][0]()
    keys = list(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    parallel = pk.parallelize(model, LocalCommunicator(), "spatial")
    dense = pk.to_dense(parallel)
    assert list(dense.state_dict()) == keys
    assert [type(m) for m in dense.modules()] == kinds
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(dense(x), parallel(x))


@pytest.mark.parametrize("name", list(SWAPS))
@pytest.mark.parametrize(("size", "grid"), [(2, None), (3, None), (4, "two by two")])
def test_every_swapped_layer_in_1d_2d_3d_matches_dense(ranks, size, grid, name):
    """Each spatial swap (conv, pools, transposed conv, upsampling, global pool) is exact in
    its own dimensions, split along the first spatial dimension or two of them."""
    dims = len(SWAPS[name][1]) - 1
    if grid is not None and dims == 1:
        pytest.skip("a 1-D sample has one dimension to split")
    grid = None if grid is None else dict(depth=2, rows=2) if dims == 3 else dict(rows=2, cols=2)
    for triples in ranks(size).run(network_parity, name, "spatial", grid, steps=2, timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize(("dims", "last"), [(1, False), (2, False), (2, True), (3, True)])
def test_every_swap_keeps_its_kind_and_runs_whole_tensors(dims, last):
    """A swapped layer given a whole tensor (what a gathered module passes on) runs the dense
    layer it stands for, of its own dimensions, and ``pk.to_dense`` gives that layer back:
    a 3-D global pool never becomes a 2-D one (swin3d_t's head)."""
    torch.manual_seed(0)
    dense = SwapNet(dims, last).double().eval()
    parallel = pk.parallelize(copy.deepcopy(dense), LocalCommunicator(), "spatial").eval()
    swapped = [m for m in parallel.modules() if type(m).__module__.startswith("parallelkit.nn")]
    assert len(swapped) >= 8, swapped  # each kind was swapped, so the test covers it
    x = torch.randn(2, 3, *(8,) * dims, dtype=torch.float64)
    if last:
        x = x.contiguous(memory_format=dense.memory)
    for dense_layer, layer in zip(dense.body, parallel.module.module.body, strict=True):
        torch.testing.assert_close(layer(x), dense_layer(x), rtol=0, atol=1e-12)
        x = dense_layer(x)
    back = pk.to_dense(parallel)
    assert [type(m) for m in back.modules()] == [type(m) for m in dense.modules()]


@pytest.mark.parametrize(
    ("mode", "size", "grid"),
    [("channel", 2, None), ("channel", 3, None), ("spatial", 3, None), ("spatial", 4, (2, 2))],
)
def test_parallel_conv2d_drops_into_a_dense_model(ranks, mode, size, grid):
    for triples in ranks(size).run(drop_in, mode, grid):
        assert_triples(triples)


@pytest.mark.parametrize(("mode", "size"), [("channel", 2), ("channel", 3), ("spatial", 3)])
def test_chained_parallel_conv2d_keeps_tensors_split(ranks, mode, size):
    for triples in ranks(size).run(chained, mode):
        assert_triples(triples)


class _ManualBatchNorm(nn.BatchNorm2d):
    """Normalizes without F.batch_norm: its statistics cannot be synchronized."""

    def forward(self, x):
        mean = x.mean((0, 2, 3), keepdim=True)
        var = x.var((0, 2, 3), unbiased=False, keepdim=True)
        return (x - mean) / (var + self.eps).sqrt()


@pytest.mark.parametrize("strategy", ["data", "spatial", "channel"])
def test_batchnorm_subclass_keeps_its_behaviour(strategy):
    from network_cases import BatchNormAct2d

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchNormAct2d(4))
    x = torch.randn(2, 3, 8, 8)
    parallel = pk.parallelize(copy.deepcopy(dense), LocalCommunicator(), strategy)
    torch.testing.assert_close(parallel(x), dense(x))
    assert type(pk.to_dense(parallel)[1]) is BatchNormAct2d
    assert list(pk.to_dense(parallel).state_dict()) == list(dense.state_dict())
    # Negative control: a plain SyncBatchNorm in its place drops the activation.
    plain = copy.deepcopy(dense)
    plain[1] = SyncBatchNorm.from_dense(plain[1], LocalCommunicator())
    assert not torch.allclose(plain(x), dense(x))


def test_batchnorm_subclass_without_f_batch_norm_is_refused():
    model = pk.parallelize(nn.Sequential(_ManualBatchNorm(3)), LocalCommunicator(), "data")
    with pytest.raises(ValueError, match=r"does not call F\.batch_norm"):
        model(torch.randn(2, 3, 4, 4))


def test_convert_sync_batchnorm_keeps_subclasses():
    from network_cases import BatchNormAct2d

    model = convert_sync_batchnorm(nn.Sequential(BatchNormAct2d(3), nn.BatchNorm2d(3)))
    assert isinstance(model[0], BatchNormAct2d) and not isinstance(model[0], SyncBatchNorm)
    assert type(model[1]) is SyncBatchNorm


@pytest.mark.parametrize("name", list(FORWARD_CODE))
@pytest.mark.parametrize(
    ("size", "strategy", "grid"),
    [
        (2, "spatial", None),
        (2, "spatial", dict(cols=2)),
        (4, "spatial", dict(rows=2, cols=2)),
        (4, "spatial", dict(data=2, rows=2)),
        (2, "channel", None),
        (2, "data", None),
    ],
)
def test_forward_code_matches_dense(ranks, name, size, strategy, grid):
    """SE blocks, layer scale, channel shuffle, concatenation and a dict output: exact."""
    for triples in ranks(size).run(network_parity, name, strategy, grid, steps=2, timeout=300):
        assert_triples(triples)


@pytest.mark.parametrize(("kind", "op"), list(REFUSED.items()))
@pytest.mark.parametrize("grid", [None, dict(rows=2, cols=2)])
def test_forward_code_without_an_exact_rule_is_refused(ranks, kind, op, grid):
    size = 4 if grid else 2
    for message in ranks(size).run(refusal, kind, grid):
        assert message.startswith(f"spatial parallelism: {op} in "), message
        assert "keep_dense=[" in message and "data or channel strategy" in message, message
        if kind == "recurrent":  # says why it needs the whole sample
            assert "a recurrent scan" in message and "whole sequence" in message, message


@pytest.mark.parametrize(
    ("size", "strategy", "grid"),
    [(2, "spatial", None), (4, "spatial", dict(rows=2, cols=2)), (2, "channel", None)],
)
@pytest.mark.parametrize("kind", ["dropout", "sampling"])
def test_dropout_masks_and_noise_are_the_dense_models(ranks, size, strategy, grid, kind):
    for triples in ranks(size).run(
        network_parity, f"forward code: {kind}", strategy, grid, steps=2
    ):
        assert_triples(triples)


def test_negative_control_se_without_the_gradient_sum(ranks):
    for bad in ranks(2).run(se_without_gradient_sum):
        assert any("se.fc1.weight grad" in label for label in bad), bad


def test_negative_control_windows_moved_to_the_wrong_ranks(ranks):
    for bad in ranks(2).run(windows_from_the_other_end):
        assert any("out" in label for label in bad), bad


def test_negative_control_flips_and_scans_on_their_own_blocks(ranks):
    for bad in ranks(2).run(flips_and_scans_on_their_own_blocks):
        assert any("out" in label for label in bad) and any("grad" in label for label in bad), bad


def test_negative_control_axis_maps_without_the_other_rows(ranks):
    for bad in ranks(2).run(axis_maps_without_the_other_rows):
        assert any("out" in label for label in bad) and any("grad" in label for label in bad), bad


def test_negative_control_warp_without_the_next_row(ranks):
    for bad in ranks(2).run(warp_without_the_next_row):
        assert any("out" in label for label in bad), bad


def test_a_bias_behind_attention_gets_its_gradient_where_a_rank_has_no_window(ranks):
    """timm's MaxViT on 3 row ranks: torch's attention on an empty batch leaves its mask out
    of the graph, and the bias table's gradient all-reduce then started at the end of backward
    on that rank alone, pairing with a row exchange of the others."""
    assert ranks(3).run(parameters_reached_without_a_window) == [[], [], []]


def test_refusal_names_the_module_and_keep_dense_is_the_way_out(ranks):
    for message, triple in ranks(2).run(keep_dense_way_out):
        assert message.startswith("spatial parallelism: Tensor.cumsum in '1' (_TokenScan)"), (
            message
        )
        assert "keep_dense=['1']" in message
        assert_triples([triple])


@pytest.mark.parametrize(
    ("size", "grid"), [(2, dict(rows=2)), (2, dict(cols=2)), (4, dict(rows=2, cols=2)),
                       (4, dict(data=2, rows=2))],
)  # fmt: skip
def test_block_outputs_give_the_dense_loss_and_gradients(ranks, size, grid):
    for triples in ranks(size).run(block_outputs, grid, timeout=300):
        assert_triples(triples)


def test_spatial_output_must_be_whole_or_blocks():
    with pytest.raises(ValueError, match="spatial_output must be 'whole' or 'blocks'"):
        pk.parallelize(nn.Conv2d(1, 1, 1), LocalCommunicator(), "spatial", spatial_output="rows")


@pytest.mark.parametrize(("size", "grid"), [(2, dict(rows=2)), (4, dict(rows=2, cols=2))])
def test_the_whole_size_travels_with_the_blocks(ranks, size, grid):
    for in_step, direct in ranks(size).run(host_exchanges_per_step, grid):
        assert (in_step, direct > 0) == (0, True)


@pytest.mark.parametrize("local_first", [False, True])
@pytest.mark.parametrize(
    ("size", "grid"), [(2, dict(rows=2)), (4, dict(data=2, rows=2)), (2, dict(data=2))]
)
def test_gradients_accumulate_as_in_the_dense_model(ranks, size, grid, local_first):
    for triples in ranks(size).run(accumulated_grads, grid, local_first):
        assert triples and assert_triples(triples) is None
