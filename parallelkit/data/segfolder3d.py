"""``segfolder3d``: real volume segmentation data from a folder of ``.npy`` volumes and masks.

    root/train/images/<name>.npy   (D, H, W) or (C, D, H, W), any real dtype
    root/train/masks/<name>.npy    (D, H, W), integer class indices
    root/test/...  (or root/val)

The 3-D counterpart of :mod:`parallelkit.data.segfolder`. A mask holds a class index below
``num_classes`` per voxel, or :data:`~parallelkit.data.segfolder.IGNORE` (255) for voxels
that count nowhere. NumPy's ``.npy`` is read by every tool that exports volumes (nibabel's
``get_fdata()``, SimpleITK's ``GetArrayFromImage``, zarr), and its header gives a volume's
shape without reading it: shapes are checked when the data set is opened (a mask of another
shape than its volume, a volume with a channel count other than ``data.channels``: a
``ValueError`` naming the file), labels when a mask is read.

Volumes are resized (trilinear) and masks (nearest) to an ``image_size`` cube, and each
volume is standardized per channel (zero mean, unit variance): CT and MRI intensities have no
common range. Under spatial parallelism a rank keeps only its ``window`` of the mask; a mask
already of the cube's size is memory-mapped and only that window is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from parallelkit.data.errors import DataError, one_line
from parallelkit.data.segfolder import check_labels
from parallelkit.data.shapes3d import Window, volume_window


class VolumeFolderDataset(Dataset):
    """Pairs ``images/<name>.npy`` and ``masks/<name>.npy`` of ``root/<split>``."""

    def __init__(
        self,
        root: str,
        split: str,
        image_size: int = 32,
        channels: int = 1,
        num_classes: int = 2,
        window: Window | None = None,
    ) -> None:
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"segfolder3d: data.root {root!r} is not a directory")
        names = ("train",) if split == "train" else ("test", "val")
        dirs = [base / n for n in names if (base / n / "images").is_dir()]
        if not dirs:
            tried = " or ".join(str(base / n / "images") for n in names)
            raise ValueError(f"segfolder3d: no {split} volumes: expected {tried}")
        images = sorted(p for p in (dirs[0] / "images").iterdir() if p.suffix == ".npy")
        if not images:
            raise ValueError(f"segfolder3d: no volumes (.npy) in {dirs[0] / 'images'}")
        self.samples = [(p, dirs[0] / "masks" / p.name) for p in images]
        if missing := [str(m) for _, m in self.samples if not m.is_file()]:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(f"segfolder3d: no mask {missing[0]}{more} for its volume")
        for image, mask in self.samples:
            check_shapes(image, mask, channels)
        self.image_size, self.channels, self.num_classes = image_size, channels, num_classes
        self.window = volume_window(window, image_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, mask_path = self.samples[index]
        volume = fit_volume(read_volume(image_path), self.image_size)
        return volume, read_mask(mask_path, self.image_size, self.window, self.num_classes)


def _shape(path: Path) -> tuple[int, ...]:
    """The array shape in a ``.npy`` header (nothing else is read)."""
    try:
        return tuple(np.load(path, mmap_mode="r").shape)
    except (OSError, ValueError) as err:
        raise ValueError(f"segfolder3d: cannot read {path} as a .npy array: {err}") from err


def check_shapes(image: Path, mask: Path, channels: int) -> None:
    """A volume is (D, H, W) or (channels, D, H, W); its mask is (D, H, W), the same D H W."""
    volume, labels = _shape(image), _shape(mask)
    if len(volume) not in (3, 4):
        raise ValueError(
            f"segfolder3d: volume {image} has shape {volume}; expected (D, H, W) or (C, D, H, W)"
        )
    c = 1 if len(volume) == 3 else volume[0]
    if c != channels:
        raise ValueError(
            f"segfolder3d: volume {image} has {c} channel(s) (shape {volume}) but "
            f"data.channels={channels}"
        )
    if labels != volume[-3:]:
        raise ValueError(
            f"segfolder3d: mask {mask} has shape {labels} but its volume {image} is "
            f"{volume}; a mask is (D, H, W), its volume's size"
        )


def read_volume(path: Path) -> torch.Tensor:
    """The ``(C, D, H, W)`` float32 volume at ``path``, standardized per channel."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:  # truncated, pickled, not an .npy file
        raise DataError(f"segfolder3d: cannot read volume {path}: {one_line(err)}") from None
    if not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
        raise ValueError(f"segfolder3d: volume {path} holds {array.dtype}, not real numbers")
    volume = torch.from_numpy(np.asarray(array, dtype=np.float32))
    volume = volume[None] if volume.dim() == 3 else volume
    mean = volume.mean((1, 2, 3), keepdim=True)
    std = volume.std((1, 2, 3), keepdim=True).clamp(min=1e-6)
    return (volume - mean) / std


def fit_volume(volume: torch.Tensor, size: int) -> torch.Tensor:
    """``(C, D, H, W)`` resized to a ``size`` cube, trilinearly."""
    if tuple(volume.shape[1:]) == (size,) * 3:
        return volume
    return F.interpolate(volume[None], (size,) * 3, mode="trilinear", align_corners=False)[0]


def read_mask(
    path: Path, size: int, window: tuple[slice, slice, slice], num_classes: int
) -> torch.Tensor:
    """The ``window`` of the mask at ``path`` as int64 labels of a ``size`` cube (nearest),
    checked against ``num_classes``; a mask of the cube's size is read by its window only."""
    labels = np.load(path, mmap_mode="r")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"segfolder3d: mask {path} holds {labels.dtype}, not integer labels")
    if labels.shape == (size,) * 3:
        mask = torch.from_numpy(np.asarray(labels[window], dtype=np.int64))
    else:
        whole = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        mask = F.interpolate(whole[None, None].float(), (size,) * 3, mode="nearest")[0, 0]
        mask = mask.to(torch.int64)[window]
    return check_labels(mask, num_classes, str(path))
