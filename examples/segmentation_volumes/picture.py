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

import argparse
import sys
from pathlib import Path

import torch

from parallelkit.data.loader import block_dataset
from parallelkit.train.config import load
from parallelkit.train.protocol import network
from parallelkit.train.segmetrics import pixel_counts, scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from pictures import colours, display, panel, sheet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0, help="which test volume")
    parser.add_argument("--panel", type=int, default=256, help="pixels per panel side")
    parser.add_argument("--out", type=Path, help="default: RUN_DIR/prediction.png")
    args = parser.parse_args()

    cfg = load(str(args.run_dir / "config.yaml"))
    k = cfg.data.num_classes
    model = network(cfg, k, cfg.data.channels)
    model.load_state_dict(torch.load(args.run_dir / "model.pt", weights_only=True))
    volume, mask = block_dataset(cfg.data, "test", block=None, seed=cfg.train.seed)[args.index]
    with torch.no_grad():
        pred = model.eval()(volume[None])[0].argmax(0)  # (D, H, W)
    score = scores(pixel_counts(pred, mask, k))
    summary = f"accuracy {score['pixel_accuracy']:.1%}, mIoU {score['miou']:.1%}"

    side, rows = args.panel, []
    for axis, name in enumerate("DHW"):
        i = volume.shape[1 + axis] // 2
        image, labels, guess = (t.select(t.dim() - 3 + axis, i) for t in (volume, mask, pred))
        rows.append([
            (panel(display(image), side, nearest=False), f"input, {name} = {i}"),
            (panel(colours(labels, k), side, nearest=True), "mask"),
            (panel(colours(guess, k), side, nearest=True), "prediction"),
        ])  # fmt: skip
    rows[0][2] = (rows[0][2][0], f"prediction: {summary}")
    out_path = args.out or args.run_dir / "prediction.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sheet(rows, side).save(out_path)
    print(f"wrote {out_path} (test volume {args.index}, {'x'.join(map(str, mask.shape))}: "
          f"voxel {summary})")


if __name__ == "__main__":
    main()
