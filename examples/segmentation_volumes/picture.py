"""Slices through a test volume of a finished run: the input, its mask and the trained model's
prediction, through the middle of each axis, as one PNG.

    python examples/segmentation_volumes/picture.py runs/segmentation_volumes-8 \
        --out examples/segmentation_volumes/prediction.png

Reads the run directory that ``parallelkit train`` wrote: ``config.yaml`` (model, data: the
zarr store) and ``model.pt`` (the dense weights, the same whichever number of ranks trained
them). The model runs on one process, on the whole test volume read from the store (a small
one: 64^3 in the example); the prediction is what the run's evaluation scored. Rows: the slices
at the middle of D, of H and of W; columns: input, mask, prediction (class colours of the data
set, background black), each scaled to ``--panel`` pixels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from parallelkit.data.blockset import BlockDataset
from parallelkit.data.readers import stem_of
from parallelkit.train.config import load
from parallelkit.train.tasks.segment import Segment
from parallelkit.train.tasks.segmetrics import pixel_counts, scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from pictures import arguments, caption, colours, display, panel, predicted, sheet, split_numbers


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "volume", panel=256)

    cfg = load(str(args.run_dir / "config.yaml"))
    k = cfg.data.num_classes
    data = BlockDataset(cfg.data.source.root, "test", dims=3, crop=None)
    volume, mask = data[args.index]  # the whole test volume
    if args.prediction:  # what parallelkit predict wrote, block by block
        name = stem_of(data.images[args.index].path)
        pred = predicted(args.prediction, name)
    else:
        model = Segment.dense_model(cfg, k, cfg.data.channels)
        model.load_state_dict(torch.load(args.run_dir / "model.pt", weights_only=True))
        with torch.no_grad():
            pred = model.eval()(volume[None])[0].argmax(0)  # (D, H, W)
    score = scores(pixel_counts(pred, mask, k))
    summary = f"accuracy {score['pixel_accuracy']:.1%}, mIoU {score['miou']:.1%}"
    if args.prediction:
        summary += split_numbers(args.prediction, "volume")

    side, rows = args.panel, []
    for axis, name in enumerate("DHW"):
        i = volume.shape[1 + axis] // 2
        image, labels, guess = (t.select(t.dim() - 3 + axis, i) for t in (volume, mask, pred))
        rows.append([
            (panel(display(image), side, nearest=False), f"input, {name} = {i}"),
            (panel(colours(labels, k), side, nearest=True), "mask"),
            (panel(colours(guess, k), side, nearest=True), "prediction"),
        ])  # fmt: skip
    out_path = args.out or args.run_dir / "prediction.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    picture = sheet(rows, side)
    caption(picture, summary)
    picture.save(out_path)
    print(f"wrote {out_path} (test volume {args.index}, {'x'.join(map(str, mask.shape))}: "
          f"voxel {summary})")


if __name__ == "__main__":
    main()
