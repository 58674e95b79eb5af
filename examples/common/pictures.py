"""Panels of a segmentation picture: images scaled for display, masks in class colours, laid
out in a titled sheet. Shared by the ``picture.py`` of ``examples/segmentation_large_images``
(input, mask, prediction of a test image) and ``examples/segmentation_volumes`` (the same,
for slices through a test volume)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from parallelkit.data.shapes import class_colour

GAP, TITLE = 8, 20


def arguments(description: str, noun: str, panel: int) -> argparse.Namespace:
    """The command line both ``picture.py`` scripts take: a run folder, which test ``noun``
    (image or volume), the panel size (``panel`` pixels unless told), where to write, and a
    ``parallelkit predict`` output to show instead of running the model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0, help=f"which test {noun}")
    parser.add_argument("--panel", type=int, default=panel, help="pixels per panel side")
    parser.add_argument("--out", type=Path, help="default: RUN_DIR/prediction.png")
    parser.add_argument("--prediction", type=Path, help="a parallelkit predict output folder "
                        "(zarr): show its class map, and its numbers, instead of running the "
                        "model here")  # fmt: skip
    return parser.parse_args()


def colours(labels: torch.Tensor, classes: int) -> torch.Tensor:
    """(H, W) labels -> (H, W, 3) uint8: each class's colour, the background black."""
    palette = torch.cat([torch.zeros(1, 3), class_colour(torch.arange(1, classes), classes)])
    return (palette.float()[labels.clamp(max=classes - 1)] * 255).round().to(torch.uint8)


def display(image: torch.Tensor) -> torch.Tensor:
    """A normalized (C, H, W) image (C = 1 or 3) -> (H, W, 3) uint8, each channel stretched
    from its minimum to its maximum (the model's input is normalized by statistics)."""
    lo = image.amin((1, 2), keepdim=True)
    hi = image.amax((1, 2), keepdim=True)
    x = ((image - lo) / (hi - lo).clamp(min=1e-6)).expand(3, -1, -1)
    return (x.permute(1, 2, 0) * 255).round().to(torch.uint8)


def panel(pixels: torch.Tensor, side: int, nearest: bool) -> Image.Image:
    """(H, W, 3) uint8 -> a PIL image of ``side`` x ``side`` pixels."""
    image = Image.fromarray(pixels.contiguous().numpy())
    return image.resize((side, side), Image.NEAREST if nearest else Image.BILINEAR)


def sheet(rows: list[list[tuple[Image.Image, str]]], side: int) -> Image.Image:
    """Titled panels of ``side`` pixels, row by row, and a line below them for
    :func:`caption`."""
    cols = max(len(r) for r in rows)
    out = Image.new("RGB", (cols * side + (cols - 1) * GAP,
                            len(rows) * (side + TITLE) + (len(rows) - 1) * GAP + TITLE), "white")
    draw = ImageDraw.Draw(out)
    for i, row in enumerate(rows):
        top = i * (side + TITLE + GAP)
        for j, (picture, title) in enumerate(row):
            out.paste(picture, (j * (side + GAP), top + TITLE))
            draw.text((j * (side + GAP) + 4, top + 4), title, fill="black")
    return out


def caption(picture: Image.Image, text: str) -> None:
    """``text`` on the sheet's last line (the measured numbers)."""
    ImageDraw.Draw(picture).text((4, picture.height - TITLE + 4), text, fill="black")


def predicted(folder: Path, name: str) -> torch.Tensor:
    """The class map that ``parallelkit predict`` wrote for sample ``name`` into ``folder``."""
    import zarr

    classes = zarr.open_group(str(folder / f"{name}.zarr"), mode="r")["0"]
    return torch.from_numpy(classes[...]).long()


def split_numbers(folder: Path, noun: str) -> str:
    """The whole split's numbers from ``folder/predict.json``, for a caption."""
    import json

    split = json.loads((folder / "predict.json").read_text())
    return (f"; all {split['samples']} test {noun}s: mIoU {split['mIoU']}, "
            f"{'voxel' if noun == 'volume' else 'pixel'} accuracy {split['pixel accuracy']}")
