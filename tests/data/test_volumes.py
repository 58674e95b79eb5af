"""The volume data sets with masks, without processes: ``shapes3d`` (generated spheres and
boxes) and ``segfolder3d`` (a folder of .npy volumes and masks), and their config checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parallelkit.data import DataConfig, build_loader, check_config, load_dataset
from parallelkit.data.segfolder3d import VolumeFolderDataset
from parallelkit.data.shapes3d import ShapesVolumeDataset


def test_shapes3d_is_a_pure_function_of_the_index():
    a, b = ShapesVolumeDataset(8, 12, num_classes=4), ShapesVolumeDataset(8, 12, num_classes=4)
    for i in (0, 5):
        (va, ma), (vb, mb) = a[i], b[i]
        assert torch.equal(va, vb) and torch.equal(ma, mb)
    assert not torch.equal(a[0][1], a[1][1])
    other = ShapesVolumeDataset(8, 12, num_classes=4, base=1 << 31)
    assert not torch.equal(a[0][0], other[0][0])  # the test split's volumes differ


@pytest.mark.parametrize("channels", [1, 3])
def test_shapes3d_shapes_range_and_labels(channels):
    ds = ShapesVolumeDataset(20, 16, channels=channels, num_classes=3)
    volume, mask = ds[3]
    assert volume.shape == (channels, 16, 16, 16) and volume.dtype == torch.float32
    assert mask.shape == (16, 16, 16) and mask.dtype == torch.int64
    assert volume.min() >= -1 and volume.max() <= 1
    masks = torch.stack([ds[i][1] for i in range(20)])
    assert set(masks.unique().tolist()) == {0, 1, 2}  # background, spheres, boxes
    # The shapes stand out from the background: brighter on average.
    assert volume[:, mask > 0].mean() > volume[:, mask == 0].mean() + 0.2


def test_shapes3d_window_is_the_whole_masks_block():
    whole = ShapesVolumeDataset(4, 15, num_classes=3)[2][1]
    block = (slice(5, 10), slice(0, 8), slice(7, 15))
    assert torch.equal(ShapesVolumeDataset(4, 15, num_classes=3, window=block)[2][1], whole[block])
    rows_cols = (slice(8, 15), slice(0, 15))  # an (H, W) window: all of D
    got = ShapesVolumeDataset(4, 15, num_classes=3, window=rows_cols)[2][1]
    assert torch.equal(got, whole[:, 8:15])


def _folder(root, count=3, size=10, shape=None, mask_dtype=np.uint8, labels=None):
    for d in ("images", "masks"):
        (root / "train" / d).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        np.save(root / "train/images" / f"{i}.npy", rng.normal(100, 30, shape or (size,) * 3))
        mask = rng.integers(0, 3, (size,) * 3) if labels is None else labels
        np.save(root / "train/masks" / f"{i}.npy", np.asarray(mask).astype(mask_dtype))
    return root


def test_segfolder3d_reads_resizes_and_windows(tmp_path):
    _folder(tmp_path, size=10)
    ds = VolumeFolderDataset(str(tmp_path), "train", image_size=10, num_classes=3)
    volume, mask = ds[1]
    saved = torch.from_numpy(np.load(tmp_path / "train/masks/1.npy").astype(np.int64))
    assert volume.shape == (1, 10, 10, 10) and torch.equal(mask, saved)
    assert abs(float(volume.mean())) < 1e-4 and abs(float(volume.std()) - 1) < 1e-3
    block = (slice(2, 6), slice(0, 10), slice(5, 10))
    windowed = VolumeFolderDataset(str(tmp_path), "train", 10, num_classes=3, window=block)
    assert torch.equal(windowed[1][1], saved[block])
    bigger = VolumeFolderDataset(str(tmp_path), "train", image_size=16, num_classes=3)
    assert bigger[0][0].shape == (1, 16, 16, 16) and bigger[0][1].shape == (16, 16, 16)


def test_segfolder3d_through_the_loader(tmp_path):
    _folder(tmp_path, count=4, size=8)
    cfg = DataConfig(name="segfolder3d", root=str(tmp_path), image_size=8, channels=1,
                     num_classes=3)  # fmt: skip
    loader = build_loader(cfg, "train", rank=0, size=1, batch_size=2)
    x, y = next(iter(loader))
    assert x.shape == (2, 1, 8, 8, 8) and y.shape == (2, 8, 8, 8) and loader.masks


@pytest.mark.parametrize(
    ("kwargs", "channels", "message"),
    [
        (dict(shape=(10, 10, 9)), 1, r"has shape \(10, 10, 10\) but its volume"),
        (dict(shape=(3, 10, 10, 10)), 1, r"has 3 channel\(s\).*data.channels=1"),
        (dict(shape=(10, 10)), 1, r"expected \(D, H, W\) or \(C, D, H, W\)"),
        (dict(labels=np.full((10,) * 3, 7)), 1, r"labels \[7\] outside 0..2"),
        (dict(mask_dtype=np.float32), 1, "not integer labels"),
    ],
)
def test_segfolder3d_errors_name_the_file(tmp_path, kwargs, channels, message):
    _folder(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=message) as info:
        ds = VolumeFolderDataset(str(tmp_path), "train", 10, channels, num_classes=3)
        ds[0]
    assert str(tmp_path) in str(info.value)


def test_segfolder3d_missing_mask_and_config(tmp_path):
    _folder(tmp_path)
    (tmp_path / "train/masks/2.npy").unlink()
    with pytest.raises(ValueError, match=r"no mask .*2\.npy for its volume"):
        VolumeFolderDataset(str(tmp_path), "train")
    with pytest.raises(ValueError, match=r"needs data\.root"):
        check_config(DataConfig(name="segfolder3d"), "train")
    with pytest.raises(ValueError, match=r"must lie in 2\.\.255 for shapes3d"):
        check_config(DataConfig(name="shapes3d", num_classes=1), "train")
    ds = load_dataset(DataConfig(name="shapes3d", image_size=8, num_classes=3, channels=1,
                                 test_samples=5), "test")  # fmt: skip
    assert len(ds) == 5 and ds[0][0].shape == (1, 8, 8, 8)


def test_a_damaged_volume_is_named(tmp_path):
    """A truncated .npy or a pickled one: a DataError naming the file, never a bare numpy
    message (or an unpickling)."""
    from parallelkit.data.errors import DataError
    from parallelkit.data.segfolder3d import read_volume

    np.save(tmp_path / "cut.npy", np.zeros((4, 4, 4), np.float32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:-20])
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    for name in ("cut.npy", "obj.npy"):
        with pytest.raises(DataError, match=f"cannot read volume {tmp_path / name}"):
            read_volume(tmp_path / name)
