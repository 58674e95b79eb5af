"""The soft Dice loss (parallelkit.train.tasks.losses) and ``train.loss`` of the segment task.

Tiers: pure (the whole-batch loss against a plain reference and MONAI's ``DiceLoss`` and
``DiceCELoss``; the negative control, per-block Dice averaged); pools of gloo ranks (the loss
on blocks of the logits, and the task's loss through a parallelized network and
DataParallel, equal the 1-process loss and gradients on spatial rows, an uneven split,
columns, data ranks and a data x rows grid); ``parallelkit train`` end to end on 2 spatial
ranks against 1; the config's refusals.

Blocks are cut as ``pk.spatial.scatter`` cuts them (``torch.tensor_split`` over rows, then
columns); a data rank takes its ``tensor_split`` share of the images.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from runs import SEGMENT_TINY as TINY
from runs import assert_curves_equal, curve, records, train
from torch import nn

import parallelkit as pk
from parallelkit.comm.local import LocalCommunicator
from parallelkit.data.segfolder import IGNORE
from parallelkit.parallel import Grid
from parallelkit.train import config
from parallelkit.train.tasks.losses import dice_loss
from parallelkit.train.tasks.segment import Segment

K = 4


def batch(dtype: torch.dtype = torch.float64, ignore: bool = True):
    """Logits (4, K, 11, 7) and masks (4, 11, 7): the last class only in the top left corner
    (absent from most blocks), and some pixels ignored."""
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(4, K, 11, 7, generator=g, dtype=dtype)
    mask = torch.randint(0, K - 1, (4, 11, 7), generator=g)
    mask[:, :3, :2] = K - 1
    if ignore:
        mask[0, 5, :] = IGNORE
        mask[2, -2:, -3:] = IGNORE
    return logits, mask


def cut(t: torch.Tensor, dims: tuple[int, int, int], coords) -> torch.Tensor:
    """The block (a view) of ``t`` (N, ..., H, W) that the rank at ``coords`` holds on a
    ``(data, rows, cols)`` grid."""
    data, rows, cols = dims
    d, _, r, c, _ = coords
    return t.tensor_split(data)[d].tensor_split(rows, -2)[r].tensor_split(cols, -1)[c]


def reference_dice(logits: torch.Tensor, mask: torch.Tensor, smooth: float = 1e-5):
    """Written out the slow way: one class at a time, over the labelled pixels of the batch."""
    p, valid = logits.softmax(1), mask != IGNORE
    terms = []
    for c in range(logits.shape[1]):
        pc, yc = p[:, c][valid], (mask[valid] == c).to(p.dtype)
        terms.append(1 - (2 * (pc * yc).sum() + smooth) / (pc.sum() + yc.sum() + smooth))
    return torch.stack(terms).mean()


def loss_and_grad(fn, logits: torch.Tensor, *args):
    x = logits.clone().requires_grad_()
    loss = fn(x, *args)
    loss.backward()
    return loss.detach(), x.grad


# --------------------------------------------------------------------------- pure
def test_whole_batch_equals_reference_with_ignored_pixels():
    logits, mask = batch()
    got, got_grad = loss_and_grad(dice_loss, logits, mask)
    want, want_grad = loss_and_grad(reference_dice, logits, mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert got_grad[0, :, 5].abs().max() == 0  # an ignored pixel gets no gradient


def test_whole_batch_equals_monai():
    monai = pytest.importorskip("monai.losses")
    logits, mask = batch(ignore=False)  # MONAI's one-hot has no ignored label
    mask[mask == 2] = 1  # class 2 absent everywhere: D_c = 0 for it, as MONAI's smoothing says
    monai_dice = monai.DiceLoss(softmax=True, to_onehot_y=True, batch=True)
    torch.testing.assert_close(dice_loss(logits, mask), monai_dice(logits, mask[:, None]))
    monai_fg = monai.DiceLoss(softmax=True, to_onehot_y=True, batch=True, include_background=False)
    fg = dice_loss(logits, mask, include_background=False)
    torch.testing.assert_close(fg, monai_fg(logits, mask[:, None]))
    # train.loss=dice_ce is MONAI's DiceCELoss (lambda 1 each: ce + dice), through the task
    one = SimpleNamespace(grid=Grid(LocalCommunicator()), cfg=cfg_of("dice_ce"))
    labelled = torch.tensor(float(mask.numel()))
    got, shown = Segment.loss(one, logits, mask, labelled)
    want = monai.DiceCELoss(softmax=True, to_onehot_y=True, batch=True)(logits, mask[:, None])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(shown, want)


def test_negative_control_mean_of_block_dice_differs():
    # Dice per block, then averaged (what a rank-local loss would give): neither its value
    # nor its gradient is the batch's.
    logits, mask = batch()
    dims = (1, 2, 1)
    x = logits.clone().requires_grad_()
    blocks = [(cut(x, dims, (0, 0, r, 0, 0)), cut(mask, dims, (0, 0, r, 0, 0))) for r in (0, 1)]
    naive = sum(dice_loss(b, m) for b, m in blocks) / 2
    naive.backward()
    want, want_grad = loss_and_grad(dice_loss, logits, mask)
    assert abs(naive.item() - want.item()) > 1e-3  # 0.760 against 0.750
    assert (x.grad - want_grad).norm() > 0.1 * want_grad.norm()  # 17% off here


def test_every_pixel_ignored_gives_zero_and_no_nan():
    logits, mask = batch()
    mask[:] = IGNORE
    loss, grad = loss_and_grad(dice_loss, logits, mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-12) and grad.abs().max() == 0


# --------------------------------------------------------------------------- pools
def dice_on_blocks(comm, dims, logits, mask):
    """Rank function: Dice of this rank's block, summed over the batch group."""
    grid = Grid(comm, *dims)
    x = cut(logits, dims, grid.coords).clone().requires_grad_()
    loss = dice_loss(x, cut(mask, dims, grid.coords), grid.batch_comm)
    loss.backward()
    return grid.coords, loss, x.grad


