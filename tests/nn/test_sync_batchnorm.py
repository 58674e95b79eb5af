"""SyncBatchNorm: parity with torch.nn.BatchNorm1d/2d/3d on the whole batch (or the whole
volume, its depth split over ranks) over 1-4 gloo ranks, a negative control, collective
counts, degenerate batches, and conversion to and from dense."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.nn import SyncBatchNorm, convert_sync_batchnorm

from bn_cases import (
    CASES,
    LAYOUT_CASES,
    all_empty,
    collective_counts,
    one_value_raises,
    parity,
)
from cases import WORLD_SIZES, assert_results, assert_triples, mismatches


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_parity_with_dense_batchnorm(ranks, size, name):
    for results in ranks(size).run(parity, name):
        assert_results(results)


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
@pytest.mark.parametrize("size", [2, 3])
def test_parity_with_a_gradient_laid_out_otherwise(ranks, size, name):
    """The output's gradient in another layout than the input (SyncBatchNorm hands it the
    input's layout before torch's kernel reads it as such)."""
    for results in ranks(size).run(parity, name):
        assert_results(results)


@pytest.mark.parametrize(
    "name",
    ["(N, C, H, W)", "height split", "3d (N, C, D, H, W) uneven", "3d depth split",
     "1d length split"],
)  # fmt: skip
@pytest.mark.parametrize("size", [2, 4])
def test_per_rank_batchnorm_does_not_match(ranks, size, name):
    """Negative control: each rank normalizing with its own statistics fails the same checks."""
    for bad in [mismatches(r) for r in ranks(size).run(parity, name, per_rank=True)]:
        assert any("output" in label for label in bad)
        assert any("running_mean" in label for label in bad)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_one_collective_forward_one_backward(ranks, size):
    want = (0, 0) if size == 1 else (1, 1)
    assert ranks(size).run(collective_counts) == [want] * size
    assert ranks(size).run(collective_counts, eval_mode=True) == [(0, 0)] * size


@pytest.mark.parametrize("size", [1, 3])
def test_one_value_per_channel_raises_everywhere(ranks, size):
    assert all("more than 1 value per channel" in m for m in ranks(size).run(one_value_raises))


@pytest.mark.parametrize("size", [1, 3])
def test_empty_global_batch(ranks, size):
    for triples in ranks(size).run(all_empty):
        assert_triples(triples)


def test_channel_mismatch_raises():
    bn = SyncBatchNorm(4, comm=LocalCommunicator())
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(4\): input has 3 channels"):
        bn(torch.zeros(2, 3, 5))


def test_world_communicator_needed_when_comm_is_none(monkeypatch):
    import parallelkit.comm as pkc

    monkeypatch.setattr(pkc, "_WORLD", None)
    with pytest.raises(ValueError, match=r"pk.init\(\)"):
        SyncBatchNorm(3)(torch.zeros(2, 3))


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 3, 1),
        nn.BatchNorm1d(3),
        nn.Sequential(nn.BatchNorm2d(3, momentum=None), nn.BatchNorm3d(3, affine=False)),
        nn.SyncBatchNorm(3, eps=1e-3, track_running_stats=False),
    )


def test_convert_keeps_parameters_buffers_and_mode():
    model = _model()
    model[1].running_mean.fill_(0.5)
    model[2].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[1].weight
    comm = LocalCommunicator()
    converted = convert_sync_batchnorm(model, comm)
    assert converted is model
    bns = [model[1], model[2][0], model[2][1], model[3]]
    assert all(type(bn) is SyncBatchNorm and bn.comm is comm for bn in bns)
    assert model[1].weight is weight  # the same Parameter: optimizers keep working
    assert [bn.training for bn in bns] == [True, False, False, True]
    assert (model[2][0].momentum, model[2][1].affine, model[3].eps) == (None, False, 1e-3)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k])


def test_to_dense_round_trip():
    model = _model()
    dense_before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in (model[1], model[2][0], model[2][1])]
    convert_sync_batchnorm(model, LocalCommunicator())
    dense = [model[i].to_dense() for i in (1,)] + [model[2][i].to_dense() for i in (0, 1)]
    assert [type(m) for m in dense] == kinds
    assert dense[0].weight is model[1].weight
    torch.testing.assert_close(dense[0].running_mean, dense_before["1.running_mean"])


def test_single_batchnorm_is_converted_and_returned():
    bn = nn.BatchNorm2d(4)
    sync = convert_sync_batchnorm(bn, LocalCommunicator())
    assert isinstance(sync, SyncBatchNorm) and sync.weight is bn.weight
