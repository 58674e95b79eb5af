"""``segfolder``: real segmentation data from a folder of images and PNG masks.

    root/train/images/<name>.png|jpg|...    root/train/masks/<name>.png
    root/test/images/...  (or root/val)     root/test/masks/...

A mask is a one-channel PNG (mode ``L`` or palette ``P``, whose indices are the labels, as
Pascal VOC ships them) of the image's size, each pixel a class index below ``num_classes``,
or :data:`IGNORE` (255) for pixels that count nowhere (object borders, "void"). Why checks
here: a mask with a label the model has no output for, or of another size than its image,
would fail deep inside the loss (or be silently resized); instead it is a ``ValueError``
naming the file. Sizes are checked from the PNG headers when the data set is opened (cheap:
nothing is decoded), labels when a mask is read.

Images are resized (bilinear) and masks (nearest) to ``image_size`` square. Under spatial
parallelism a rank keeps only its ``window`` of the mask; PNG cannot be decoded by rows
(PIL inflates the whole image), so the mask is decoded whole and cropped, and the image is
read whole (``pk.parallelize`` scatters it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from parallelkit.data.errors import DataError
from parallelkit.data.pixels import IMAGE_EXTENSIONS, fit, normalize, read_image

IGNORE = 255
"""The mask value of pixels that no loss or metric counts."""
Window = tuple[slice, slice]


class SegFolderDataset(Dataset):
    """Pairs ``images/<name>.*`` and ``masks/<name>.png`` of ``root/<split>``."""

    def __init__(
        self,
        root: str,
        split: str,
        image_size: int = 64,
        channels: int = 3,
        num_classes: int = 2,
        window: Window | None = None,
    ) -> None:
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"segfolder: data.root {root!r} is not a directory")
        names = ("train",) if split == "train" else ("test", "val")
        dirs = [base / n for n in names if (base / n / "images").is_dir()]
        if not dirs:
            tried = " or ".join(str(base / n / "images") for n in names)
            raise ValueError(f"segfolder: no {split} images: expected {tried}")
        images = sorted(
            p for p in (dirs[0] / "images").iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not images:
            raise ValueError(f"segfolder: no images ({', '.join(IMAGE_EXTENSIONS)}) in {dirs[0]}")
        self.samples = [(p, dirs[0] / "masks" / f"{p.stem}.png") for p in images]
        if missing := [str(m) for _, m in self.samples if not m.is_file()]:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(f"segfolder: no mask {missing[0]}{more} for its image")
        for image, mask in self.samples:
            check_sizes(image, mask)
        self.image_size, self.channels, self.num_classes = image_size, channels, num_classes
        self.window = window or (slice(0, image_size), slice(0, image_size))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, mask_path = self.samples[index]
        image = fit(read_image(image_path, self.channels), self.image_size, self.channels)
        mask = read_mask(mask_path, self.num_classes)
        return normalize(image), fit_mask(mask, self.image_size)[self.window]


def check_sizes(image: Path, mask: Path) -> None:
    """A mask must be one channel and its image's size (read from the headers only)."""
    from PIL import Image

    try:
        with Image.open(image) as a, Image.open(mask) as b:
            size, mask_size, mode = a.size, b.size, b.mode
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"segfolder: cannot read {image} or {mask}: {err}") from err
    if mask_size != size:
        raise ValueError(
            f"segfolder: mask {mask} is {mask_size[0]}x{mask_size[1]} but its image {image} is "
            f"{size[0]}x{size[1]} (width x height); a mask must be its image's size"
        )
    if mode not in ("L", "P", "I;16", "I"):
        raise ValueError(
            f"segfolder: mask {mask} has PIL mode {mode}; a mask is one channel of class "
            "indices (mode L or a palette image, P)"
        )


def read_mask(path: Path, num_classes: int) -> torch.Tensor:
    """The ``(H, W)`` int64 labels of the PNG at ``path``, checked against ``num_classes``."""
    from PIL import Image

    try:
        with Image.open(path) as png:
            labels = np.array(png, dtype=np.int64)  # P: the palette indices themselves
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"cannot read mask {path}: {err}") from err
    return check_labels(torch.from_numpy(labels), num_classes, str(path))


def check_labels(mask: torch.Tensor, num_classes: int, where: str) -> torch.Tensor:
    """``mask`` itself, after checking every label is a class or :data:`IGNORE`."""
    bad = (mask < 0) | ((mask >= num_classes) & (mask != IGNORE))
    if bad.any():
        values = sorted(set(mask[bad].unique().tolist()))[:5]
        raise DataError(
            f"mask {where} has labels {values} outside 0..{num_classes - 1} (and {IGNORE}, "
            f"ignored): set data.num_classes to the data set's class count"
        )
    return mask


def fit_mask(mask: torch.Tensor, image_size: int) -> torch.Tensor:
    """``(H, W)`` labels resized to ``image_size`` square by nearest neighbour."""
    if tuple(mask.shape) == (image_size, image_size):
        return mask
    resized = F.interpolate(mask[None, None].float(), (image_size, image_size), mode="nearest")
    return resized[0, 0].to(torch.int64)
