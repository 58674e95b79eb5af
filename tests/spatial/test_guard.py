"""The spatial guard's rules, one operation at a time, without processes.

A guard over a one-rank group follows blocks exactly as over many (its collectives are then
copies): each allowed operation must keep the result a block (or make it whole, for sums and
means over H and W) with the dense value, and each operation without an exact rule must raise
the guard's ValueError before it runs. Whole networks under the guard, on 2-4 ranks, are in
test_parallelize.py.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial.guard import SpatialGuard

X = torch.randn(2, 4, 5, 6)


def guarded():
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = X.clone().requires_grad_()
    guard.mark(x, size=(5, 6))  # the whole size, as a region records it
    return guard, x


def _flag_unset(x: torch.Tensor) -> torch.Tensor:
    y = x.detach()
    y.requires_grad = False
    return y


BLOCKS = {
    "activation": lambda x: F.silu(x).relu_(),
    "requires_grad set on a detached block": _flag_unset,
    "arithmetic with a whole (1, C, 1, 1) tensor": lambda x: x * torch.ones(1, 4, 1, 1) + 1,
    "arithmetic with a scalar tensor": lambda x: x / torch.tensor(2.0),
    "where": lambda x: torch.where(x > 0, x, 0.1 * x),
    "channel slice": lambda x: x[:, 1:3],
    "batch index": lambda x: x[0],
    "cat along channels": lambda x: torch.cat([x, x * 2], dim=1),
    "stack, then a sum over the new dimension": lambda x: torch.stack([x, x * 2]).sum(0),
    "chunk along channels": lambda x: x.chunk(2, dim=1)[1],
    "view of the leading dims": lambda x: x.view(2, 2, 2, 5, 6),
    "F.pad of H and W by a constant": lambda x: F.pad(x, (1, 2, 3, 0), value=0.5),
    "F.pad cropping W, padding C": lambda x: F.pad(x, (-1, 0, 0, 1, 1, 0)),
    "transpose of the leading dims": lambda x: x.transpose(0, 1),
    "flatten of the leading dims": lambda x: x.flatten(0, 1),
    "a step over W": lambda x: x[..., 1::2],
    "a window partition folding H with N and back": lambda x: (
        x.permute(0, 2, 3, 1).reshape(10, 6, 4).relu() * torch.ones(10, 1, 1)
    ).view(2, 5, 6, 4).permute(0, 3, 1, 2),
    "mean over channels": lambda x: x.mean(1, keepdim=True),
    "softmax over channels": lambda x: x.softmax(1),
    "stack before C, flattened, then a softmax over it": (
        lambda x: torch.stack([x, x], 1).flatten(1).softmax(1)
    ),
    "1x1 F.conv2d": lambda x: F.conv2d(x, torch.ones(3, 4, 1, 1)),
    "3x3 F.conv2d, stride 2": lambda x: F.conv2d(x, torch.ones(3, 4, 3, 3), stride=2, padding=1),
    "F.conv2d, 'same', dilated, grouped": lambda x: F.conv2d(
        x, torch.linspace(-1, 1, 2 * 2 * 4 * 3).view(2, 2, 4, 3), padding="same", dilation=2,
        groups=2,
    ),
    "F.pad, reflect": lambda x: F.pad(x, (1, 2, 3, 0), mode="reflect"),
    "F.pad, replicate": lambda x: F.pad(x, (2, 1, 0, 3), mode="replicate"),
    "F.pad, circular": lambda x: F.pad(x, (1, 1, 2, 2), mode="circular"),
    "a Conv2d with padding_mode='reflect'": nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect"),
    "torch.max of two blocks": lambda x: torch.max(x, x * 2),
    "max over channels, with indices": lambda x: x.max(1).values,
    "F.interpolate x2, nearest": lambda x: F.interpolate(x, scale_factor=2),
    "F.max_pool2d": lambda x: F.max_pool2d(x, 3, 2, 1),
    "F.avg_pool2d": lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
    "F.max_pool2d, ceil_mode": lambda x: F.max_pool2d(x, 2, ceil_mode=True),
    "F.avg_pool2d, ceil_mode": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "nn.LPPool2d, p=2, ceil_mode": nn.LPPool2d(2, 3, 2, ceil_mode=True),
    "F.lp_pool2d, p=inf": lambda x: F.lp_pool2d(x, float("inf"), 2),
    "F.interpolate to a block's size, twice its own, bilinear": lambda x: F.interpolate(
        x, size=F.interpolate(x, scale_factor=2).shape[-2:], mode="bilinear"
    ),
    "eval dropout": lambda x: F.dropout(x, 0.5, training=False),
    "dtype and memory format": lambda x: x.double().contiguous(memory_format=torch.channels_last),
    # ConvNeXt: channels last, LayerNorm and Linear over the channels, layer scale, and back.
    "channels-last block": lambda x: (
        torch.ones(4) * F.linear(F.layer_norm(x.permute(0, 2, 3, 1), (4,)), torch.ones(4, 4))
    ).permute(0, 3, 1, 2),
    "mean over channels, channels last": lambda x: x.permute(0, 2, 3, 1).mean(-1).unsqueeze(1),
    # Spellings of channel slicing that leave H and W whole (GhostNet's x[:, :n, :, :]).
    "channel slice with full H and W slices": lambda x: x[:, :2, :, :],
    "channel slice after an ellipsis, channels last": lambda x: (
        x.permute(0, 2, 3, 1)[..., 1:3].permute(0, 3, 1, 2)
    ),
    "channel index tensor": lambda x: x[:, torch.tensor([3, 0, 2])],
    "boolean channel mask": lambda x: x[:, torch.tensor([True, False, True, True])],
    "new dimension before H": lambda x: x[:, :, None].squeeze(2),
    "narrow on C": lambda x: x.narrow(1, 1, 2),
    "index_select on C": lambda x: torch.index_select(x, 1, torch.tensor([1, 1, 0])),
    "split on C by sizes": lambda x: torch.split(x, [1, 3], dim=1)[1],
    "chunk on C, keyword dim": lambda x: torch.chunk(x, 2, dim=1)[0],
    "select a channel": lambda x: x.select(1, 2).unsqueeze(1),
    "flip of the channels": lambda x: x.flip(1),
    "stack after W": lambda x: torch.stack([x, 2 * x], -1).sum(-1),
    "max over channels, keepdim, values": lambda x: torch.max(x, dim=1, keepdim=True)[0],
    "min over channels, channels last": lambda x: x.permute(0, 2, 3, 1).min(-1).values.unsqueeze(1),
    "argmax over channels": lambda x: x + x.argmax(1, keepdim=True),
    "F.normalize over channels": lambda x: F.normalize(x, dim=1),
    "norm over channels": lambda x: x / x.norm(dim=1, keepdim=True),
    "repeat along channels only (MONAI's VNet)": lambda x: x.repeat(1, 2, 1, 1),
    "repeat into a new leading dimension": lambda x: x.repeat((3, 1, 1, 1, 1)).sum(0),
    "a whole (N, C, 1, 1) gate expanded to the block (timm's ECA)": lambda x: (
        x * x.mean((2, 3), keepdim=True).sigmoid().expand_as(x)
    ),
    "a block expanded along a size-1 channel dimension": lambda x: (
        x[:, :1].expand_as(x) + x
    ),
    # Sizes read from a block are the whole samples': what forward code computes from them.
    "F.pad to a multiple of 4, computed from x.shape": lambda x: F.pad(
        x, (0, -x.shape[-1] % 4, 0, -x.shape[-2] % 4)
    ),
    "F.interpolate to a literal size, twice the sample's": lambda x: F.interpolate(
        x, size=(10, 12)
    ),
    "view to sizes read from x.shape": lambda x: x.view(*x.shape[:2], x.size(2), x.size(-1)),
    "reshape with -1 for the channels": lambda x: x.reshape(-1, 2, *x.shape[2:]),
    "unflatten the channels, view as another block": lambda x: (
        x.unflatten(1, (2, 2)).flatten(1, 2).view_as(x)
    ),
    "space to depth by 2 along W, as timm's SpaceToDepth, and back": lambda x: (
        x.view(2, 4, 5, 3, 2).permute(0, 4, 1, 2, 3).reshape(2, 8, 5, 3)
        .view(2, 2, 4, 5, 3).permute(0, 2, 3, 4, 1).reshape(2, 4, 5, 6)
    ),
    "constants of the whole shape: x.new_zeros(x.shape), torch.ones(n, c, *x.shape[2:])": (
        lambda x: x + x.new_full(x.shape, 2.0) * torch.ones(2, 4, *x.shape[2:])
        + torch.zeros_like(x) + x.new_zeros(*x.shape)
    ),
    "whole tensors of the whole size, cut to the block: a (C, H, W) map, an arange over W":
        lambda x: x * torch.ones(4).view(4, 1, 1).expand(4, 5, 6) + torch.arange(x.shape[-1]),
    "cat with whole coordinate maps (CoordConv)": lambda x: torch.cat(
        [x, torch.linspace(-1, 1, x.shape[2]).view(1, 1, -1, 1).expand(2, 1, -1, x.shape[3])], 1
    ),
    "assignment to a channel slice (ReXNet's out[:, :c] += shortcut)": lambda x: (
        lambda y: (y.__setitem__((slice(None), slice(0, 2)), y[:, :2] + x[:, 1:3]), y)[1]
    )(x * 2),
    "a slice to the whole size is whole (Swin's unpad x[:, :H, :W, :])": lambda x: (
        x.permute(0, 2, 3, 1)[:, : x.shape[2], : x.shape[3], :].permute(0, 3, 1, 2)
    ),
    "slices of H: crops": lambda x: x[:, :, 1:, :] + x[:, :, :-1, :],
    "slices of H and W: a crop, channels sliced too": lambda x: x[:, 1:3, :4, 1:-1],
    "a crop of a channels-last block": lambda x: x.permute(0, 2, 3, 1)[:, 1:4, -3:],
    "F.pad of a channels-last block (Swin's pad to a window multiple)": lambda x: F.pad(
        x.permute(0, 2, 3, 1), (0, 1, 0, 2, 1, 0)
    ).permute(0, 3, 1, 2),
    "a channels-last block @ a matrix": lambda x: (
        x.permute(0, 2, 3, 1) @ torch.linspace(-1, 1, 12).view(4, 3)
    ).permute(0, 3, 1, 2),
    "torch.einsum over the channels": lambda x: torch.einsum(
        "nchw,dc->ndhw", x, torch.linspace(-1, 1, 12).view(3, 4)
    ),
    "torch.roll along H and W, and C": lambda x: torch.roll(x, (2, -3, 1), (2, 3, 1)),
    "Tensor.roll along H, channels last": lambda x: (
        x.permute(0, 2, 3, 1).roll(4, 1).permute(0, 3, 1, 2)
    ),
    "F.pixel_unshuffle, F.pixel_shuffle": lambda x: F.pixel_shuffle(
        F.pixel_unshuffle(F.pad(x, (0, 0, 0, 1)), 2) * 2, 2
    ),
}
WHOLE = {
    "mean over H and W": (lambda x: x.mean((2, 3)), lambda x: x.mean((2, 3))),
    "sum over N, H and W": (lambda x: x.sum((0, 2, 3), keepdim=True), None),
    "F.adaptive_avg_pool2d(1)": (lambda x: F.adaptive_avg_pool2d(x, 1), None),
    "F.adaptive_avg_pool2d((2, 3))": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), None),
    "F.adaptive_max_pool2d(2)": (lambda x: F.adaptive_max_pool2d(x, 2), None),
    "F.adaptive_max_pool2d(1)": (lambda x: F.adaptive_max_pool2d(x, 1), None),
    "amax over H and W": (lambda x: x.amax((2, 3)), None),
    "amin over N, H and W, kept": (lambda x: x.amin((0, 2, 3), keepdim=True), None),
    "max of everything": (lambda x: x.max(), None),
    "F.layer_norm over C, H and W, then a sum": (
        lambda x: F.layer_norm(x, (4, 5, 6), torch.linspace(0, 1, 120).view(4, 5, 6),
                               torch.ones(4, 5, 6)).sum((2, 3)),
        None,
    ),
    "var over H and W": (lambda x: x.var((2, 3)), None),
    "std over N, H and W, biased, kept": (
        lambda x: x.std((0, 2, 3), correction=0, keepdim=True), None
    ),
    "amax of integers": (lambda x: (x * 10).long().amax((2, 3)) + x.mean((2, 3)), None),
    "amax with ties (ReLU's zeros)": (lambda x: (-x.abs()).relu().amax((2, 3)), None),
    "F.group_norm, then a sum": (
        lambda x: F.group_norm(x, 2, torch.linspace(1, 2, 4), torch.ones(4)).sum((2, 3)),
        None,
    ),
    "F.instance_norm, then a mean": (lambda x: F.instance_norm(x).mean((2, 3)), None),
    # ConvNeXt-V2's global response normalization: a norm over H and W, channels last.
    "GRN: torch.norm p=2 over H and W, channels last": (
        lambda x: (lambda y: (y * torch.norm(y, p=2, dim=(1, 2), keepdim=True)).sum((1, 2)))(
            x.permute(0, 2, 3, 1)
        ),
        None,
    ),
    "Tensor.norm p=1 over H and W": (lambda x: x.norm(1, dim=(2, 3)), None),
    "vector_norm inf over N, H and W, kept": (
        lambda x: torch.linalg.vector_norm(x, float("inf"), dim=(0, 2, 3), keepdim=True), None
    ),
    "vector_norm of everything": (lambda x: torch.linalg.vector_norm(x), None),
    "norm over H and W of zeros has a zero gradient": (
        lambda x: (x * 0).norm(dim=(2, 3)) + x.mean((2, 3)), None
    ),
    "sum over H and W with a dtype": (lambda x: x.sum((2, 3), dtype=torch.float64), None),
    "logsumexp over H and W": (lambda x: torch.logsumexp(x * 3, (2, 3)), None),
    "logsumexp over C, H and W, kept": (lambda x: x.logsumexp((1, 2, 3), keepdim=True), None),
    "a mean by hand: the sum over H and W over H * W read from x.shape": (
        lambda x: x.sum((2, 3)) / (x.shape[2] * x.shape[3]), None
    ),
    "a mean by hand over numel()": (lambda x: x.sum((1, 2, 3)) / x[0].numel(), None),
    "F.mse_loss against a block, and F.l1_loss summed": (
        lambda x: F.mse_loss(x, x.flip(1) * 2) + F.l1_loss(x.relu(), x, reduction="sum"), None
    ),
    # A fold that holds every spatial dimension: each rank's part of it is its own.
    "view(N, -1), then a sum over it": (lambda x: x.view(2, -1).sum(1), None),
}
REFUSED = {
    "repeat along W": (lambda x: x.repeat(1, 1, 1, 2), "it repeats a spatial dimension"),
    "a whole tensor varying over H expanded to the block": (
        lambda x: torch.ones(1, 1, 5, 1).expand_as(x), "varies over a spatial dimension"
    ),
    # Merging spatial dimensions with others folds them: what treats the fold as a batch
    # takes it; what reads across it is refused.
    "flatten(1, 2): C with H, then a sum over it": (
        lambda x: x.flatten(1, 2).sum(1), "Tensor.sum in the model's forward touches a block of "
        "split images, and it is given a window partition",
    ),
    "flatten(1, 2): C with H, then a slice of it": (
        lambda x: x.flatten(1, 2)[:, :3], "reaches into windows folded into one dimension"
    ),

    "index along W": (lambda x: x[..., 0], "reaches a spatial dimension"),
    "max over W, with indices": (lambda x: x.max(3), "reduces over a spatial dimension"),
    "argmax over H": (lambda x: x.argmax(2), "reduces over a spatial dimension"),
    "norm over W only": (lambda x: x.norm(dim=3), "some of the spatial dimensions"),
    "norm p=3 over H and W": (lambda x: x.norm(3, dim=(2, 3)), "p=3"),
    "narrow along H": (lambda x: x.narrow(2, 0, 2), "cuts along a spatial dimension"),
    "a slice of H keeping no row": (lambda x: x[:, :, 7:], "keeps no row"),
    "F.normalize over W": (lambda x: F.normalize(x, dim=-1), "normalizes over a spatial dimension"),
    "a whole tensor varying over W, not of its size": (
        lambda x: x + torch.ones(5), "varies over a spatial dimension, whose whole size is 6"
    ),
    "cat along H": (lambda x: torch.cat([x, x], 2), "along a spatial dimension"),
    "stack before C, flattened, then a cumsum over it": (
        lambda x: torch.stack([x, x], 1).flatten(1).cumsum(1), "it is given a window partition"
    ),
    "F.conv2d with a split weight": (
        lambda x: F.conv2d(x, x[:, :, :2, :2]), "its weight is a block"
    ),
    "F.conv2d of a whole tensor by a block": (
        lambda x: F.conv2d(torch.ones(1, 4, 7, 8), x),
        "its weight is a block",
    ),
    "training alpha dropout": (lambda x: F.alpha_dropout(x, 0.5, True), "draw masks exactly"),
    "torch.einsum summing over W": (
        lambda x: torch.einsum("nchw->nch", x), "sums over a spatial dimension"
    ),
    "matmul over W": (lambda x: x @ torch.ones(6, 2), "it contracts a spatial dimension"),
    "assignment to a slice of H": (
        lambda x: x.clone().__setitem__((slice(None), slice(None), slice(0, 2)), 0.0),
        "writes to part of a spatial dimension",
    ),
    "F.layer_norm over W only": (lambda x: F.layer_norm(x, (6,)), "does not end in the whole"),
    "split along W": (lambda x: x.split(3, dim=3), "cuts along a spatial dimension"),
    "F.linear over W": (lambda x: F.linear(x, torch.ones(2, 6)), "acts over a spatial dimension"),
    "F.pad of a block with two dimensions before its spatial ones and C after": (
        lambda x: F.pad(x.permute(0, 2, 3, 1).unsqueeze(1), (0, 0, 1, 1)),
        "wants an (N, C, L), (N, C, H, W) or (N, C, D, H, W) block",
    ),
    "channels-last block into max pooling": (
        lambda x: F.max_pool2d(x.permute(0, 2, 3, 1), 2),
        "wants an (N, C, L), (N, C, H, W) or (N, C, D, H, W) block",
    ),
}


def test_training_dropout_draws_the_dense_mask():
    guard, x = guarded()
    state = torch.get_rng_state()
    with guard:
        y = F.dropout(x, 0.3)
    assert guard.is_split(y)
    torch.set_rng_state(state)
    torch.testing.assert_close(y, F.dropout(X, 0.3))


RESAMPLED = {
    "F.interpolate x2, align_corners": lambda x: F.interpolate(
        x, scale_factor=2, mode="bilinear", align_corners=True
    ),
    "F.interpolate by 1.5": lambda x: F.interpolate(x, scale_factor=1.5),
    "F.interpolate to a block's size, align_corners": lambda x: F.interpolate(
        F.avg_pool2d(x, 2), size=x.shape[-2:], mode="bilinear", align_corners=True
    ),
    "F.interpolate to a block's size, bicubic": lambda x: F.interpolate(
        x, size=F.avg_pool2d(x, 2).shape[-2:], mode="bicubic"
    ),
    "F.interpolate by 0.5, antialias": lambda x: F.interpolate(
        x, scale_factor=0.5, mode="bilinear", antialias=True
    ),
    "F.interpolate by 0.7, area": lambda x: F.interpolate(x, scale_factor=0.7, mode="area"),
    "F.interpolate to a size computed from x.shape, bicubic": lambda x: F.interpolate(
        x, size=(x.shape[-2] + 1, 7), mode="bicubic"
    ),
}


@pytest.mark.parametrize("name", list(RESAMPLED))
def test_resampling_runs_on_blocks(name):
    """Interpolation the upsampling layer does not cover: torch's own weights per dimension,
    applied to the rows each block reads; nothing gathered, so nothing warned."""
    op = RESAMPLED[name]
    guard, x = guarded()
    with guard, warnings.catch_warnings():
        warnings.simplefilter("error")
        y = op(x)
    assert guard.is_split(y)
    torch.testing.assert_close(y, op(X))


@pytest.mark.parametrize("name", list(BLOCKS))
def test_local_operations_keep_blocks(name):
    op = BLOCKS[name]
    guard, x = guarded()
    with guard:
        y = op(x)
    assert guard.is_split(y)
    torch.testing.assert_close(y, op(X.clone().requires_grad_()))


@pytest.mark.parametrize("name", list(WHOLE))
def test_sums_and_means_over_h_and_w_are_whole(name):
    op, _ = WHOLE[name]
    guard, x = guarded()
    with guard:
        y = op(x)
    assert not guard.is_split(y)
    torch.testing.assert_close(y, op(X))
    y.sum().backward()
    x_dense = X.clone().requires_grad_()
    op(x_dense).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad)


@pytest.mark.parametrize("name", list(REFUSED))
def test_operations_without_an_exact_rule_are_refused(name):
    op, why = REFUSED[name]
    guard, x = guarded()
    with guard, pytest.raises(ValueError, match="spatial parallelism: ") as info:
        op(x)
    assert why in str(info.value)
    assert "keep_dense=[" in str(info.value)


@pytest.mark.parametrize("training", [True, False])
def test_instance_norm_with_running_statistics(training):
    """nn.InstanceNorm2d(track_running_stats=True): the output, the gradients and, in
    training, the running statistics as torch updates them."""
    guard, x = guarded()
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double()
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.uniform_(0.5, 2)
    dense = copy.deepcopy(norm).train(training)
    x64, x_dense = x.double(), X.double().requires_grad_()
    guard.mark(x64, size=(5, 6))
    with guard:
        y = norm.train(training)(x64)
    assert guard.is_split(y)
    want = dense(x_dense)
    torch.testing.assert_close(y, want)
    (y * torch.linspace(-1, 1, 6)).sum().backward()
    (want * torch.linspace(-1, 1, 6)).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad.float())
    torch.testing.assert_close(norm.weight.grad, dense.weight.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(norm, name), getattr(dense, name))


def test_reflecting_more_rows_than_the_image_is_a_value_error():
    guard, x = guarded()
    with guard, pytest.raises(ValueError, match="needs more rows than the sample's 5"):
        F.pad(x, (0, 0, 5, 0), mode="reflect")


def test_whole_tensors_alone_are_not_followed():
    guard, _ = guarded()
    w = torch.randn(3, 3)
    with guard:
        y = (w @ w).flatten()  # nothing split: no rule applies
    assert not guard.is_split(y)


def test_negative_control_an_unmarked_input_is_not_checked():
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    with guard:
        y = X.flatten(1)  # X was never marked as a block: the guard cannot know
    assert not guard.is_split(y)


def test_the_docs_table_is_the_registry():
    """docs/parallelism.md holds the operations table generated from the rules' registry."""
    from pathlib import Path

    from parallelkit.spatial.rules import docs_table
    from parallelkit.spatial.rules.__main__ import in_docs

    docs = Path(__file__).parents[2] / "docs" / "parallelism.md"
    assert in_docs(docs.read_text()) == docs_table(), (
        "regenerate: python -m parallelkit.spatial.rules --write docs/parallelism.md"
    )


