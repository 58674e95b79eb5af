"""Random rules: dropout masks and noise drawn for the whole samples and cut to the block.

Every rank of the spatial group draws the same whole mask (or noise) from its own generator
(ranks seeded alike) and keeps its block of it: the dense model's. It costs one whole-image
noise tensor per call, transiently (a channel mask, for the channel dropouts, costs nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelkit.spatial.rules.registry import Call, Guard, channels_first, rule, whole_size

_EXACT = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout)
_CHANNELS = (F.dropout1d, F.dropout2d, F.dropout3d)


@rule(F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
      F.feature_alpha_dropout, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
      params="input, p=0.5, training=True, inplace=False", prefix=True)  # fmt: skip
def dropout(g: Guard, call: Call) -> Tensor:
    """In training, ``F.dropout`` and ``F.dropout1d/2d/3d``: the mask drawn for the whole
    samples (or channels) and cut to the block. In eval (or p = 0): local. Other kinds in
    training: refused."""
    x, p, inplace = call["input"], call["p"], call["inplace"]
    if not call["training"] or p == 0:
        return g.marked(call.run(), g.places(x))
    if g.folds(x):
        raise g.refuse(call.name, "in training, on windows folded into one dimension")
    ndim = channels_first(g, call, x)
    if call.func not in _EXACT or not 0 < p < 1:
        raise g.refuse(call.name, "only dropout and dropout1d/2d/3d draw masks exactly")
    size = whole_size(g, x)
    channels = call.func in _CHANNELS
    whole = (*x.shape[:2], *((1,) * ndim if channels else size))
    noise = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    noise = noise if channels else noise[(..., *g.grid.block(*size))]
    return g.marked(x.mul_(noise) if inplace else x * noise)


_LIKE = {torch.randn_like: "normal_", torch.rand_like: "uniform_"}


@rule(*_LIKE, params="input, *, dtype=None, layout=None, device=None, requires_grad=False, "
      "memory_format=torch.preserve_format")  # fmt: skip
def random_like(g: Guard, call: Call) -> Tensor:
    """``torch.randn_like`` and ``torch.rand_like`` of a block (a VAE's sampling noise,
    ``mu + sigma * randn_like(sigma)``): the noise drawn for the whole samples, laid out in
    memory as the block is (torch fills memory in order), and cut to the block."""
    x = call["input"]
    if g.folds(x) or call["memory_format"] != torch.preserve_format:
        raise g.refuse(call.name, "on windows folded into one dimension, or with a "
                       "memory_format of its own")  # fmt: skip
    channels_first(g, call, x)
    whole = (*x.shape[:2], *whole_size(g, x))
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost in memory first
    noise = torch.empty([whole[d] for d in order], dtype=call["dtype"] or x.dtype,
                        device=call["device"] or x.device)  # fmt: skip
    noise = noise.permute([order.index(d) for d in range(x.dim())])
    getattr(noise, _LIKE[call.func])()
    block = noise[(..., *g.grid.block(*whole[2:]))]
    return g.marked(block.requires_grad_(call["requires_grad"]))
