"""A test image of a finished run, its mask and the trained model's prediction, as one PNG.

    python examples/segmentation_large_images/picture.py runs/segmentation_large_images-1 \
        --out examples/segmentation_large_images/prediction.png

Reads the run directory that ``parallelkit train`` wrote: ``config.yaml`` (model, data) and
``model.pt`` (the dense weights, the same whichever number of ranks trained them). The model
runs on one process, on the whole image; the prediction is what the run's evaluation scored.
Panels, left to right: the input, the mask, the prediction (class colours of the data set,
background black), each scaled to ``--panel`` pixels.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from parallelkit.data import denormalize, load_dataset
from parallelkit.data.shapes import class_colour
from parallelkit.train.config import load
from parallelkit.train.protocol import network
from parallelkit.train.segmetrics import pixel_counts, scores

GAP = 8


def colours(labels: torch.Tensor, classes: int) -> torch.Tensor:
    """(H, W) labels -> (H, W, 3) uint8: each class's colour, the background black."""
    palette = torch.cat([torch.zeros(1, 3), class_colour(torch.arange(1, classes), classes)])
    return (palette.float()[labels.clamp(max=classes - 1)] * 255).round().to(torch.uint8)


def panel(pixels: torch.Tensor, side: int, nearest: bool) -> Image.Image:
    image = Image.fromarray(pixels.numpy())
    return image.resize((side, side), Image.NEAREST if nearest else Image.BILINEAR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0, help="which test image")
    parser.add_argument("--panel", type=int, default=512, help="pixels per panel side")
    parser.add_argument("--out", type=Path, help="default: RUN_DIR/prediction.png")
    args = parser.parse_args()

    cfg = load(str(args.run_dir / "config.yaml"))
    k, w = cfg.data.num_classes, cfg.model.width
    model = network(cfg, k, cfg.data.channels, widths=(w, 2 * w, 4 * w, 8 * w))
    model.load_state_dict(torch.load(args.run_dir / "model.pt", weights_only=True))
    image, mask = load_dataset(cfg.data, "test")[args.index]
    with torch.no_grad():
        out = model.eval()(image[None])
    pred = (out["out"] if isinstance(out, dict) else out)[0].argmax(0)
    score = scores(pixel_counts(pred, mask, k))
    summary = f"pixel accuracy {score['pixel_accuracy']:.1%}, mIoU {score['miou']:.1%}"

    rgb = (denormalize(image).clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8)
    panels = [
        (panel(rgb, args.panel, nearest=False), f"input {image.shape[-1]}x{image.shape[-2]}"),
        (panel(colours(mask, k), args.panel, nearest=True), "mask"),
        (panel(colours(pred, k), args.panel, nearest=True), f"prediction ({summary})"),
    ]
    side = args.panel
    sheet = Image.new("RGB", (3 * side + 2 * GAP, side + 20), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (picture, title) in enumerate(panels):
        sheet.paste(picture, (i * (side + GAP), 20))
        draw.text((i * (side + GAP) + 4, 4), title, fill="black")
    out_path = args.out or args.run_dir / "prediction.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out_path)
    print(f"wrote {out_path} (test image {args.index}: {summary})")


if __name__ == "__main__":
    main()