def test_every_rule_has_a_docstring_and_one_family():
    from parallelkit.spatial.rules import docs_rows

    families = {"pointwise", "views", "indexing", "reductions", "windows", "pooling", "padding",
                "norms", "resize", "random", "tokens"}  # fmt: skip
    for family, ops, what, exact in docs_rows():
        assert family in families and what and exact in ("yes", "refused"), (family, ops)



@pytest.mark.parametrize(
    ("size", "window", "grid"),
    [((14, 7), (7, 7), (2, 1)), ((7, 14), (7, 7), (1, 2)), ((16, 4, 4), (8, 4, 4), (2, 1, 1))],
)
def test_a_window_partition_folds_the_window_grid_and_its_reverse_unfolds_it(size, window, grid):
    """Swin's partition of a channels-last map (torchvision's views and permutes, 2-D and
    3-D): the window grid, one window wide along some dimensions, is folded into the batch,
    the windows' own rows are not spatial, and the reverse gives the map back, unfolded."""
    n, c, k = 2, 3, len(size)
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = torch.randn(n, *size, c)
    guard.mark(x, places=tuple(range(-k - 1, -1)), size=size)
    split = [v for s, w in zip(size, window, strict=True) for v in (s // w, w)]
    order = [0, *range(1, 2 * k, 2), *range(2, 2 * k + 1, 2), 2 * k + 1]
    back = [0, *(v for d in range(k) for v in (1 + d, 1 + k + d)), 2 * k + 1]
    with guard:
        y = x.view(n, *split, c).permute(order).reshape(-1, math.prod(window), c)
        assert guard.folds(y) == (((n, None), *((g, d) for d, g in enumerate(grid))),)
        assert guard.places(y) == (-3,) * k
        z = y.view(n, *grid, *window, c).permute(back).reshape(n, *size, c)
    assert guard.places(z) == tuple(range(-k - 1, -1)) and guard.folds(z) == ()
    torch.testing.assert_close(z, x)
