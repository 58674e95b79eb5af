"""Optimizers and the learning-rate schedule for large global batches.

SGD and Adam are torch's. LARS (You et al., 2017) is written here because torch has none and
the well-kept ones live in packages that pull in vision stacks (timm needs torchvision). It is
SGD whose step for each weight matrix is scaled by the trust ratio
``eta * |w| / (|g| + wd * |w|)``; biases and normalization parameters (1-d) keep plain SGD,
as in the paper's large-batch ResNet runs.

A weight split over a channel group (a channel-parallel convolution holds a slice of the
output channels) has the norms of its slice only; LARS sums the squared norms over the
group (``shard_comms``), so every rank scales its slice by the dense trust ratio.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.train.schema import OptimConfig


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio for tensors of more than one dimension.

    shard_comms: parameter -> the communicator over which it is split (its norm is the norm
        of the whole tensor, summed over that group).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        shard_comms: dict[nn.Parameter, Communicator] | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient
        )
        super().__init__(params, defaults)
        self.shard_comms = shard_comms or {}

    def _norms(self, p: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        squares = torch.stack([p.square().sum(), g.square().sum()])
        if p in self.shard_comms:
            squares = self.shard_comms[p].all_reduce(squares)
        return squares[0].sqrt(), squares[1].sqrt()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            wd, mom, eta = group["weight_decay"], group["momentum"], group["trust_coefficient"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.ndim > 1:
                    w_norm, g_norm = self._norms(p, g)
                    trust = torch.where(
                        (w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm), 1.0
                    )
                    g = (g + wd * p) * trust
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = g.clone()
                else:
                    state["momentum_buffer"].mul_(mom).add_(g)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


def peak_lr(cfg: OptimConfig, batch_size: int) -> float:
    """The learning rate after warm-up: linearly scaled to the global batch if asked."""
    return cfg.lr * batch_size / cfg.base_batch if cfg.scale_lr else cfg.lr


def build_optimizer(
    cfg: OptimConfig,
    params: Iterable[nn.Parameter],
    batch_size: int,
    shard_comms: dict[nn.Parameter, Communicator] | None = None,
) -> torch.optim.Optimizer:
    lr = peak_lr(cfg, batch_size)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
    return LARS(params, lr, cfg.momentum, cfg.weight_decay, cfg.trust_coefficient, shard_comms)


def build_schedule(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_epochs``, then constant or cosine decay to zero; stepped
    once per optimizer step."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    cosine = cfg.schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if not cosine or total_steps <= warmup:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
