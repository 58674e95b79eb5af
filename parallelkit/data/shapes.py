"""``shapes``: a generated segmentation data set of textured shapes and their masks.

Why it is here: segmentation under spatial parallelism needs data of any resolution (the point
of splitting an image is that it is large) that installs with the package and downloads
nothing. Each sample is a pure function of ``(base + index)``: a random smooth background and
a few circles, squares and triangles painted over it, each shape's pixels labelled with its
class (0 is the background). A class has its own shape kind and hue, jittered per instance,
and every shape carries a striped texture, so the classes are learnable but not trivial.

Shapes live in coordinates normalised to the image (0..1), so the same index gives the same
scene at every resolution, and a sample is drawn from its parameters on demand: nothing is
stored, 4096 x 4096 images cost only the time to draw them.

Lazy cropping: the scene is a function of pixel coordinates, so any window of the mask can be
drawn without the rest. Under spatial parallelism each rank draws only its block of the mask
(``window``). The image is drawn whole, because ``pk.parallelize`` takes the whole image on
every rank of a spatial group and scatters it itself.

    ds = ShapesDataset(100, image_size=64, num_classes=4)
    image, mask = ds[0]          # (3, 64, 64) float in about [-1, 1], (64, 64) int64
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from parallelkit.data.pixels import normalize

KINDS = ("circle", "square", "triangle")
MAX_SHAPES = 5
Window = tuple[slice, slice]


class ShapesDataset(Dataset):
    """``length`` generated scenes at ``image_size`` with ``num_classes`` classes (background
    included), each a pure function of ``(base + index)``.

    ``window``: (rows, cols) of the mask to return (default: all of it); the image is whole.
    """

    def __init__(
        self,
        length: int,
        image_size: int = 64,
        channels: int = 3,
        num_classes: int = 4,
        base: int = 0,
        window: Window | None = None,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"shapes: num_classes={num_classes} must be >= 2 (background + 1)")
        if not 0 <= length <= 1 << 31:
            raise ValueError(f"shapes: {length} images; at most 2**31 are distinct")
        self.length, self.image_size, self.channels = length, image_size, channels
        self.num_classes, self.base = num_classes, base
        self.window = window or (slice(0, image_size), slice(0, image_size))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} shapes images")
        scene = self.scene(index)
        whole = (slice(0, self.image_size), slice(0, self.image_size))
        image = draw_image(scene, self.image_size, whole, self.num_classes, self.channels)
        return image, draw_mask(scene, self.image_size, self.window)

    def scene(self, index: int) -> dict[str, torch.Tensor]:
        """The parameters of sample ``index``: background and shapes (normalised units)."""
        g = torch.Generator().manual_seed((self.base + index) % (1 << 32))
        n = int(torch.randint(1, MAX_SHAPES + 1, (), generator=g))
        u = lambda *shape: torch.rand(shape, generator=g, dtype=torch.float64)  # noqa: E731
        return {
            "background": u(2, 3) * 0.5 + 0.25,  # two colours mixed by a smooth wave
            "wave": u(4),  # its direction, frequency, phase
            "classes": torch.randint(1, self.num_classes, (n,), generator=g),
            "centre": u(n, 2) * 0.8 + 0.1,
            "size": u(n) * 0.15 + 0.08,
            "angle": u(n) * math.pi,
            "jitter": u(n, 3) * 0.2 - 0.1,
            "stripes": u(n, 2),  # texture frequency and phase
            "noise_seed": torch.randint(1 << 31, (1,), generator=g),
        }


def class_colour(label: torch.Tensor, classes: int) -> torch.Tensor:
    """The base RGB colour of each class in ``label``: hues spread around the wheel."""
    hue = (label.double() - 1) / max(classes - 1, 1)
    phase = torch.tensor([0.0, 2 / 3, 4 / 3], dtype=torch.float64) * math.pi
    return 0.5 + 0.45 * torch.cos(2 * math.pi * hue[..., None] - phase)


def _grid(size: int, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel-centre coordinates (y, x) in [0, 1] of ``window`` of a ``size`` image."""
    rows, cols = window
    y = (torch.arange(rows.start, rows.stop, dtype=torch.float64) + 0.5) / size
    x = (torch.arange(cols.start, cols.stop, dtype=torch.float64) + 0.5) / size
    return torch.meshgrid(y, x, indexing="ij")


def _inside(scene: dict[str, torch.Tensor], i: int, y: torch.Tensor, x: torch.Tensor):
    """Which pixels shape ``i`` covers: its class's kind, centred, rotated, sized."""
    cy, cx = scene["centre"][i].tolist()
    a, s = float(scene["angle"][i]), float(scene["size"][i])
    dy, dx = y - cy, x - cx
    u, v = dx * math.cos(a) + dy * math.sin(a), -dx * math.sin(a) + dy * math.cos(a)
    kind = KINDS[int(scene["classes"][i] - 1) % len(KINDS)]
    if kind == "circle":
        return u * u + v * v < s * s
    if kind == "square":
        return (u.abs() < s * 0.8) & (v.abs() < s * 0.8)
    # an equilateral triangle: three half-planes at 120 degrees
    return torch.stack(
        [u * math.cos(t) + v * math.sin(t) < s * 0.5 for t in (0.5, 2.6944, 4.7888)]
    ).all(0)


def draw_mask(scene: dict[str, torch.Tensor], size: int, window: Window) -> torch.Tensor:
    """The labels of ``window``: later shapes paint over earlier ones; 0 is background."""
    y, x = _grid(size, window)
    mask = torch.zeros(y.shape, dtype=torch.int64)
    for i, label in enumerate(scene["classes"].tolist()):
        mask[_inside(scene, i, y, x)] = label
    return mask


def draw_image(
    scene: dict[str, torch.Tensor], size: int, window: Window, classes: int, channels: int = 3
) -> torch.Tensor:
    """The normalised ``(channels, h, w)`` image of ``window`` (``classes``: the data set's
    class count, which fixes the colours)."""
    y, x = _grid(size, window)
    d, f, p, _ = scene["wave"].tolist()
    wave = 0.5 + 0.5 * torch.sin(
        2 * math.pi * (1 + 2 * f) * (x * math.cos(6.3 * d) + y * math.sin(6.3 * d)) + 6.3 * p
    )
    bg = scene["background"]
    image = bg[0][:, None, None] * wave + bg[1][:, None, None] * (1 - wave)
    for i, label in enumerate(scene["classes"].tolist()):
        inside = _inside(scene, i, y, x)
        colour = class_colour(torch.tensor(label), classes) + scene["jitter"][i]
        freq, phase = scene["stripes"][i].tolist()
        stripes = 0.8 + 0.2 * torch.sin(2 * math.pi * (6 + 10 * freq) * (x + y) + 6.3 * phase)
        image = torch.where(inside, colour[:, None, None] * stripes, image)
    # Pixel noise from the window's own positions, so a window is the whole image's window.
    rows, cols = window
    g = torch.Generator().manual_seed(int(scene["noise_seed"]))
    noise = torch.randn((3, size, size), generator=g, dtype=torch.float32)[:, rows, cols]
    image = (image.float() + 0.04 * noise).clamp(0, 1)
    if channels == 1:
        image = (image * image.new_tensor([0.299, 0.587, 0.114])[:, None, None]).sum(0, True)
    return normalize(image)
