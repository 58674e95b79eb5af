"""Segmentation metrics from per-class pixel counts: IoU and Dice per class, their means, and
pixel accuracy.

Why counts: a metric computed per block (or per image) and then averaged is not the metric of
the whole. Sums are: each rank counts, for every class c, the pixels where prediction and
label are both c (intersection I_c), the pixels predicted c (P_c) and the pixels labelled c
(L_c) in its block of its images; one all-reduce adds them over the spatial group (the other
blocks of the same images) and the data group (the other images); the scores come from the
sums, so they are those of the gathered output, computed without gathering it.

    IoU_c           = I_c / (P_c + L_c - I_c)      over every test pixel, not per image
    mIoU            = mean of IoU_c over the classes present: a class that is neither
                      labelled nor predicted anywhere (union 0) is left out of the mean
    Dice_c          = 2 I_c / (P_c + L_c)          the F1 score of class c, over every pixel
    mDice           = mean of Dice_c over the same classes present as mIoU's
    pixel accuracy  = sum_c I_c / sum_c L_c        (the fraction of labelled pixels right)

Pixels labelled :data:`~parallelkit.data.segfolder.IGNORE` (255) count nowhere.
"""

from __future__ import annotations

import torch

from parallelkit.data.segfolder import IGNORE


def pixel_counts(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(3, K)`` float64: intersection, predicted and labelled pixels of each class.

    pred, target: integer tensors of the same shape (any: a block, a batch of images).
    """
    valid = target != IGNORE
    p, t = pred[valid].long(), target[valid].long()
    k = num_classes
    hit = torch.bincount(t[p == t], minlength=k)[:k]
    return torch.stack(
        [hit, torch.bincount(p, minlength=k)[:k], torch.bincount(t, minlength=k)[:k]]
    ).double()


def scores(counts: torch.Tensor) -> dict[str, float | list[float | None]]:
    """mIoU, mDice, pixel accuracy, and per-class IoU and Dice (None: class absent) from
    summed counts."""
    inter, predicted, labelled = counts.double().cpu()
    union = predicted + labelled - inter
    present = union > 0
    iou = torch.where(present, inter / union.clamp(min=1), torch.nan)
    dice = torch.where(present, 2 * inter / (predicted + labelled).clamp(min=1), torch.nan)
    return {
        "miou": float(iou[present].mean()) if present.any() else 0.0,
        "mdice": float(dice[present].mean()) if present.any() else 0.0,
        "pixel_accuracy": float(inter.sum() / labelled.sum().clamp(min=1)),
        "iou": [float(v) if ok else None for v, ok in zip(iou, present, strict=True)],
        "dice": [float(v) if ok else None for v, ok in zip(dice, present, strict=True)],
        "classes_present": int(present.sum()),
    }


def score_block(logits: torch.Tensor, mask, block) -> tuple[torch.Tensor, float]:
    """``(pixel_counts, summed cross-entropy)`` of a block's logits ``(K, *block)`` against
    the same block of a mask on disk (a :class:`~parallelkit.data.readers.SampleReader`)."""
    import numpy as np
    import torch.nn.functional as F

    target = torch.from_numpy(np.asarray(mask.read(block)[0], dtype=np.int64))
    counts = pixel_counts(logits.argmax(0), target, logits.shape[0])
    loss = F.cross_entropy(logits[None].float(), target[None], ignore_index=IGNORE, reduction="sum")
    return counts, loss.item()
