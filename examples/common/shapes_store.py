"""Generated shapes written to disk as zarr arrays, in the folder layout that the block readers
read (``data.name=zarr:DIR``, :mod:`parallelkit.data.blockset`), so that a training run or a
measurement reads each rank's block of every image and mask from disk and no rank ever holds a
whole sample.

    python examples/common/shapes_store.py runs/data/shapes-1024 --dims 2 --side 1024 \
        --train 48 --test 4                                  # images: 3 x 1024 x 1024
    python examples/common/shapes_store.py runs/data/volumes-128 --dims 3 --side 128 \
        --train 16 --test 2 --classes 3 --channels 1         # volumes: 128^3

    DIR/train/images/s0000.zarr   (C, H, W) or (D, H, W) uint8, chunked
    DIR/train/masks/s0000.zarr    (H, W) or (D, H, W) uint8 labels, 0 the background
    DIR/test/...                  the same (base 1000: other scenes)
    DIR/channel_stats.json        the training images' per-channel mean and std, computed
                                  once here (streaming) so that no rank has to

Images are the scenes of ``data.name=shapes`` (:mod:`parallelkit.data.shapes`: the same pixels,
drawn in bands of rows), quantized to uint8 as a camera or a scanner stores them. Volumes are
the scenes of ``data.name=shapes3d`` (:mod:`parallelkit.data.shapes3d`: its spheres, boxes and
masks, one channel), drawn slab by slab along depth, with voxel noise seeded per depth slice
(``shapes3d`` draws its noise for the whole cube at once, which a large cube cannot afford).
Nothing here holds more than one band or slab of a sample, so it writes samples of any size.

Shared by ``examples/segmentation_large_images`` and ``examples/segmentation_volumes`` (their
``measure.py`` writes one such store per side it measures).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import zarr

from parallelkit.data import shapes, shapes3d
from parallelkit.data.blockset import STATS_FILE, cached_stats
from parallelkit.data.pixels import LUMA, denormalize
from parallelkit.data.readers import SampleReader

SLAB_VOXELS = 1 << 22
"""Voxels (pixels) of one slab drawn at a time: its float64 temporaries stay near 32 MiB."""
CHUNK = {2: (256, 256), 3: (32, 64, 64)}
"""Spatial chunk shape of the zarr arrays (a rank decodes only the chunks its block touches)."""


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Normalized values (about [-1, 1]) -> uint8 pixels."""
    return (denormalize(x).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def image_slab(scene: dict, side: int, rows: slice, classes: int, channels: int):
    """Rows ``rows`` of a ``shapes`` image: ``(C, h, side)`` uint8 and ``(h, side)`` labels."""
    window = (rows, slice(0, side))
    image = shapes.draw_image(scene, side, window, classes, channels)
    return to_uint8(image), shapes.draw_mask(scene, side, window).to(torch.uint8).numpy()


def one_shape(scene: dict, i: int) -> dict:
    """The scene with only its shape ``i`` (to draw where that shape lies)."""
    return {**scene, **{k: scene[k][i : i + 1] for k in ("classes", "centre", "size", "jitter")}}


def volume_slab(scene: dict, side: int, depth: slice, classes: int, channels: int = 1):
    """Depth slices ``depth`` of a ``shapes3d`` volume: ``(d, side, side)`` uint8 (one
    channel, the luma) or ``(3, d, side, side)`` (the class colours), and labels. The
    background ramp, the shapes and their colours are shapes3d's, the noise is drawn per depth
    slice (and channel)."""
    if channels not in (1, 3):
        raise ValueError("shapes_store: volumes are written with 1 or 3 channels")
    whole = slice(0, side)
    axes = [(torch.arange(s.start, s.stop, dtype=torch.float64) + 0.5) / side
            for s in (depth, whole, whole)]  # fmt: skip
    z, y, x = torch.meshgrid(*axes, indexing="ij")
    a, b, c = scene["direction"].tolist()
    ramp = ((a * z + b * y + c * x) / (abs(a) + abs(b) + abs(c) + 1e-9) + 0.5).clamp(0, 1)
    low, high = scene["background"].tolist()
    value = (low + (high - low) * ramp).expand(channels, *ramp.shape)
    del z, y, x, ramp
    weights = torch.tensor(LUMA, dtype=torch.float64)[None] if channels == 1 else torch.eye(3)
    for i, label in enumerate(scene["classes"].tolist()):
        colour = shapes.class_colour(torch.tensor(label), classes) + float(scene["jitter"][i])
        inside = shapes3d.draw_mask(one_shape(scene, i), side, (depth, whole, whole)) > 0
        value = torch.where(inside, (weights.double() @ colour)[:, None, None, None], value)
    noise = torch.empty(value.shape, dtype=torch.float32)
    seed = int(scene["noise_seed"])
    for k, zi in enumerate(range(depth.start, depth.stop)):
        for ch in range(channels):  # one channel: the seeds of earlier stores
            g = torch.Generator().manual_seed(seed * 100_003 + zi + ch * 1_000_003)
            noise[ch, k] = torch.randn((side, side), generator=g)
    value = (value.float() + 0.05 * noise).clamp(0, 1)
    mask = shapes3d.draw_mask(scene, side, (depth, whole, whole))
    pixels = (value * 255).round().to(torch.uint8).numpy()
    return pixels[0] if channels == 1 else pixels, mask.to(torch.uint8).numpy()


def write_sample(root: Path, name: str, dims: int, side: int, scene: dict, classes: int,
                 channels: int) -> None:
    """One image (or volume) and its mask as zarr arrays, written slab by slab."""
    spatial = (side,) * dims
    chunks = tuple(min(c, side) for c in CHUNK[dims])
    lead = (channels,) if channels > 1 else ()
    image = zarr.create_array(root / "images" / f"{name}.zarr", shape=lead + spatial,
                              chunks=lead + chunks, dtype="u1", overwrite=True)  # fmt: skip
    mask = zarr.create_array(root / "masks" / f"{name}.zarr", shape=spatial, chunks=chunks,
                             dtype="u1", overwrite=True)  # fmt: skip
    rows = max(1, min(side, SLAB_VOXELS // side ** (dims - 1)))
    rows = max(chunks[0], rows // chunks[0] * chunks[0])  # whole chunks per write
    for r0 in range(0, side, rows):
        slab = slice(r0, min(side, r0 + rows))
        if dims == 2:
            pixels, labels = image_slab(scene, side, slab, classes, channels)
        else:
            pixels, labels = volume_slab(scene, side, slab, classes, channels)
        if lead:
            image[:, slab] = pixels
        else:
            image[slab] = pixels.reshape(labels.shape)
        mask[slab] = labels


def write_mosaic(root: Path, name: str, side: int, scenes: list[dict], tiles: int,
                 classes: int, channels: int) -> None:
    """One image of ``tiles x tiles`` scenes, each drawn at ``side`` (so its shapes have the
    pixel sizes of a ``side`` image's), and its mask, as zarr arrays written tile by tile."""
    whole, chunks = tiles * side, tuple(min(c, side) for c in CHUNK[2])
    image = zarr.create_array(root / "images" / f"{name}.zarr", shape=(channels, whole, whole),
                              chunks=(channels, *chunks), dtype="u1", overwrite=True)
    mask = zarr.create_array(root / "masks" / f"{name}.zarr", shape=(whole, whole),
                             chunks=chunks, dtype="u1", overwrite=True)  # fmt: skip
    for k, scene in enumerate(scenes):
        rows = slice(k // tiles * side, (k // tiles + 1) * side)
        cols = slice(k % tiles * side, (k % tiles + 1) * side)
        pixels, labels = image_slab(scene, side, slice(0, side), classes, channels)
        image[:, rows, cols] = pixels
        mask[rows, cols] = labels


def write_store(root: str | Path, dims: int, side: int, train: int = 1, test: int = 0,
                classes: int | None = None, channels: int | None = None,
                test_tiles: int = 1) -> Path:
    """``train`` and ``test`` generated samples of ``side`` (a square image for ``dims`` 2, a
    cube for 3) under ``root`` (see the module's docs), and the training images' statistics;
    returns ``root``. Scenes: index ``i`` of ``shapes``/``shapes3d``, base 0 (train) or 1000.
    ``test_tiles``: each test image is a mosaic of ``test_tiles x test_tiles`` scenes of
    ``side`` (images only): larger images whose shapes have the training images' sizes."""
    root = Path(root)
    classes = classes or (4 if dims == 2 else 3)
    channels = channels or (3 if dims == 2 else 1)
    Data = shapes.ShapesDataset if dims == 2 else shapes3d.ShapesVolumeDataset
    for split, count, base in (("train", train, 0), ("test", test, 1000)):
        if count == 0:
            continue
        tiles = test_tiles if split == "test" else 1
        scenes = Data(count * tiles**2, side, channels=channels, num_classes=classes, base=base)
        for i in range(count):
            if tiles > 1:
                write_mosaic(root / split, f"s{i:04d}", side,
                             [scenes.scene(i * tiles**2 + k) for k in range(tiles**2)], tiles,
                             classes, channels)
                continue
            write_sample(root / split, f"s{i:04d}", dims, side, scenes.scene(i), classes,
                         channels)
    readers = [SampleReader(p, dims) for p in sorted((root / "train/images").glob("*.zarr"))]
    cached_stats(readers, root / STATS_FILE)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the store's folder")
    parser.add_argument("--dims", type=int, choices=(2, 3), default=2)
    parser.add_argument("--side", type=int, default=1024, help="pixels (voxels) per side")
    parser.add_argument("--train", type=int, default=48, help="training samples")
    parser.add_argument("--test", type=int, default=4, help="test samples")
    parser.add_argument("--classes", type=int, help="classes with the background (4; 3 in 3-D)")
    parser.add_argument("--channels", type=int, help="image channels (3; volumes: 1)")
    parser.add_argument("--test-tiles", type=int, default=1, help="test images of N x N "
                        "scenes of --side each (images only): larger, shapes of the same size")
    args = parser.parse_args()
    if args.test_tiles > 1 and args.dims != 2:
        parser.error("--test-tiles is for images (--dims 2)")
    write_store(args.root, args.dims, args.side, args.train, args.test, args.classes,
                args.channels, args.test_tiles)
    n = args.side ** args.dims
    test = f" ({args.side * args.test_tiles}^2 mosaics)" if args.test_tiles > 1 else ""
    print(f"wrote {args.train} + {args.test}{test} samples of {args.side}^{args.dims} "
          f"({n / 2**20:.1f} Mi{'pixels' if args.dims == 2 else 'voxels'} each) to {args.root}")


if __name__ == "__main__":
    main()
