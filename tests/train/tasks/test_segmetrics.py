"""Segmentation metrics: mIoU, mDice and pixel accuracy from counts summed over blocks equal
those of the gathered output, including classes absent from a block or from everything.

The ranks' blocks are cut as ``pk.spatial.scatter`` cuts them (``torch.tensor_split`` over rows,
then columns); summing per-block counts is what the all-reduce over the spatial and data groups
does (that path is run end to end in tests/train/loop/test_train_segment.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from parallelkit.train.tasks.segmetrics import pixel_counts, scores


def blocks(t: torch.Tensor, rows: int, cols: int) -> list[torch.Tensor]:
    return [c for r in t.tensor_split(rows, -2) for c in r.tensor_split(cols, -1)]


def reference_miou(pred: torch.Tensor, target: torch.Tensor, k: int) -> tuple[float, float, float]:
    """(mIoU, pixel accuracy, mDice), written out the slow way on the whole output."""
    valid = target != 255
    ious, dices = [], []
    for c in range(k):
        p, t = (pred == c) & valid, (target == c) & valid
        union = (p | t).sum().item()
        if union:
            ious.append((p & t).sum().item() / union)
            dices.append(2 * (p & t).sum().item() / (p.sum().item() + t.sum().item()))
    accuracy = ((pred == target) & valid).sum().item() / valid.sum().item()
    return sum(ious) / len(ious), accuracy, sum(dices) / len(dices)


@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (2, 2), (3, 2)])
def test_split_equals_gathered_with_absent_classes(grid):
    k = 6
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (2, 13, 11), generator=g)
    target[:, :3, :4] = 3  # class 3 only in the top left corner: absent from other blocks
    target[0, 5, 5] = 255  # ignored
    pred = torch.randint(0, 4, (2, 13, 11), generator=g)
    pred[:, -2:, -2:] = 4  # class 4 predicted in one corner only, never labelled
    # class 5: neither labelled nor predicted anywhere: left out of the mean
    whole = pixel_counts(pred, target, k)
    parts = [pixel_counts(p, t, k) for p, t in zip(blocks(pred, *grid), blocks(target, *grid),
                                                   strict=True)]  # fmt: skip
    assert any(c[2, 3] == 0 for c in parts)  # some block lacks class 3
    summed = torch.stack(parts).sum(0)
    assert torch.equal(summed, whole)
    got, want = scores(summed), reference_miou(pred, target, k)
    assert got["miou"] == pytest.approx(want[0], abs=1e-12)
    assert got["pixel_accuracy"] == pytest.approx(want[1], abs=1e-12)
    assert got["mdice"] == pytest.approx(want[2], abs=1e-12)
    assert got["iou"][5] is None and got["iou"][4] == 0.0 and got["classes_present"] == 5
    assert got["dice"][5] is None and got["dice"][4] == 0.0
    for iou, dice in zip(got["iou"][:5], got["dice"][:5], strict=True):
        assert dice == pytest.approx(2 * iou / (1 + iou), abs=1e-12)  # Dice = 2 IoU / (1 + IoU)


def test_negative_control_mean_of_block_mious_differs():
    # Averaging per-block mIoU (what a rank-local metric would report) is not the metric.
    target = torch.zeros(1, 8, 8, dtype=torch.int64)
    target[:, 4:, :2] = 1
    pred = torch.zeros_like(target)
    pred[:, 4:, :1] = 1
    mean_of_blocks = sum(
        scores(pixel_counts(p, t, 2))["miou"] for p, t in zip(blocks(pred, 2, 1),
                                                               blocks(target, 2, 1), strict=True)
    ) / 2  # fmt: skip
    assert not math.isclose(mean_of_blocks, scores(pixel_counts(pred, target, 2))["miou"])


def test_every_pixel_ignored():
    target = torch.full((1, 2, 2), 255)
    got = scores(pixel_counts(torch.zeros_like(target), target, 3))
    assert got == {"miou": 0.0, "mdice": 0.0, "pixel_accuracy": 0.0, "iou": [None] * 3,
                   "dice": [None] * 3, "classes_present": 0}  # fmt: skip
