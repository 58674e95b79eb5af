"""The soft Dice loss of segmentation, computed exactly on blocks of the logits.

``train.loss=dice`` or ``dice_ce`` (:mod:`parallelkit.train.tasks.segment`). The loss follows
MONAI's ``DiceLoss(softmax=True, to_onehot_y=True, batch=True)``: for each class c, over every
labelled pixel of the global batch (pixels labelled :data:`~parallelkit.data.segfolder.IGNORE`,
255, count in no sum)::

    p = softmax(logits) over classes,  y = one-hot(mask)
    I_c = sum p_c y_c      P_c = sum p_c      L_c = sum y_c          (soft counts)
    D_c = 1 - (2 I_c + smooth) / (P_c + L_c + smooth)                smooth = 1e-5
    dice = mean of D_c over the classes (background, class 0, included by default)

Why a module of its own: Dice is a ratio of sums, so unlike cross-entropy it is not a sum of
per-pixel terms, and the Dice of a block, or the mean of the blocks' Dice, is not the Dice of
the batch (a negative control in tests/train/tasks/test_losses.py shows how far off it is). What
is a sum is the soft counts, as the hard counts of :mod:`~parallelkit.train.tasks.segmetrics`
are. So each rank computes the counts of its block of its images, and one all-reduce over the
batch group (data x spatial: the other blocks of the same images and the other images) makes the
counts of the global batch before the ratio. Legend: ``N`` images of this rank, ``K`` classes,
``S`` this rank's block of the pixels (``h, w`` or ``d, h, w``); ``r`` a rank of the batch
group, ``R`` its size, ``D`` the data ranks.

Forward and backward (why the sum is ``reduce_from_group``)::

    s_r   = soft_counts(logits_r, mask_r)               (3, K), this rank's block
    S     = reduce_from_group(s_r, batch)  = sum_r s_r  the 1-process counts, on every rank
    dice  = dice_from_counts(S)                         the 1-process loss, on every rank

    backward: reduce_from_group is the identity, so rank r gets d dice / d S, which is
    d dice / d s_r (S = sum_r s_r): the 1-process gradient of its block's logits, exactly.

An all-reduce whose backward sums (``pk.functional.all_reduce``) would add the same gradient,
d dice / d S, once from each of the R ranks: R times the gradient.

The data group. DataParallel sums the parameter gradients over the data x spatial ranks and
divides by the D replicas; the blocks' shares of the gradient add up to the 1-process
gradient, so after the division it is 1/D of it. The task therefore backpropagates
``D * dice`` (as the cross-entropy term carries ``D / n``) and reports ``dice``, which every
data rank holds alike, so the loop's mean over the data group logs it unchanged.
"""

from __future__ import annotations

import torch

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.data.segfolder import IGNORE

SMOOTH = 1e-5
"""Added to the numerator and the denominator (MONAI's ``smooth_nr`` and ``smooth_dr``): a
class absent from the labels and the predictions has D_c = 0, not 0 / 0."""


def soft_counts(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(3, K)``: I_c, P_c and L_c of a block (differentiable in ``logits``).

    logits: ``(N, K, *S)``; mask: ``(N, *S)`` integers in ``0..K-1`` or ``IGNORE``. Computed in
    ``logits``' dtype; without a one-hot tensor (the intersection adds each pixel's
    probability of its own class into that class).
    """
    k = logits.shape[1]
    valid = mask != IGNORE  # (N, *S)
    label = mask.masked_fill(~valid, 0).long()  # (N, *S): ignored pixels are 0 here ...
    p = logits.softmax(1) * valid.unsqueeze(1)  # (N, K, *S): ... and weigh 0 in every sum
    own = p.gather(1, label.unsqueeze(1))  # (N, 1, *S): p of the labelled class
    intersection = p.new_zeros(k).scatter_add(0, label.flatten(), own.flatten())
    predicted = p.sum([d for d in range(p.dim()) if d != 1])
    labelled = torch.bincount(label[valid], minlength=k).to(p.dtype)
    return torch.stack([intersection, predicted, labelled])


def dice_from_counts(
    counts: torch.Tensor, smooth: float = SMOOTH, include_background: bool = True
) -> torch.Tensor:
    """The loss (0-dim) from counts ``(3, K)`` summed over the whole batch.

    ``include_background=False`` leaves class 0 out of the mean (MONAI's option of that name).
    """
    intersection, predicted, labelled = counts if include_background else counts[:, 1:]
    score = (2 * intersection + smooth) / (predicted + labelled + smooth)
    return (1 - score).mean()


def dice_loss(
    logits: torch.Tensor,
    mask: torch.Tensor,
    comm: Communicator | None = None,
    *,
    smooth: float = SMOOTH,
    include_background: bool = True,
) -> torch.Tensor:
    """The soft Dice loss of the batch whose blocks the ranks of ``comm`` hold.

    ``comm``: the group whose blocks together make the batch (the training loop's
    ``grid.batch_comm``, data x spatial); ``None`` or a group of one: this block is the batch.
    Collective over ``comm``: every rank must call it, a rank with an empty block too. Returns
    the same value on every rank, and gives each rank's ``logits`` the 1-process gradient of
    its block (the module docstring says why, and what data parallelism adds).
    """
    counts = soft_counts(logits, mask)
    if comm is not None:
        counts = pkf.reduce_from_group(counts, comm)
    return dice_from_counts(counts, smooth, include_background)
