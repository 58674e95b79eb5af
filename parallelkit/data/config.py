"""The data section of a training config, and its checks.

A plain dataclass of plain types, so that it can sit inside an OmegaConf structured config
(``OmegaConf.structured(TrainConfig)``) and be overridden from the command line
(``data.name=synthetic data.image_size=256``). Everything that reads it accepts a
``DataConfig`` or an OmegaConf ``DictConfig`` of the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

DATASETS: tuple[str, ...] = (
    "digits", "synthetic", "imagefolder", "cifar10", "webdataset", "shapes", "segfolder",
    "shapes3d", "segfolder3d",
)  # fmt: skip
WITH_MASKS: tuple[str, ...] = ("shapes", "segfolder", "shapes3d", "segfolder3d")
VOLUMES: tuple[str, ...] = ("shapes3d", "segfolder3d")
"""Sources of volumes (C, D, H, W), each ``image_size`` on a side; the others give images."""
"""Sources whose samples are (image, mask); ``webdataset`` shards may hold either."""
SPLITS: tuple[str, ...] = ("train", "test")
BLOCK_FORMATS: tuple[str, ...] = ("zarr", "tiff", "nifti", "npy")
"""``data.name=FORMAT:DIR``: a folder of images and masks read by blocks (see
:mod:`parallelkit.data.blockset`): under spatial parallelism each rank reads only its block
of every sample, and nothing whole is ever held."""


def block_format(name: str) -> str | None:
    """The format of a ``FORMAT:DIR`` data name (one of :data:`BLOCK_FORMATS`), else None."""
    kind, sep, _ = name.partition(":")
    return kind if sep and kind in BLOCK_FORMATS else None


def block_root(name: str) -> str:
    """The directory of a ``FORMAT:DIR`` data name."""
    return name.partition(":")[2]


def has_masks(name: str) -> bool:
    """Whether the source ``name`` gives (image, mask) samples."""
    return name in WITH_MASKS or block_format(name) is not None


def volumes(cfg: DataConfig) -> bool:
    """Whether ``cfg``'s samples are volumes (C, D, H, W) rather than images."""
    if cfg.name in VOLUMES:
        return True
    kind = block_format(cfg.name)
    return kind is not None and (kind == "nifti" or cfg.dims == 3)


@dataclass
class DataConfig:
    """Which images to train on and how each rank loads them.

    ``name`` picks the source:

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
      of ``image_size`` on every side (random in training, the same on every rank of a
      sample), normalized by the training images' per-channel statistics. ``dims``: 2 for
      images, 3 for volumes (NIfTI files are volumes whatever it says).
    """

    name: str = "digits"
    root: str | None = None
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10  # synthetic and those with masks; the other sources know their own
    train_samples: int = 1024  # synthetic, shapes, shapes3d
    test_samples: int = 256  # synthetic, shapes, shapes3d
    workers: int = 0  # DataLoader worker processes per rank
    shuffle: bool = True
    dims: int = 2  # FORMAT:DIR sources: spatial dimensions of a sample (3: volumes)


def check_config(cfg: DataConfig, split: str) -> None:
    """Raise ``ValueError`` naming the field when ``cfg`` or ``split`` cannot work.

    Called before any file is opened, with information every rank has, so every rank fails
    the same way before the first collective.
    """
    if cfg.name not in DATASETS and block_format(cfg.name) is None:
        raise ValueError(
            f"data.name={cfg.name!r} is not one of {', '.join(DATASETS)}, or FORMAT:DIR with "
            f"FORMAT one of {', '.join(BLOCK_FORMATS)}"
        )
    if block_format(cfg.name) and (not block_root(cfg.name) or cfg.dims not in (2, 3)):
        raise ValueError(
            f"data.name={cfg.name!r} needs a directory after the colon, and data.dims "
            f"(now {cfg.dims}) 2 for images or 3 for volumes"
        )
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    if cfg.channels not in (1, 3):
        raise ValueError(f"data.channels={cfg.channels} must be 1 (grayscale) or 3 (RGB)")
    positive = {"data.image_size": cfg.image_size}
    if cfg.name in ("synthetic", "shapes", "shapes3d"):
        positive |= {
            "data.num_classes": cfg.num_classes,
            "data.train_samples": cfg.train_samples,
            "data.test_samples": cfg.test_samples,
        }
    for key, value in positive.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{key}={value} must be a positive integer")
    if cfg.name in WITH_MASKS and not 2 <= cfg.num_classes <= 255:
        raise ValueError(
            f"data.num_classes={cfg.num_classes} must lie in 2..255 for {cfg.name} (the "
            "background counts; mask value 255 marks ignored pixels)"
        )
    if cfg.workers < 0:
        raise ValueError(f"data.workers={cfg.workers} must be >= 0")
    roots = ("imagefolder", "cifar10", "webdataset", "segfolder", "segfolder3d")
    if cfg.name in roots and not cfg.root:
        raise ValueError(f"data.name={cfg.name!r} needs data.root, the directory to read")