GRIDS = [  # (ranks, (data, rows, cols))
    (2, (1, 2, 1)),
    (2, (1, 1, 2)),
    (3, (1, 3, 1)),  # 11 rows: 4, 4, 3
    (2, (2, 1, 1)),
    (3, (3, 1, 1)),  # 4 images: 2, 1, 1
    (4, (2, 2, 1)),
]
IDS = ["rows2", "cols2", "rows3", "data2", "data3", "data2xrows2"]


@pytest.mark.parametrize(("size", "dims"), GRIDS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_loss_and_logit_gradients_on_blocks_equal_one_process(ranks, size, dims, dtype):
    logits, mask = batch(dtype)
    want, want_grad = loss_and_grad(dice_loss, logits, mask)
    grad = torch.full_like(logits, torch.nan)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for coords, loss, block_grad in ranks(size).run(dice_on_blocks, dims, logits, mask):
        torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
        cut(grad, dims, coords).copy_(block_grad)
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol)  # NaN: a pixel not covered


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, K, 3, padding=1))


def cfg_of(loss: str) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(loss=loss))


def task_step(grid: Grid, model: nn.Module, kind: str, x: torch.Tensor, mask: torch.Tensor):
    """One step of ``Segment``'s loss (its ``loss`` method, as ``step`` calls it) on this
    rank's images ``x`` and block of masks; returns (reported loss, data-group mean as the
    loop logs it)."""
    labelled = grid.batch_comm.all_reduce((mask != IGNORE).sum().float()).clamp(min=1)
    task = SimpleNamespace(grid=grid, cfg=cfg_of(kind))
    loss, shown = Segment.loss(task, model(x), mask, labelled)  # float64 here
    loss.backward()
    return grid.data_comm.all_reduce(shown.detach(), "mean")


def task_on_grid(comm, dims, kind, images, mask, state):
    """Rank function: the task's loss through the parallelized network and DataParallel."""
    grid = Grid(comm, *dims)
    net = tiny_net().double()
    net.load_state_dict(state)
    model = pk.parallelize(net, grid, grid, spatial_output="blocks")
    x = images.tensor_split(grid.data)[grid.coords[0]]
    logged = task_step(grid, model, kind, x, cut(mask, dims, grid.coords))
    return logged, {n: p.grad for n, p in pk.to_dense(model).named_parameters()}


@pytest.mark.parametrize(("size", "dims"), [GRIDS[0], GRIDS[2], GRIDS[4], GRIDS[5]],
                         ids=["rows2", "rows3", "data3", "data2xrows2"])  # fmt: skip
@pytest.mark.parametrize("kind", ["dice", "dice_ce", "ce"])
def test_task_loss_and_weight_gradients_equal_one_process(ranks, size, dims, kind):
    # The scaling for DataParallel (D * dice backpropagated, dice reported) is checked here:
    # the weights' gradients after DataParallel's mean, and the logged loss.
    _, mask = batch()
    images = torch.randn(4, 3, 11, 7, generator=torch.Generator().manual_seed(1)).double()
    net = tiny_net().double()
    want = task_step(Grid(LocalCommunicator()), net, kind, images, mask)
    want_grads = {n: p.grad for n, p in net.named_parameters()}
    state = net.state_dict()
    for logged, grads in ranks(size).run(task_on_grid, dims, kind, images, mask, state):
        torch.testing.assert_close(logged, want, rtol=1e-10, atol=1e-12)
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(
                g, want_grads[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
            )


# --------------------------------------------------------------------------- end to end
def test_train_dice_ce_on_two_spatial_ranks_equals_one(request, tmp_path):
    if request.config.getoption("--fast"):
        pytest.skip("--fast leaves out `parallelkit train` subprocesses")
    common = [*TINY, "train.loss=dice_ce"]
    # One after the other: on 2 shared cores the pair side by side is slower than in turn.
    train(tmp_path / "one", *common, "parallel.ranks=1")
    train(tmp_path / "two", *common, "parallel.strategy=spatial", "parallel.ranks=2")
    one, two = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert len(one) == 4 and len(set(one)) == 4  # it trains: the comparison is not vacuous
    assert_curves_equal(two, one)
    (last_one,), (last_two,) = ([r for _, r in sorted(records(d, "eval").items())][-1:]
                                for d in (tmp_path / "one", tmp_path / "two"))  # fmt: skip
    assert 0 <= last_one["mdice"] <= 1 and len(last_one["dice"]) == K
    for key in ("loss", "miou", "mdice"):
        assert last_two[key] == pytest.approx(last_one[key], rel=2e-4, abs=1e-5), key


def test_train_loss_default_is_ce():
    assert config.load(None, ["train.task=segment"]).train.loss == "ce"
    assert config.load(None, ["train.task=segment", "train.loss=dice"]).train.loss == "dice"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.loss=dice"], "train.loss=dice is for train.task=segment, not classify"),
        (["train.task=gan", "train.loss=dice_ce"], "train.loss=dice_ce is for train.task=seg"),
        (["train.task=segment", "train.loss=focal"], "train.loss must be one of"),
    ],
)
def test_config_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, overrides)
