"""The data section of a training config, and its checks.

A plain dataclass of plain types, so that it can sit inside an OmegaConf structured config
(``OmegaConf.structured(TrainConfig)``) and be overridden from the command line
(``data.name=synthetic data.image_size=256``). Everything that reads it accepts a
``DataConfig`` or an OmegaConf ``DictConfig`` of the same fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from parallelkit.data.source import Source, parse_source

SPLITS: tuple[str, ...] = ("train", "test")
NORMALIZATIONS: tuple[str, ...] = ("zscore", "window", "percentile", "none")
"""``data.normalize`` of ``FORMAT:DIR`` sources (:mod:`parallelkit.data.intensity`)."""


@dataclass
class DataConfig:
    """Which images to train on and how each rank loads them.

    ``name`` picks the source (:attr:`source` is it parsed, a
    :class:`~parallelkit.data.source.Source`):

    - ``digits``: scikit-learn's 1,797 8x8 digits (installed with scikit-learn, no download),
      a fixed 80/20 train/test split, bilinear-upscaled to ``image_size``.
    - ``synthetic``: random images of any size, generated per index on demand (benchmarks).
    - ``imagefolder``: ``root/train/<class>/*.png|jpg`` and ``root/test`` (or ``root/val``).
    - ``cifar10``: ``root`` is the ``cifar-10-batches-py`` directory of pickled batches.
    - ``webdataset``: ``root`` holds ``train-*.tar``, ``test-*.tar`` and ``manifest.json``
      as written by ``parallelkit data shard`` (labels, or masks for segmentation).
    - ``shapes``: generated segmentation scenes of any size with their masks
      (:mod:`parallelkit.data.shapes`), ``num_classes`` classes counting the background.
    - ``segfolder``: ``root/{train,test|val}/images/*`` with ``masks/<name>.png``
      (:mod:`parallelkit.data.segfolder`), ``num_classes`` classes; 255 marks ignored pixels.
    - ``shapes3d``: generated volumes (spheres and boxes in noise) with their masks, an
      ``image_size`` cube (:mod:`parallelkit.data.shapes3d`).
    - ``segfolder3d``: ``root/{train,test|val}/images/*.npy`` volumes with
      ``masks/<name>.npy`` (:mod:`parallelkit.data.segfolder3d`), resized to an
      ``image_size`` cube; 255 marks ignored voxels.
    - ``zarr:DIR``, ``tiff:DIR``, ``nifti:DIR``, ``npy:DIR``: ``DIR/{train,test|val}/images``
      and ``masks`` in that format, read by blocks (:mod:`parallelkit.data.blockset`): a crop
      of ``image_size`` (random in training, the same on every rank of a sample), normalized
      as ``normalize`` says. ``dims``: 2 for images, 3 for volumes (NIfTI files are volumes
      whatever it says). Their own keys (see :func:`check_blocks`): ``normalize``,
      ``window``, ``percentiles``, ``flips``, ``rotate``, ``level``, ``foreground``,
      ``layout``.

    ``image_size`` is one integer (a square, or a cube for volumes), or for ``FORMAT:DIR``
    sources a list of per-dimension sizes, ``[H, W]`` or ``[D, H, W]``: read it through
    :func:`crop_shape`. It is typed ``Any`` because OmegaConf has no ``int | list[int]``.
    """

    name: str = "digits"
    root: str | None = None
    image_size: Any = 32  # int, or [H, W] / [D, H, W] for FORMAT:DIR: see crop_shape()
    channels: int = 3  # FORMAT:DIR: any count; other sources: 1 (grayscale) or 3 (RGB)
    num_classes: int = 10  # synthetic and those with masks; the other sources know their own
    train_samples: int = 1024  # synthetic, shapes, shapes3d
    test_samples: int = 256  # synthetic, shapes, shapes3d
    workers: int = 0  # DataLoader worker processes per rank
    shuffle: bool = True
    dims: int = 2  # FORMAT:DIR and your own sources: spatial dimensions of a sample (3: volumes)
    kwargs: dict[str, Any] = field(default_factory=dict)  # your own source's arguments
    # FORMAT:DIR sources only (the others keep these defaults):
    normalize: str = "zscore"  # zscore | window | percentile | none
    window: list[float] = field(default_factory=list)  # normalize=window: [low, high]
    percentiles: list[float] = field(default_factory=lambda: [0.5, 99.5])  # of each sample
    flips: list[int] = field(default_factory=list)  # spatial axes flipped at random (train)
    rotate: list[int] = field(default_factory=list)  # two spatial axes: random quarter turns
    level: int = 0  # pyramid level of OME-Zarr and TIFF samples (0: full resolution)
    foreground: float = 0.0  # fraction of training crops centred on a labelled voxel
    layout: str = ""  # the images' stored axes where a shape cannot tell, e.g. "ZCYX" (readers)
    crop: list[int] = field(default_factory=list)  # per axis, [D, H, W]; else image_size's
    crops_per_sample: int = 1  # training crops drawn from each sample per epoch

    @property
    def source(self) -> Source:
        """``name`` (and ``dims``) parsed: what every reader asks about the source. A
        ``DictConfig`` of these fields has no properties: code that may be given one reads
        ``parse_source(cfg.name, cfg.dims)``, the same object."""
        return parse_source(self.name, self.dims)


def crop_shape(cfg: DataConfig) -> tuple[int, ...]:
    """``data.image_size`` as one size per spatial dimension: ``(H, W)``, or ``(D, H, W)`` for
    volumes. An integer is a square (a cube); a list gives each dimension (``FORMAT:DIR``
    sources only). ``data.crop``, when set, gives the sizes per axis instead. A ``ValueError``
    naming the key for anything else."""
    source, size = parse_source(cfg.name, cfg.dims), cfg.image_size
    dims = source.dims
    if len(cfg.crop):  # data.crop, per axis, wins over the image_size shorthand
        if len(cfg.crop) != dims or not all(_positive_int(n) for n in cfg.crop):
            raise ValueError(f"data.crop={_show(cfg.crop)} must list {dims} positive sizes, "
                             f"{'[D, H, W]' if dims == 3 else '[H, W]'}")  # fmt: skip
        return tuple(int(n) for n in cfg.crop)
    if isinstance(size, Sequence) and not isinstance(size, str):
        if not source.is_block_folder:
            raise ValueError(
                f"data.image_size={list(size)}: a list of sizes is for data.name=FORMAT:DIR "
                f"sources; data.name={cfg.name} takes one integer (a square, or a cube)"
            )
        shape = tuple(size)
    else:
        shape = (size,) * dims
    if len(shape) != dims or not all(_positive_int(n) for n in shape):
        order = "[D, H, W]" if dims == 3 else "[H, W]"
        raise ValueError(
            f"data.image_size={_show(size)} must be a positive integer or a list of {dims} "
            f"positive integers, {order} ({dims}-D samples)"
        )
    return tuple(int(n) for n in shape)


def crop_key(cfg: DataConfig) -> str:
    """The key that sets the crop, as the user wrote it: ``data.crop=[...]`` when set, else
    ``data.image_size=...``, for messages."""
    if len(cfg.crop):
        return f"data.crop={_show(cfg.crop)}"
    return f"data.image_size={_show(cfg.image_size)}"


def _positive_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 1


def _show(value: object) -> str:
    return str(list(value)) if isinstance(value, Sequence) and not isinstance(value, str) else (
        repr(value) if isinstance(value, str) else str(value))  # fmt: skip


def check_config(cfg: DataConfig, split: str) -> Source:
    """Raise ``ValueError`` naming the field when ``cfg`` or ``split`` cannot work; else the
    source that ``data.name`` names, for the caller to read from.

    Called before any file is opened, with information every rank has, so every rank fails
    the same way before the first collective.
    """
    source = parse_source(cfg.name, cfg.dims)  # data.name's own mistakes come first
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    if not (source.is_block_folder or source.is_users_class) and cfg.channels not in (1, 3):
        raise ValueError(
            f"data.channels={cfg.channels} must be 1 (grayscale) or 3 (RGB) for "
            f"data.name={cfg.name}; any count is for FORMAT:DIR sources (zarr, tiff, nifti, npy)"
        )
    if cfg.channels < 1:
        raise ValueError(f"data.channels={cfg.channels} must be a positive integer")
    crop_shape(cfg)
    positive = {}
    if cfg.name in ("synthetic", "shapes", "shapes3d"):
        positive |= {
            "data.num_classes": cfg.num_classes,
            "data.train_samples": cfg.train_samples,
            "data.test_samples": cfg.test_samples,
        }
    for key, value in positive.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{key}={value} must be a positive integer")
    if source.kind == "set" and source.has_masks and not 2 <= cfg.num_classes <= 255:
        raise ValueError(
            f"data.num_classes={cfg.num_classes} must lie in 2..255 for {cfg.name} (the "
            "background counts; mask value 255 marks ignored pixels)"
        )
    check_blocks(cfg, source)
    if cfg.workers < 0:
        raise ValueError(f"data.workers={cfg.workers} must be >= 0")
    roots = ("imagefolder", "cifar10", "webdataset", "segfolder", "segfolder3d")
    if cfg.name in roots and not cfg.root:
        raise ValueError(f"data.name={cfg.name!r} needs data.root, the directory to read")
    return source


BLOCK_KEYS: dict[str, object] = {
    "normalize": "zscore", "window": [], "percentiles": [0.5, 99.5], "flips": [], "rotate": [],
    "level": 0, "foreground": 0.0, "layout": "", "crop": [], "crops_per_sample": 1,
}  # fmt: skip
"""Keys of ``FORMAT:DIR`` sources alone, and the defaults that the other sources keep."""


def check_blocks(cfg: DataConfig, source: Source) -> None:
    """The keys of ``FORMAT:DIR`` sources (``normalize``, ``window``, ``percentiles``,
    ``flips``, ``rotate``, ``level``, ``foreground``, ``layout``): one-line ``ValueError``
    naming the key; the other sources must keep their defaults."""
    if not source.is_block_folder:
        for key, default in BLOCK_KEYS.items():
            value = getattr(cfg, key)
            if (list(value) if isinstance(value, Sequence) and not isinstance(value, str)
                    else value) != default:  # fmt: skip
                raise ValueError(
                    f"data.{key}={_show(value)} is for data.name=FORMAT:DIR sources (zarr, "
                    f"tiff, nifti, npy); data.name={cfg.name} takes data.{key}={_show(default)}"
                )
        return
    if cfg.normalize not in NORMALIZATIONS:
        raise ValueError(
            f"data.normalize={cfg.normalize!r} must be one of {', '.join(NORMALIZATIONS)}"
        )
    window = _numbers(cfg.window)
    if cfg.normalize == "window" and (window is None or len(window) != 2
                                      or not window[0] < window[1]):  # fmt: skip
        raise ValueError(
            f"data.normalize=window needs data.window=[low, high] with low < high (CT in "
            f"Hounsfield units: [-1000, 400]), not data.window={_show(cfg.window)}"
        )
    if cfg.normalize != "window" and window != []:
        raise ValueError(
            f"data.window={_show(cfg.window)} is used by data.normalize=window alone, and "
            f"data.normalize={cfg.normalize}; set one, or drop data.window"
        )
    p = _numbers(cfg.percentiles)
    if p is None or len(p) != 2 or not 0 <= p[0] < p[1] <= 100:
        raise ValueError(
            f"data.percentiles={_show(cfg.percentiles)} must be [low, high] with "
            "0 <= low < high <= 100 (default [0.5, 99.5])"
        )
    dims = source.dims
    named = f"in 0..{dims - 1} ({'D, H, W' if dims == 3 else 'H, W'})"
    if _distinct_axes(cfg.flips, dims) is None:
        raise ValueError(
            f"data.flips={_show(cfg.flips)} must list distinct spatial axes of the {dims}-D "
            f"samples, each {named}, or be []"
        )
    if (rotate := _distinct_axes(cfg.rotate, dims)) is None or len(rotate) not in (0, 2):
        raise ValueError(
            f"data.rotate={_show(cfg.rotate)} must name the plane of the quarter turns, two "
            f"distinct spatial axes {named}, or be []"
        )
    if not isinstance(cfg.level, Integral) or cfg.level < 0:
        raise ValueError(f"data.level={cfg.level} must be a pyramid level, 0 or more")
    if not 0 <= cfg.foreground <= 1:
        raise ValueError(
            f"data.foreground={cfg.foreground} must be a fraction of the crops, in [0, 1]"
        )
    if not isinstance(cfg.crops_per_sample, Integral) or cfg.crops_per_sample < 1:
        raise ValueError(f"data.crops_per_sample={cfg.crops_per_sample} must be 1 or more")
    crop_shape(cfg)  # data.crop's length and sizes


def _distinct_axes(value: object, dims: int) -> list[int] | None:
    """``value`` as a list of distinct spatial axes of ``dims``-D samples, or None where it is
    not one."""
    axes = list(value) if isinstance(value, Sequence) else None
    if axes is None or len(set(axes)) != len(axes):
        return None
    return axes if all(isinstance(a, Integral) and 0 <= a < dims for a in axes) else None


def _numbers(value: object) -> list[float] | None:
    """``value`` as a list of real numbers, or None where it is not one."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return None
    if not all(isinstance(v, Real) and not isinstance(v, bool) for v in value):
        return None
    return [float(v) for v in value]
