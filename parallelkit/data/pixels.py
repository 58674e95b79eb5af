"""Pixels: reading image files and bringing images to the configured size, channels and range.

Every data set shares these steps (the map-style ones in :mod:`parallelkit.data.datasets`, the
masked ones in :mod:`parallelkit.data.shapes` and :mod:`parallelkit.data.segfolder`, and the
tar shards of :mod:`parallelkit.data.shardio`), so they live below all of them, in one file
that imports none of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601, what PIL's convert("L") uses


def normalize(x01: torch.Tensor) -> torch.Tensor:
    """Pixel values in [0, 1] -> [-1, 1]: zero-centred, and the range of a tanh generator."""
    return (x01 - 0.5) / 0.5


def denormalize(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`normalize`."""
    return x * 0.5 + 0.5


def fit(x: torch.Tensor, image_size: int, channels: int) -> torch.Tensor:
    """A ``(C, H, W)`` image resized (bilinear) to ``image_size`` square with ``channels``.

    Gray becomes RGB by repeating the channel, RGB becomes gray by luma weights. Both steps are
    affine with weights summing to one, so they commute with :func:`normalize`.
    """
    if x.shape[0] != channels:
        if x.shape[0] == 1 and channels == 3:
            x = x.expand(3, -1, -1)
        elif x.shape[0] == 3 and channels == 1:
            x = torch.tensordot(x.new_tensor(LUMA), x, dims=1).unsqueeze(0)
        else:
            raise ValueError(f"cannot convert a {x.shape[0]}-channel image to {channels} channels")
    if tuple(x.shape[1:]) != (image_size, image_size):
        shrink = image_size < max(x.shape[1:])  # antialias only matters when shrinking
        x = F.interpolate(
            x[None], (image_size, image_size), mode="bilinear", align_corners=False,
            antialias=shrink,
        )[0]  # fmt: skip
    return x.contiguous()


def read_image(path: str | Path, channels: int) -> torch.Tensor:
    """The image file at ``path`` as a float ``(channels, H, W)`` tensor in [0, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("L" if channels == 1 else "RGB"))
    except (OSError, SyntaxError, ValueError) as err:  # PIL raises all three on bad files
        raise ValueError(f"cannot read image {path}: {err}") from err
    return from_uint8(array)


def from_uint8(array: np.ndarray) -> torch.Tensor:
    """An 8-bit ``(H, W)`` or ``(H, W, C)`` array as float ``(C, H, W)`` in [0, 1]."""
    x = torch.from_numpy(np.array(array, dtype=np.uint8))  # a copy: PIL's arrays are read-only
    x = x.unsqueeze(0) if x.dim() == 2 else x.permute(2, 0, 1)
    return x.float() / 255.0
