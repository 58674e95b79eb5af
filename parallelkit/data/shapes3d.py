"""``shapes3d``: a generated volume segmentation data set of spheres and boxes in noise.

Why it is here: volumes are where spatial parallelism matters most (a CT or MRI cube's
activations grow with the cube of its side), and their tests and examples need volumes of any
size that install with the package and download nothing. This is the 3-D counterpart of
:mod:`parallelkit.data.shapes`: each sample is a pure function of ``(base + index)``, a smooth
background with a few spheres and boxes over it, every voxel of a shape labelled with its
class (0 is the background). Odd classes are spheres, even ones boxes; each class has its own
brightness (its colour, with three channels), jittered per instance, and the volume carries
voxel noise, so the classes are learnable but not trivial.

Shapes live in coordinates normalised to the cube (0..1), so the same index gives the same
scene at every resolution, and nothing is stored. Any window of the mask can be drawn without
the rest: under spatial parallelism a rank draws only its block of the mask (``window``, the
(D, H, W) slices, or the (H, W) slices of a grid that leaves D whole). The volume itself is
drawn whole, as ``pk.parallelize`` takes the whole input on every rank of a spatial group.

    ds = ShapesVolumeDataset(100, image_size=32, channels=1, num_classes=3)
    volume, mask = ds[0]         # (1, 32, 32, 32) float in about [-1, 1], (32, 32, 32) int64

Legend: D H W the volume's depth, height and width (all ``image_size``); z y x voxel-centre
coordinates in [0, 1].
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from parallelkit.data.pixels import normalize
from parallelkit.data.shapes import class_colour

KINDS = ("sphere", "box")
MAX_SHAPES = 4
Window = tuple[slice, ...]
"""(D, H, W) slices of a volume, or (H, W) slices (all of D)."""


class ShapesVolumeDataset(Dataset):
    """``length`` generated volumes of side ``image_size`` with ``num_classes`` classes
    (background included), each a pure function of ``(base + index)``.

    ``window``: the part of the mask to return (default: all of it); the volume is whole.
    """

    def __init__(
        self,
        length: int,
        image_size: int = 32,
        channels: int = 1,
        num_classes: int = 3,
        base: int = 0,
        window: Window | None = None,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"shapes3d: num_classes={num_classes} must be >= 2 (background + 1)")
        if not 0 <= length <= 1 << 31:
            raise ValueError(f"shapes3d: {length} volumes; at most 2**31 are distinct")
        self.length, self.image_size, self.channels = length, image_size, channels
        self.num_classes, self.base = num_classes, base
        self.window = volume_window(window, image_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} shapes3d volumes")
        scene = self.scene(index)
        size = self.image_size
        volume = draw_volume(scene, size, self.num_classes, self.channels)
        return volume, draw_mask(scene, size, self.window)

    def scene(self, index: int) -> dict[str, torch.Tensor]:
        """The parameters of sample ``index``: background and shapes (normalised units)."""
        g = torch.Generator().manual_seed((self.base + index) % (1 << 32))
        n = int(torch.randint(1, MAX_SHAPES + 1, (), generator=g))
        u = lambda *shape: torch.rand(shape, generator=g, dtype=torch.float64)  # noqa: E731
        return {
            "background": u(2) * 0.3 + 0.1,  # two levels mixed along a direction
            "direction": u(3) - 0.5,
            "classes": torch.randint(1, self.num_classes, (n,), generator=g),
            "centre": u(n, 3) * 0.6 + 0.2,
            "size": u(n, 3) * 0.15 + 0.1,  # a sphere's radius is the first
            "jitter": u(n) * 0.16 - 0.08,
            "noise_seed": torch.randint(1 << 31, (1,), generator=g),
        }


def volume_window(window: Window | None, size: int) -> tuple[slice, slice, slice]:
    """``window`` as (D, H, W) slices: all of the volume, or all of D for an (H, W) window."""
    whole = slice(0, size)
    if window is None:
        return whole, whole, whole
    if len(window) == 2:
        return whole, *window  # type: ignore[return-value]
    if len(window) != 3:
        raise ValueError(f"a volume's window is (D, H, W) or (H, W) slices, got {window}")
    return tuple(window)  # type: ignore[return-value]


def _grid(size: int, window: tuple[slice, slice, slice]) -> tuple[torch.Tensor, ...]:
    """Voxel-centre coordinates (z, y, x) in [0, 1] of ``window`` of a ``size`` cube."""
    axes = [
        (torch.arange(s.start, s.stop, dtype=torch.float64) + 0.5) / size for s in window
    ]
    return torch.meshgrid(*axes, indexing="ij")


def _inside(scene: dict[str, torch.Tensor], i: int, z, y, x) -> torch.Tensor:
    """Which voxels shape ``i`` covers: a sphere or an axis-aligned box, by its class."""
    cz, cy, cx = scene["centre"][i].tolist()
    sz, sy, sx = scene["size"][i].tolist()
    if KINDS[int(scene["classes"][i] - 1) % len(KINDS)] == "sphere":
        return (z - cz) ** 2 + (y - cy) ** 2 + (x - cx) ** 2 < sz * sz
    return ((z - cz).abs() < sz) & ((y - cy).abs() < sy) & ((x - cx).abs() < sx)


def draw_mask(scene: dict[str, torch.Tensor], size: int, window: Window) -> torch.Tensor:
    """The labels of ``window``: later shapes paint over earlier ones; 0 is background."""
    z, y, x = _grid(size, volume_window(window, size))
    mask = torch.zeros(z.shape, dtype=torch.int64)
    for i, label in enumerate(scene["classes"].tolist()):
        mask[_inside(scene, i, z, y, x)] = label
    return mask


def draw_volume(
    scene: dict[str, torch.Tensor], size: int, classes: int, channels: int = 1
) -> torch.Tensor:
    """The normalised ``(channels, D, H, W)`` volume (``classes``: the data set's class count,
    which fixes each class's colour and brightness)."""
    whole = slice(0, size)
    z, y, x = _grid(size, (whole, whole, whole))
    a, b, c = scene["direction"].tolist()
    ramp = ((a * z + b * y + c * x) / (abs(a) + abs(b) + abs(c) + 1e-9) + 0.5).clamp(0, 1)
    low, high = scene["background"].tolist()
    volume = (low + (high - low) * ramp).expand(3, *ramp.shape)
    for i, label in enumerate(scene["classes"].tolist()):
        colour = class_colour(torch.tensor(label), classes) + float(scene["jitter"][i])
        volume = torch.where(_inside(scene, i, z, y, x), colour[:, None, None, None], volume)
    g = torch.Generator().manual_seed(int(scene["noise_seed"]))
    noise = torch.randn((3, size, size, size), generator=g, dtype=torch.float32)
    volume = (volume.float() + 0.05 * noise).clamp(0, 1)
    if channels == 1:
        weights = volume.new_tensor([0.299, 0.587, 0.114])
        volume = (volume * weights[:, None, None, None]).sum(0, True)
    return normalize(volume)
