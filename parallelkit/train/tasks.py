"""The tasks ``parallelkit train`` runs: classification, GAN training and segmentation.

Each is one class of the protocol in :mod:`parallelkit.train.protocol`, registered in
:data:`TASKS` under its ``train.task`` name; the loop in :mod:`parallelkit.train.trainer`
builds the configured one with :func:`create` and never asks which it is. Segmentation lives
in :mod:`parallelkit.train.segment`. Each class also carries its name, the config defaults
that follow it and its config checks, which :mod:`parallelkit.train.config` reads.

Exactness across rank counts rests on two facts. The loader gives data rank ``r`` of ``D`` the
batch rows ``r, r + D, r + 2D, ...`` of the global batch, so the union of the ranks' batches
(and of their contiguous micro-batches under accumulation) is the 1-process batch. And each
rank's loss is the mean over its rows, which DataParallel averages over equal-sized ranks
into the global mean. GAN noise is drawn for the whole global batch from a generator seeded
by the step, and each rank takes its slice, so the fakes are the same as on one process.
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
from parallelkit.train.protocol import Losses, Metrics, Task, network, no_sync
from parallelkit.train.rundir import record
from parallelkit.train.schema import Config
from parallelkit.train.segment import Segment


class Classify(Task):
    """Cross-entropy classification; evaluation reports global loss and accuracy."""

    name = "classify"
    defaults: ClassVar[dict[str, Any]] = {
        "model.name": "resnet18", "model.width": 64,
        "data.name": "digits", "data.num_classes": 10, "data.image_size": 32,
    }  # fmt: skip
    networks = ("resnet18", "resnet34", "resnet50")
    trains = "resnet18/34/50, torchvision:NAME or timm:NAME"

    @classmethod
    def dense_networks(cls, cfg: Config, train: Loader) -> dict[str, nn.Module]:
        w = cfg.model.width
        dense = network(
            cfg, train.num_classes, train.channels, stem=cfg.model.stem,
            widths=(w, 2 * w, 4 * w, 8 * w),
        )  # fmt: skip
        return {"model": dense}

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, train: Loader) -> None:
        super().__init__(cfg, grid, device, train)
        self.model = self.add("model", self.dense_networks(cfg, train)["model"])

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
    def evaluate(self, loader: Loader) -> Metrics:
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

    def report(self, evals: Metrics) -> str:
        return (
            f"test loss {evals['loss']:.4f}, accuracy {100 * evals['accuracy']:.2f}% "
            f"({evals['count']} images)"
        )

    def headline(self, evals: Metrics) -> dict[str, float]:
        return {"test_acc": evals["accuracy"]} if evals else {}

    def summary(self, evals: Metrics) -> list[tuple[str, str]]:
        if not evals:
            return []
        return [
            ("test loss", f"{evals['loss']:.4f}"),
            ("test accuracy", f"{100 * evals['accuracy']:.2f}%"),
        ]


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


TASKS: dict[str, type[Task]] = {t.name: t for t in (Classify, Gan, Segment)}
"""``train.task`` -> its class; a new task is one more class here."""


def create(cfg: Config, grid: Grid, device: torch.device, train: Loader) -> Task:
    """The configured task, its networks built and parallelized over ``grid``."""
    return TASKS[cfg.train.task](cfg, grid, device, train)
