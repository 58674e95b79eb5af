"""The two tasks the trainer runs: image classification and GAN training.

A task builds its networks from :mod:`parallelkit.models`, parallelizes them over the grid with
``pk.parallelize`` (the same call for every strategy), owns their optimizers and schedules,
and knows one training step, its evaluation and its checkpoint state. The loop in
:mod:`parallelkit.train.trainer` drives either.

Exactness across rank counts rests on two facts. The loader gives data rank ``r`` of ``D`` the
batch rows ``r, r + D, r + 2D, ...`` of the global batch, so the union of the ranks' batches
(and of their contiguous micro-batches under accumulation) is the 1-process batch. And each
rank's loss is the mean over its rows, which DataParallel averages over equal-sized ranks
into the global mean. GAN noise is drawn for the whole global batch from a generator seeded
by the step, and each rank takes its slice, so the fakes are the same as on one process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image
from torch import nn

import parallelkit as pk
from parallelkit import models
from parallelkit.comm import Communicator
from parallelkit.nn import ChannelParallelConv2d
from parallelkit.nn.channel_transposed import ChannelParallelConvTranspose2d
from parallelkit.parallel import DataParallel, Grid
from parallelkit.train.config import Config
from parallelkit.train.optim import build_optimizer, build_schedule

Losses = dict[str, torch.Tensor]


def unwrap(model: nn.Module) -> nn.Module:
    """The model without its DataParallel wrapper: what checkpoints hold, so that a run may
    resume with another number of data-parallel replicas."""
    return model.module if isinstance(model, DataParallel) else model


def sharded_parameters(model: nn.Module) -> dict[nn.Parameter, Communicator]:
    """Weights split over a channel group, with that group (LARS needs their whole norm)."""
    kinds = ChannelParallelConv2d | ChannelParallelConvTranspose2d
    return {m.weight: m.comm for m in model.modules() if isinstance(m, kinds) and m.comm.size > 1}


def no_sync(model: nn.Module, skip: bool):
    """Accumulate gradients locally (DataParallel.no_sync) when ``skip``."""
    if skip and isinstance(model, DataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


class Task:
    """Shared set-up: parallelize, optimizer and schedule per network."""

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, steps_per_epoch: int):
        self.cfg, self.grid, self.device = cfg, grid, device
        self.steps_per_epoch = steps_per_epoch
        epochs_steps = cfg.train.epochs * steps_per_epoch
        self.total_steps = min(epochs_steps, cfg.train.max_steps or epochs_steps)
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"
        )
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedules: dict[str, torch.optim.lr_scheduler.LRScheduler] = {}
        self.nets: dict[str, nn.Module] = {}

    def add(self, name: str, dense: nn.Module, keep_dense: tuple[str, ...] = ()) -> nn.Module:
        net = pk.parallelize(
            dense.to(self.device),
            self.grid,
            self.grid,
            keep_dense=keep_dense,
            bucket_cap_mb=self.cfg.parallel.bucket_cap_mb,
        )
        opt = build_optimizer(
            self.cfg.optim, net.parameters(), self.cfg.train.batch_size, sharded_parameters(net)
        )
        self.nets[name], self.optimizers[name] = net, opt
        self.schedules[name] = build_schedule(
            self.cfg.optim, opt, self.steps_per_epoch, self.total_steps
        )
        return net

    def update(self, name: str) -> None:
        self.optimizers[name].step()
        self.schedules[name].step()
        self.optimizers[name].zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.nets:
            out[name] = unwrap(self.nets[name]).state_dict()
            out[f"{name}.optimizer"] = self.optimizers[name].state_dict()
            out[f"{name}.schedule"] = self.schedules[name].state_dict()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        for name in self.nets:
            unwrap(self.nets[name]).load_state_dict(state[name])
            self.optimizers[name].load_state_dict(state[f"{name}.optimizer"])
            self.schedules[name].load_state_dict(state[f"{name}.schedule"])

    def dense_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every network in its original form (collective over channel groups)."""
        return {name: pk.to_dense(net).state_dict() for name, net in self.nets.items()}

    def lr(self) -> float:
        return next(iter(self.optimizers.values())).param_groups[0]["lr"]


