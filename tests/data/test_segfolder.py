"""Segmentation data in one process: the generated ``shapes`` set, the ``segfolder`` loader
with its checks, masks in WebDataset shards, and the per-rank crop of masks (``block``).

A spatial group's ranks are simulated by building every rank's loader here: their mask blocks
must tile the whole mask, in the layout ``pk.spatial.scatter`` cuts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import parallelkit as pk
from parallelkit.comm.local import LocalCommunicator
from parallelkit.data import DataConfig, build_loader, load_dataset, shard_main, write_shards
from parallelkit.data.shapes import ShapesDataset
from parallelkit.geometry import BlockLayout


def shapes_cfg(**kw) -> DataConfig:
    base = dict(name="shapes", image_size=24, num_classes=4, train_samples=16, test_samples=6)
    return DataConfig(**{**base, **kw})


# ----------------------------------------------------------------------------- shapes
def test_shapes_deterministic_per_seed_and_index():
    a, b = ShapesDataset(8, 32, num_classes=5), ShapesDataset(8, 32, num_classes=5)
    for i in range(8):
        (xa, ma), (xb, mb) = a[i], b[i]
        assert torch.equal(xa, xb) and torch.equal(ma, mb)
    x0, m0 = a[0]
    assert x0.shape == (3, 32, 32) and m0.shape == (32, 32) and m0.dtype == torch.int64
    assert not torch.equal(a[1][1], m0)  # other index, other scene
    other = ShapesDataset(8, 32, num_classes=5, base=1 << 31)[0]  # the test split's seeds
    assert not torch.equal(other[1], m0)
    masks = torch.stack([a[i][1] for i in range(8)])
    assert masks.min() >= 0 and masks.max() < 5 and len(masks.unique()) > 2


def test_shapes_any_resolution_same_scene():
    small, large = ShapesDataset(4, 16, num_classes=4), ShapesDataset(4, 64, num_classes=4)
    for i in range(4):
        # The same scene: the large mask sampled at the small one's pixel centres agrees
        # except on a few pixels along shape borders.
        coarse = large[i][1][2::4, 2::4]
        assert (coarse == small[i][1]).float().mean() > 0.9


def test_shapes_window_is_the_crop_of_the_whole():
    whole = ShapesDataset(3, 30, num_classes=4)
    rows, cols = slice(10, 20), slice(15, 30)
    part = ShapesDataset(3, 30, num_classes=4, window=(rows, cols))
    for i in range(3):
        assert torch.equal(part[i][0], whole[i][0])  # images stay whole
        assert torch.equal(part[i][1], whole[i][1][rows, cols])


@pytest.mark.parametrize("grid", [(2, 1), (2, 2), (3, 2)])
def test_loader_blocks_tile_the_mask_as_scatter_cuts(grid):
    rows, cols = grid
    cfg = shapes_cfg(image_size=25)  # 25 does not divide: uneven blocks
    whole_x, whole_m = next(iter(build_loader(cfg, "train", rank=0, size=1, batch_size=4)))
    for r in range(rows):
        for c in range(cols):
            loader = build_loader(
                cfg, "train", rank=0, size=1, batch_size=4, block=BlockLayout((rows, cols), (r, c))
            )
            x, m = next(iter(loader))
            assert loader.masks and torch.equal(x, whole_x)
            h, w = BlockLayout((rows, cols), (r, c)).slices(25, 25)
            assert torch.equal(m, whole_m[:, h, w])
    # The same layout as pk.spatial.scatter on a single rank's view of the grid.
    comm = LocalCommunicator()
    assert torch.equal(pk.spatial.scatter(whole_m[:, None], comm)[:, 0], whole_m)


def test_classification_labels_ignore_the_block():
    cfg = DataConfig(name="synthetic", image_size=8, train_samples=8)
    a = next(iter(build_loader(cfg, "train", rank=0, size=1, batch_size=4)))
    block = BlockLayout((2, 1), (1, 0))
    b = next(iter(build_loader(cfg, "train", rank=0, size=1, batch_size=4, block=block)))
    assert torch.equal(a[1], b[1]) and a[1].shape == (4,)


# ----------------------------------------------------------------------------- segfolder
def write_folder(root: Path, n: int = 3, size: int = 12, classes: int = 3) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (root / split / "images").mkdir(parents=True)
        (root / split / "masks").mkdir(parents=True)
        for i in range(n):
            image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            mask = rng.integers(0, classes, (size, size), dtype=np.uint8)
            mask[0, 0] = 255  # ignored
            Image.fromarray(image).save(root / split / "images" / f"im{i}.png")
            Image.fromarray(mask, mode="L").save(root / split / "masks" / f"im{i}.png")


def test_segfolder_reads_images_and_masks(tmp_path):
    write_folder(tmp_path)
    cfg = DataConfig(name="segfolder", root=str(tmp_path), image_size=12, num_classes=3)
    ds = load_dataset(cfg, "test")
    x, m = ds[1]
    want = np.asarray(Image.open(tmp_path / "test/masks/im1.png"))
    assert x.shape == (3, 12, 12) and torch.equal(m, torch.from_numpy(want.astype(np.int64)))
    block = BlockLayout((2, 2), (1, 1))
    loader = build_loader(cfg, "train", rank=0, size=1, batch_size=3, block=block)
    assert next(iter(loader))[1].shape == (3, 6, 6)


def test_segfolder_wrong_class_count_names_the_file(tmp_path):
    write_folder(tmp_path, classes=5)
    cfg = DataConfig(name="segfolder", root=str(tmp_path), image_size=12, num_classes=3)
    ds = load_dataset(cfg, "train")
    with pytest.raises(ValueError, match=r"im0\.png has labels \[3, 4\] outside 0\.\.2"):
        ds[0]


def test_segfolder_wrong_size_names_the_file(tmp_path):
    write_folder(tmp_path)
    bad = tmp_path / "train/masks/im2.png"
    Image.fromarray(np.zeros((12, 10), dtype=np.uint8), mode="L").save(bad)
    cfg = DataConfig(name="segfolder", root=str(tmp_path), image_size=12, num_classes=3)
    with pytest.raises(ValueError, match=rf"mask {bad} is 10x12 but its image .*im2\.png is 12x12"):
        load_dataset(cfg, "train")


def test_segfolder_missing_mask_and_rgb_mask(tmp_path):
    write_folder(tmp_path)
    cfg = DataConfig(name="segfolder", root=str(tmp_path), image_size=12, num_classes=3)
    (tmp_path / "test/masks/im0.png").unlink()
    with pytest.raises(ValueError, match=r"no mask .*test/masks/im0\.png"):
        load_dataset(cfg, "test")
    Image.fromarray(np.zeros((12, 12, 3), dtype=np.uint8)).save(tmp_path / "train/masks/im1.png")
    with pytest.raises(ValueError, match=r"im1\.png has PIL mode RGB"):
        load_dataset(cfg, "train")


# ----------------------------------------------------------------------------- shards
def test_shards_round_trip_with_masks(tmp_path):
    ds = load_dataset(shapes_cfg(), "train")
    write_shards(ds, str(tmp_path), 5, "train")  # 16 samples: shards of 5, 5, 5, 1
    write_shards(load_dataset(shapes_cfg(), "test"), str(tmp_path), 5, "test")
    cfg = DataConfig(name="webdataset", root=str(tmp_path), image_size=24)
    loader = build_loader(cfg, "test", rank=0, size=1, batch_size=6, drop_last=False)
    assert loader.masks and loader.num_classes == 4
    x, m = next(iter(loader))
    test = load_dataset(shapes_cfg(), "test")
    by_image = {}
    for i in range(len(test)):
        xi, mi = test[i]
        by_image[(xi * 127.5).round().sum().item()] = (xi, mi)
    for xj, mj in zip(x, m, strict=True):
        xi, mi = min(by_image.values(), key=lambda p: (p[0] - xj).abs().max().item())
        assert (xi - xj).abs().max() <= 1 / 255 + 1e-6  # 8-bit PNG
        assert torch.equal(mi, mj)  # masks are exact
    cropped = build_loader(
        cfg, "test", rank=0, size=1, batch_size=6, drop_last=False,
        block=BlockLayout((2, 1), (1, 0)),
    )
    assert torch.equal(next(iter(cropped))[1], m[:, 12:])


def test_shard_command_writes_shapes_with_masks(tmp_path, capsys):
    out = tmp_path / "shapes"
    args = ["shapes", str(out), "--samples-per-shard", "4", "--image-size", "16",
            "--train-samples", "8", "--test-samples", "4"]  # fmt: skip
    assert shard_main(args) == 0
    import json

    manifest = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    assert manifest["masks"] is True and manifest["num_classes"] == 4
    assert shard_main(["segfolder:" + str(tmp_path), str(tmp_path / "x"),
                       "--samples-per-shard", "2"]) == 1  # fmt: skip
    assert "needs --num-classes" in capsys.readouterr().err


def test_shards_with_masks_checked_against_class_count(tmp_path):
    ds = load_dataset(shapes_cfg(), "test")
    write_shards(ds, str(tmp_path), 6, "test")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"num_classes": 4', '"num_classes": 2'))
    cfg = DataConfig(name="webdataset", root=str(tmp_path), image_size=24)
    loader = build_loader(cfg, "test", rank=0, size=1, batch_size=6, drop_last=False)
    with pytest.raises(ValueError, match=r"test-000000\.tar, sample .* outside 0\.\.1"):
        next(iter(loader))
