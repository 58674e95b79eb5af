"""GAN training: DCGAN's generator and discriminator, each parallelized over the grid.

GAN noise is drawn for the whole global batch from a generator seeded by the step, and each
rank takes its slice, so the fakes are the same as on one process (the batch rows follow
:mod:`parallelkit.train.tasks.classify`'s rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image
from torch import nn

from parallelkit import models
from parallelkit.data import Loader
from parallelkit.parallel import Grid
from parallelkit.train.schema import Config
from parallelkit.train.store.rundir import record
from parallelkit.train.tasks.protocol import Losses, Task


class Gan(Task):
    """DCGAN (Radford et al.): the discriminator learns real from fake with BCE on logits,
    then the generator learns to make the discriminator say "real". No evaluation; an 8x8
    grid of samples from fixed noise after every epoch."""

    name = "gan"
    defaults: ClassVar[dict[str, Any]] = {
        "model.name": "dcgan", "model.width": 64,
        "data.name": "digits", "data.num_classes": 10, "data.image_size": 32,
    }  # fmt: skip
    networks = ("dcgan",)
    trains = "dcgan (a generator and its mirror discriminator)"

    @classmethod
    def check(cls, cfg: Config) -> None:
        if cfg.model.name != "dcgan":
            raise ValueError(
                f"config: train.task=gan with model.name={cfg.model.name}; the GAN task trains "
                "model.name=dcgan"
            )
        if cfg.train.accumulate > 1:
            raise ValueError("config: train.accumulate > 1 is for train.task=classify or segment")
        if cfg.train.precise_bn:
            raise ValueError("config: train.precise_bn is for train.task=classify or segment")

    @classmethod
    def dense_networks(cls, cfg: Config, train: Loader) -> dict[str, nn.Module]:
        m, w = cfg.model, cfg.model.width
        channels, size = train.channels, train.image_size
        generator = models.create(
            "dcgan_generator", nz=m.nz, ngf=w, nc=channels, image_size=size, **m.kwargs
        )
        discriminator = models.create("dcgan_discriminator", ndf=w, nc=channels, image_size=size)
        return {"generator": generator, "discriminator": discriminator}

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, train: Loader) -> None:
        super().__init__(cfg, grid, device, train)
        m = cfg.model
        dense = self.dense_networks(cfg, train)
        generator, discriminator = dense["generator"], dense["discriminator"]
        spatial = grid.dims.spatial_size > 1
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

    def end_epoch(self, epoch: int, run_dir: Path | None) -> None:
        path = run_dir / "samples" / f"epoch-{epoch + 1:03d}.png" if run_dir else None
        self.samples(path)
        if run_dir is not None:
            record(run_dir, path)

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