class Classify(Task):
    """Cross-entropy classification; evaluation reports global loss and accuracy."""

    def __init__(self, cfg, grid, device, steps_per_epoch, channels: int, classes: int):
        super().__init__(cfg, grid, device, steps_per_epoch)
        w, m = cfg.model.width, cfg.model
        dense = models.create(
            m.name,
            num_classes=classes,
            in_channels=channels,
            stem=m.stem,
            widths=(w, 2 * w, 4 * w, 8 * w),
            **m.kwargs,
        )
        self.model = self.add("model", dense)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> Losses:
        acc = self.cfg.train.accumulate
        total = torch.zeros((), device=self.device)
        # Contiguous micro-batches: over the ranks they are the 1-process micro-batches.
        for j, (xm, ym) in enumerate(zip(x.chunk(acc), y.chunk(acc), strict=True)):
            with no_sync(self.model, j < acc - 1), self.autocast:
                loss = F.cross_entropy(self.model(xm), ym) / acc
            loss.backward()
            total += loss.detach()
        self.update("model")
        return {"loss": total}

    @torch.no_grad()
    def evaluate(self, loader) -> dict[str, float]:
        """Loss and accuracy over the whole test split. Each data rank holds different samples
        and every sample is on exactly one rank; the sums are reduced once over the data
        group (not the world: ranks of one model replica saw the same samples)."""
        self.model.eval()
        sums = torch.zeros(3, device=self.device)  # loss sum, correct, count
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                out = self.model(x)
            loss = F.cross_entropy(out.float(), y, reduction="sum")
            correct = (out.argmax(1) == y).sum()
            sums += torch.stack([loss, correct.to(loss.dtype), loss.new_tensor(len(y))])
        self.model.train()
        # On the device: NCCL and XLA reduce device tensors only. Float32 counts are exact
        # up to 2**24 images per evaluation.
        loss, correct, count = self.grid.data_comm.all_reduce(sums).tolist()
        return {
            "loss": loss / max(count, 1),
            "accuracy": correct / max(count, 1),
            "count": int(count),
        }


class Gan(Task):
    """DCGAN (Radford et al.): the discriminator learns real from fake with BCE on logits,
    then the generator learns to make the discriminator say "real"."""

    def __init__(self, cfg, grid, device, steps_per_epoch, channels: int, image_size: int):
        super().__init__(cfg, grid, device, steps_per_epoch)
        m, w = cfg.model, cfg.model.width
        generator = models.create(
            "dcgan_generator", nz=m.nz, ngf=w, nc=channels, image_size=image_size, **m.kwargs
        )
        discriminator = models.create(
            "dcgan_discriminator", ndf=w, nc=channels, image_size=image_size
        )
        spatial = grid.rows * grid.cols > 1
        self.generator = self.add("generator", generator)
        # The 4x4 -> 1x1 head runs on the whole image (see parallelkit.models.dcgan).
        self.discriminator = self.add(
            "discriminator", discriminator, keep_dense=("head",) if spatial else ()
        )
        gen = torch.Generator().manual_seed(cfg.train.seed + 1)
        self.fixed_noise = torch.randn(64, m.nz, 1, 1, generator=gen).to(device)

    def noise(self, step: int, n_local: int) -> torch.Tensor:
        """This rank's rows of the global batch's noise for ``step``."""
        batch = self.cfg.train.batch_size
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step)
        z = torch.randn(batch, self.cfg.model.nz, 1, 1, generator=gen)
        start = self.grid.data_comm.rank * n_local
        return z[start : start + n_local].to(self.device)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> Losses:
        g, d = self.generator, self.discriminator
        with self.autocast:
            fake = g(self.noise(step, len(x)))
            real_logits, fake_logits = d(x), d(fake.detach())
            loss_d = F.binary_cross_entropy_with_logits(
                real_logits.float(), torch.ones_like(real_logits, dtype=torch.float)
            ) + F.binary_cross_entropy_with_logits(
                fake_logits.float(), torch.zeros_like(fake_logits, dtype=torch.float)
            )
        loss_d.backward()
        self.update("discriminator")
        d.requires_grad_(False)  # the generator's step needs no discriminator gradients
        with self.autocast:
            logits = d(fake)
            loss_g = F.binary_cross_entropy_with_logits(
                logits.float(), torch.ones_like(logits, dtype=torch.float)
            )
        loss_g.backward()
        d.requires_grad_(True)
        self.update("generator")
        return {"loss_d": loss_d.detach(), "loss_g": loss_g.detach()}

    @torch.no_grad()
    def samples(self, path: Path | None) -> None:
        """The generator's images for the fixed noise, as an 8x8 PNG grid (collective over
        the model group; rank 0 writes)."""
        self.generator.eval()
        images = self.generator(self.fixed_noise).float().cpu()
        self.generator.train()
        if path is None:
            return
        grid = rearrange((images.clamp(-1, 1) + 1) * 127.5, "(r c) ch h w -> (r h) (c w) ch", r=8)
        pixels = grid.round().to(torch.uint8).numpy()
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(path)
