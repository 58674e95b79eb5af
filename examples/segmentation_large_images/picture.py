"""A test image of a finished run, its mask and the trained model's prediction, as one PNG.

    python examples/segmentation_large_images/picture.py runs/segmentation_large_images-1 \
        --out examples/segmentation_large_images/prediction.png

Reads the run directory that ``parallelkit train`` wrote: ``config.yaml`` (model, data: the
zarr store) and ``model.pt`` (the dense weights, the same whichever number of ranks trained
them). The model runs on one process, on the whole image read from the store; the prediction is
what the run's evaluation scored.
Panels, left to right: the input, the mask, the prediction (class colours of the data set,
background black), each scaled to ``--panel`` pixels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from parallelkit.data import load_dataset
from parallelkit.data.blockset import BlockDataset
from parallelkit.data.readers import stem_of
from parallelkit.train.config import load
from parallelkit.train.tasks.segment import Segment
from parallelkit.train.tasks.segmetrics import pixel_counts, scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from pictures import arguments, caption, colours, display, panel, predicted, sheet, split_numbers


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "image", panel=512)

    cfg = load(str(args.run_dir / "config.yaml"))
    k = cfg.data.num_classes
    # The whole test image, on one process: a store's (data.name=zarr:DIR) or a generated one.
    if cfg.data.source.is_block_folder:
        data = BlockDataset(cfg.data.source.root, "test", dims=2, crop=None)
        name = stem_of(data.images[args.index].path)
    else:
        data, name = load_dataset(cfg.data, "test"), None
    image, mask = data[args.index]
    if args.prediction:  # what parallelkit predict wrote, block by block
        pred = predicted(args.prediction, name)
    else:
        model = Segment.dense_model(cfg, k, cfg.data.channels)
        model.load_state_dict(torch.load(args.run_dir / "model.pt", weights_only=True))
        with torch.no_grad():
            out = model.eval()(image[None])
        pred = (out["out"] if isinstance(out, dict) else out)[0].argmax(0)
    score = scores(pixel_counts(pred, mask, k))
    summary = f"pixel accuracy {score['pixel_accuracy']:.1%}, mIoU {score['miou']:.1%}"
    if args.prediction:
        summary += split_numbers(args.prediction, "image")

    side = args.panel
    picture = sheet([[
        (panel(display(image), side, nearest=False), f"input {image.shape[-1]}x{image.shape[-2]}"),
        (panel(colours(mask, k), side, nearest=True), "mask"),
        (panel(colours(pred, k), side, nearest=True), "prediction"),
    ]], side)  # fmt: skip
    caption(picture, summary)
    out_path = args.out or args.run_dir / "prediction.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(out_path)
    print(f"wrote {out_path} (test image {args.index}: {summary})")


if __name__ == "__main__":
    main()
