"""Semantic segmentation: cross-entropy or Dice loss, mIoU, mDice, pixel accuracy, on blocks.

Images (N, C, H, W) with masks (N, H, W), or volumes (N, C, D, H, W) with masks (N, D, H, W)
(``data.name=shapes3d`` or ``segfolder3d``, a 3-D network such as ``model.name=monai:UNet``):
every sum below runs over a volume's voxels as over an image's pixels.

Why blocks: spatial parallelism splits an image because one device cannot hold its
activations, and the full-resolution logits are the largest of them. So the network is
parallelized with ``spatial_output="blocks"``: each rank gets its block of the logits, in the
layout ``pk.spatial.scatter`` cuts, and its loader gives it the same block of each mask
(``build_loader(block=...)``). Nothing gathers the logits, so the memory saving holds to the
loss. Under data and channel strategies the output is whole and the block is the image:
one code path serves every strategy.

The loss of a step, exactly the 1-process mean over every labelled pixel of the global batch::

    part_r  = sum of per-pixel cross-entropy over this rank's block      (N_local, h, w)
    n       = labelled pixels of the global (micro-)batch: one all-reduce of counts over the
              batch group (data x spatial), made before the forward
    loss_r  = reduce_from_group(part_r, spatial) * D / n                 D: data ranks

``reduce_from_group`` sums over the spatial group (its backward is the identity: each block's
logits get their own gradient), and DataParallel's mean over the D data ranks turns ``D / n``
into ``1 / n``. ``train.loss=dice`` replaces it by the soft Dice loss of the global batch, and
``dice_ce`` adds the two (MONAI's ``DiceCELoss``): Dice is a ratio of sums, so its counts are
summed over the batch group before the ratio (:mod:`~parallelkit.train.tasks.losses`).
Evaluation sums pixel counts (:mod:`parallelkit.train.tasks.segmetrics`) over the same group
once, after the loop.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit.data import Loader
from parallelkit.data.blockset import BlockDataset
from parallelkit.data.segfolder import IGNORE
from parallelkit.inference import Predictor
from parallelkit.models import imported
from parallelkit.parallel import Grid
from parallelkit.train.schema import Config
from parallelkit.train.tasks.losses import dice_loss
from parallelkit.train.tasks.protocol import Losses, Metrics, Task, network, no_sync
from parallelkit.train.tasks.segmetrics import pixel_counts, score_block, scores


class Segment(Task):
    """Per-pixel classification into the data set's classes (mask value 255: ignored)."""

    name = "segment"
    defaults: ClassVar[dict[str, Any]] = {
        "model.name": "unet", "model.width": 16,
        "data.name": "shapes", "data.num_classes": 4, "data.image_size": 32,
    }  # fmt: skip
    networks = ("unet",)
    trains = "unet, smp:ARCH, monai:NAME or a torchvision segmentation model"
    masks = True

    @classmethod
    def dense_networks(cls, cfg: Config, train: Loader) -> dict[str, nn.Module]:
        if not train.masks:
            raise ValueError(
                f"train.task=segment: data.name={cfg.data.name} ({cfg.data.root}) holds labels, "
                "not masks; write shards from a data set with masks (shapes, segfolder:DIR)"
            )
        return {"model": cls.dense_model(cfg, train.num_classes, train.channels)}

    @staticmethod
    def dense_model(cfg: Config, classes: int, channels: int) -> nn.Module:
        """The configured network, untrained: what training and ``parallelkit predict`` build."""
        w = cfg.model.width
        return network(cfg, classes, channels, widths=(w, 2 * w, 4 * w, 8 * w))

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, train: Loader) -> None:
        super().__init__(cfg, grid, device, train)
        self.classes = train.num_classes
        dense = self.dense_networks(cfg, train)["model"]
        blocks_in = {}
        if train.blocks:  # data.name=FORMAT:DIR: every rank reads only its block of a sample
            size = train.shape
            blocks_in = {"spatial_input": "blocks", "spatial_size": size}
        self.model = self.add("model", dense, spatial_output="blocks", **blocks_in)

    def logits(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This rank's block of the logits, checked against its block of the mask (images:
        (N, classes, H, W) against (N, H, W); volumes: (N, classes, D, H, W) against
        (N, D, H, W))."""
        out = self.model(x)
        if isinstance(out, dict):  # torchvision's segmentation models: {"out", "aux"}
            out = out["out"]
        if (
            out.dim() != mask.dim() + 1
            or out.shape[0] != mask.shape[0]
            or out.shape[2:] != mask.shape[1:]
        ):
            layout = "(N, classes, D, H, W)" if mask.dim() == 4 else "(N, classes, H, W)"
            raise ValueError(
                f"train.task=segment: {self.cfg.model.name} returned {tuple(out.shape)}, but "
                f"this rank's masks are {tuple(mask.shape)}: the model must return per-pixel "
                f"logits {layout} at the input's resolution"
            )
        return out

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> Losses:
        acc = self.cfg.train.accumulate
        xs, ys = x.chunk(acc), y.chunk(acc)
        labelled = torch.stack([(m != IGNORE).sum() for m in ys]).float()
        labelled = self.grid.batch_comm.all_reduce(labelled).clamp(min=1)
        total = torch.zeros((), device=self.device)
        # Contiguous micro-batches: over the ranks they are the 1-process micro-batches.
        for j, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            with no_sync(self.model, j < acc - 1), self.autocast:
                logits = self.logits(xm, ym)
            loss, shown = self.loss(logits.float(), ym, labelled[j])
            (loss / acc).backward()
            total += shown.detach() / acc
        self.update("model")
        return {"loss": total}

    def loss(
        self, logits: torch.Tensor, mask: torch.Tensor, labelled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(what this rank backpropagates, what it reports)`` for one micro-batch, as
        ``train.loss`` says; ``labelled``: the micro-batch's labelled pixels, all ranks'.

        Both terms are scaled for DataParallel's mean over the D data ranks (module
        docstring): cross-entropy reports and backpropagates its share ``* D / n``; Dice is the
        whole batch's on every rank, so it reports ``dice`` and backpropagates ``D * dice``. A
        loss of the user's (``train.loss=package.module:fn``, ``fn(logits, mask)``, e.g. a
        mean over pixels) sees this rank's whole logits and its images' masks, as under DDP.
        """
        d, kind = self.grid.data, self.cfg.train.loss
        if imported.is_import_path(kind):  # the user's: whole logits (config checks), its mean
            loss = imported.load(kind, "train.loss")(logits, mask)  # DataParallel averages
            return loss, loss
        loss = shown = logits.new_zeros(())
        if kind in ("ce", "dice_ce"):
            part = F.cross_entropy(logits, mask, ignore_index=IGNORE, reduction="sum")
            loss = shown = pkf.reduce_from_group(part, self.grid.spatial_comm) * d / labelled
        if kind in ("dice", "dice_ce"):
            dice = dice_loss(logits, mask, self.grid.batch_comm)
            loss, shown = loss + d * dice, shown + dice
        return loss, shown

    @torch.no_grad()
    def evaluate(self, loader: Loader) -> Metrics:
        """Loss (cross-entropy, whatever ``train.loss`` is), mIoU, mDice and pixel accuracy
        over the whole test split: each rank sums the loss and the pixel counts of its blocks,
        and one all-reduce over the batch group (data x spatial; channel ranks hold the same
        whole output) adds them. Data read by blocks (``FORMAT:DIR``) are scored on whole
        samples, each at its own size (:meth:`evaluate_whole`)."""
        if isinstance(loader.dataloader.dataset, BlockDataset):
            return self.evaluate_whole(loader.dataloader.dataset)
        self.model.eval()
        k = self.classes
        sums = torch.zeros(3 + 3 * k, dtype=torch.float64, device=self.device)
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                logits = self.logits(x, y)
            loss = F.cross_entropy(logits.float(), y, ignore_index=IGNORE, reduction="sum")
            counts = pixel_counts(logits.argmax(1), y, k)
            head = torch.stack([loss.double(), (y != IGNORE).sum().double()])
            sums += torch.cat([head, sums.new_tensor([len(y)]), counts.flatten()])
        self.model.train()
        sums = self.grid.batch_comm.all_reduce(sums).cpu()
        loss, pixels, images = sums[:3].tolist()
        spatial = self.grid.dims.spatial_size  # each sample was counted by every block
        return {
            "loss": loss / max(pixels, 1),
            **scores(sums[3:].view(3, k)),
            "pixels": int(pixels),
            "count": int(images) // spatial,
        }

    @torch.no_grad()
    def evaluate_whole(self, data: BlockDataset) -> Metrics:
        """The test metrics on whole samples, as ``parallelkit predict`` computes them
        (:class:`parallelkit.inference.Predictor`): data rank ``d`` of ``D`` takes samples
        ``d, d + D, ...``, its spatial group splits each one, and each rank counts its block
        (eval mode: BatchNorm's running statistics)."""
        g = self.grid
        spatial = Grid(g.spatial_comm, depth=g.depth, rows=g.rows, cols=g.cols)
        predictor = Predictor(pk.to_dense(self.nets["model"]), spatial, data.normalizer)
        k = self.classes
        counts = torch.zeros(3, k, dtype=torch.float64)
        loss, samples = 0.0, 0
        for i in range(g.coords[0], len(data), g.data):
            result = predictor(data.images[i])
            more, part = score_block(result.logits, data.masks[i], result.block)
            counts, loss, samples = counts + more, loss + part, samples + 1
        head = torch.tensor([loss, counts[2].sum().item(), samples], dtype=torch.float64)
        sums = g.batch_comm.all_reduce(torch.cat([head, counts.flatten()]).to(self.device)).cpu()
        loss, pixels, images = sums[:3].tolist()
        return {
            "loss": loss / max(pixels, 1),
            **scores(sums[3:].view(3, k)),
            "pixels": int(pixels),
            "count": int(images) // g.dims.spatial_size,
        }

    def report(self, evals: Metrics) -> str:
        return (
            f"test loss {evals['loss']:.4f}, mIoU {100 * evals['miou']:.2f}%, mDice "
            f"{100 * evals['mdice']:.2f}%, pixel accuracy {100 * evals['pixel_accuracy']:.2f}% "
            f"({evals['count']} images)"
        )

    def headline(self, evals: Metrics) -> dict[str, float]:
        return {"mIoU": evals["miou"]} if evals else {}

    def summary(self, evals: Metrics) -> list[tuple[str, str]]:
        if not evals:
            return []
        present = f" ({evals['classes_present']} of {self.classes} classes present)"
        return [
            ("test loss", f"{evals['loss']:.4f}"),
            ("test mIoU", f"{100 * evals['miou']:.2f}%" + present),
            ("test mDice", f"{100 * evals['mdice']:.2f}%"),
            ("test pixel accuracy", f"{100 * evals['pixel_accuracy']:.2f}%"),
        ]
