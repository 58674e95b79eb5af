"""``parallelkit data shard SRC OUT``: write a dataset as WebDataset tar shards.

    parallelkit data shard digits shards/digits --samples-per-shard 256
    parallelkit data shard cifar10:~/data/cifar-10-batches-py shards/cifar --samples-per-shard 5000
    parallelkit data shard ~/data/flowers shards/flowers --samples-per-shard 1000 --image-size 128
    python -m parallelkit.data.shard synthetic shards/syn --samples-per-shard 64 --image-size 512
    parallelkit data shard shapes shards/shapes --samples-per-shard 256 --image-size 128
    parallelkit data shard segfolder:~/data/cells shards/cells --samples-per-shard 100 \
        --num-classes 3 --image-size 256

Then train on them with ``data.name=webdataset data.root=OUT``. Images are written at
``--image-size`` with ``--channels``, so the loader decodes them without resizing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallelkit.data.config import SPLITS, DataConfig
from parallelkit.data.datasets import load_dataset
from parallelkit.data.shardio import ENCODINGS, write_shards

SOURCES = """\
SRC names the dataset to shard:
  digits             scikit-learn's digits (bundled, no download)
  synthetic          random images; sizes from --train-samples/--test-samples/--num-classes
  shapes             generated segmentation scenes with masks; the same size options
  segfolder:DIR      DIR/train/images/* with DIR/train/masks/<name>.png, DIR/test (or val);
                     --num-classes is the class count every mask is checked against
  cifar10:DIR        the python-batch CIFAR-10 directory DIR (cifar-10-batches-py)
  imagefolder:DIR    DIR/train/<class>/*.png|jpg and DIR/test (or DIR/val)
  DIR                an existing directory: the same as imagefolder:DIR

OUT receives train-000000.tar ..., test-000000.tar ... and manifest.json (samples per shard).
Samples are written in a seeded random order (--shuffle-seed) so that shards mix classes.
Masks are written as <key>.mask.png beside each image (train with train.task=segment).
"""


def source_config(src: str, args: argparse.Namespace) -> DataConfig:
    """The :class:`DataConfig` that SRC (see ``--help``) and the size options describe."""
    cfg = DataConfig(image_size=args.image_size, channels=args.channels)
    kind, sep, root = src.partition(":")
    classes = args.num_classes
    if kind in ("digits", "synthetic", "shapes") and not sep:
        cfg.name = kind
        cfg.train_samples, cfg.test_samples = args.train_samples, args.test_samples
        cfg.num_classes = classes or (4 if kind == "shapes" else 10)
    elif kind in ("cifar10", "imagefolder", "segfolder") and sep and root:
        cfg.name, cfg.root = kind, str(Path(root).expanduser())
        if kind == "segfolder":
            if classes is None:
                raise ValueError("segfolder:DIR needs --num-classes, the masks' class count")
            cfg.num_classes = classes
    elif Path(src).expanduser().is_dir():
        cfg.name, cfg.root = "imagefolder", str(Path(src).expanduser())
    else:
        raise ValueError(
            f"SRC {src!r} is not digits, synthetic, shapes, cifar10:DIR, imagefolder:DIR, "
            "segfolder:DIR or an existing directory"
        )
    return cfg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallelkit data shard",
        description="Write a dataset as WebDataset tar shards with a manifest.",
        epilog=SOURCES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="dataset to shard (see below)")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--samples-per-shard", type=int, required=True, metavar="N")
    p.add_argument("--image-size", type=int, default=32, metavar="S", help="default 32")
    p.add_argument("--channels", type=int, default=3, choices=(1, 3), help="default 3")
    p.add_argument(
        "--encoding",
        choices=ENCODINGS,
        help="png: 8-bit, small (default); npy: exact float32 (default for synthetic)",
    )
    p.add_argument(
        "--splits", default=",".join(SPLITS), help="comma-separated (default train,test)"
    )
    p.add_argument("--train-samples", type=int, default=1024, help="synthetic, shapes")
    p.add_argument("--test-samples", type=int, default=256, help="synthetic, shapes")
    p.add_argument(
        "--num-classes", type=int, help="synthetic (default 10), shapes (4), segfolder (needed)"
    )
    p.add_argument("--shuffle-seed", type=int, default=0, help="order samples are written in")
    p.add_argument(
        "--no-shuffle", action="store_true", help="write samples in dataset order instead"
    )
    return p


def shard_main(argv: list[str] | None = None) -> int:
    """Run ``parallelkit data shard`` with ``argv`` (the arguments after ``data shard``).

    Returns the exit status: 0 on success, 1 after printing what is wrong with the data,
    2 for bad arguments (argparse).
    """
    args = parser().parse_args(argv)
    try:
        cfg = source_config(args.src, args)
        splits = [s.strip() for s in args.splits.split(",") if s.strip()]
        unknown = [s for s in splits if s not in SPLITS]
        if unknown or not splits:
            raise ValueError(f"--splits {args.splits!r}: choose from {', '.join(SPLITS)}")
        encoding = args.encoding or ("npy" if cfg.name == "synthetic" else "png")
        for split in splits:
            dataset = load_dataset(cfg, split)
            files = write_shards(
                dataset,
                args.out,
                args.samples_per_shard,
                split,
                encoding=encoding,
                shuffle_seed=None if args.no_shuffle else args.shuffle_seed,
            )
            print(
                f"{split}: {len(dataset)} samples ({cfg.channels}x{cfg.image_size}x"
                f"{cfg.image_size}, {encoding}) in {len(files)} shards: "
                f"{Path(files[0]).name} .. {Path(files[-1]).name}"
            )
    except ValueError as err:
        print(f"parallelkit data shard: error: {err}", file=sys.stderr)
        return 1
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(shard_main())
