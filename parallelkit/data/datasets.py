"""Map-style image datasets: digits, synthetic, image folders and CIFAR-10 batches.

Every dataset here returns ``(image, label)`` with ``image`` a float32 ``(C, S, S)`` tensor
normalised by :func:`~parallelkit.data.pixels.normalize` (pixel values in [0, 1] mapped to
[-1, 1], the range DCGAN's tanh output produces too) and ``label`` an ``int``, and knows
``num_classes``, ``channels`` and ``image_size``. Images are converted to the configured size
and channel count when they are read (:func:`~parallelkit.data.pixels.fit`), never all at once,
so a 1024x1024 configuration does not fill memory. :func:`load_dataset` opens any of them, and
the data sets with masks (:mod:`parallelkit.data.shapes`, :mod:`parallelkit.data.segfolder`,
and their volume counterparts :mod:`parallelkit.data.shapes3d` and
:mod:`parallelkit.data.segfolder3d`), by ``data.name``.

None of them downloads anything: digits ship with scikit-learn, synthetic images are
generated, and image folders or CIFAR-10 batches are read from a directory the user has.
Torchvision is deliberately not a dependency; the little it would give is written here.
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from parallelkit.data.config import DataConfig, check_config
from parallelkit.data.pixels import IMAGE_EXTENSIONS, fit, normalize, read_image
from parallelkit.data.segfolder import SegFolderDataset
from parallelkit.data.segfolder3d import VolumeFolderDataset
from parallelkit.data.shapes import ShapesDataset
from parallelkit.data.shapes3d import ShapesVolumeDataset

DIGITS_SPLIT_SEED = 0
"""The digits train/test split is fixed (not the run's seed): every run tests the same images."""
SYNTHETIC_BASE = {"train": 0, "test": 1 << 31}
"""Per-split offsets of the synthetic generators' seeds, so train and test images differ.

torch's CPU generator keeps only the low 32 bits of a seed, so each split gets 2**31 seeds.
"""
CIFAR10_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


class DigitsDataset(Dataset):
    """scikit-learn's 8x8 digits (values 0..16), a fixed 80/20 split, upscaled on access.

    The split is the one ``examples/digits_allreduce`` uses: a permutation seeded with
    :data:`DIGITS_SPLIT_SEED`, its first fifth the test set (359 images), the rest train (1,438).
    """

    num_classes = 10

    def __init__(self, split: str, image_size: int = 32, channels: int = 3) -> None:
        images, labels = _digits()
        split_rng = torch.Generator().manual_seed(DIGITS_SPLIT_SEED)
        order = torch.randperm(len(labels), generator=split_rng)
        n_test = len(labels) // 5
        keep = order[:n_test] if split == "test" else order[n_test:]
        self.indices = keep  # rows of load_digits(), for tests and provenance
        self.images = images[keep]  # N 1 8 8, in [0, 1]
        self.labels = labels[keep]
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = fit(self.images[index], self.image_size, self.channels)
        return normalize(image), int(self.labels[index])


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits in ``load_digits()``'s order: (N, 1, 8, 8) in [0, 1], and the labels.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixel
    values and the label per row, what ``load_digits`` parses), found without importing
    scikit-learn: its import (scipy and more) cost every process of a run about a second, the
    launcher's check and each rank alike. Where the file is not there, ``load_digits`` reads it.
    """
    spec = importlib.util.find_spec("sklearn")  # scikit-learn is an optional dependency
    if spec is None or spec.origin is None:
        raise ImportError("data.name=digits needs scikit-learn: pip install scikit-learn")
    shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if shipped.is_file():
        rows = np.loadtxt(shipped, delimiter=",")
        pixels, target = rows[:, :-1], rows[:, -1]
    else:
        from sklearn.datasets import load_digits

        pixels, target = load_digits(return_X_y=True)
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return images, torch.tensor(target, dtype=torch.int64)


class SyntheticDataset(Dataset):
    """``length`` random images, each a pure function of ``(base, index)``, made on access.

    Nothing is stored, so any size and resolution fits; every rank and every DataLoader worker
    sees the same image for the same index. Labels are learnable: each class shifts the mean
    of Gaussian noise by a different amount in [-0.5, 0.5], so benchmarks train on real signal.
    """

    def __init__(
        self, length: int, image_size: int = 32, channels: int = 3, num_classes: int = 10,
        base: int = 0,
    ) -> None:  # fmt: skip
        if not 0 <= length <= 1 << 31:
            raise ValueError(f"synthetic: {length} images; at most 2**31 are distinct")
        self.length, self.image_size, self.channels = length, image_size, channels
        self.num_classes, self.base = num_classes, base

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} synthetic images")
        g = torch.Generator().manual_seed((self.base + index) % (1 << 32))
        label = int(torch.randint(self.num_classes, (), generator=g))
        shift = label / (self.num_classes - 1) - 0.5 if self.num_classes > 1 else 0.0
        size = (self.channels, self.image_size, self.image_size)
        return torch.randn(size, generator=g) + shift, label


class ImageFolderDataset(Dataset):
    """``root/<split dir>/<class>/<image>``; classes are the sorted subdirectories of train.

    The test split reads ``root/test``, else ``root/val``. Labels come from the train
    directory's classes (when it exists), so a class missing from the test directory does not
    shift the labels of the others. Images are opened on access; one that PIL cannot read
    raises ``ValueError`` naming the file.
    """

    def __init__(self, root: str, split: str, image_size: int = 32, channels: int = 3) -> None:
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"imagefolder: data.root {root!r} is not a directory")
        names = ("train",) if split == "train" else ("test", "val")
        dirs = [base / n for n in names if (base / n).is_dir()]
        if not dirs:
            tried = " or ".join(str(base / n) for n in names)
            raise ValueError(f"imagefolder: no {split} directory: expected {tried}")
        split_dir = dirs[0]
        class_dir = base / "train" if (base / "train").is_dir() else split_dir
        self.classes = sorted(d.name for d in class_dir.iterdir() if d.is_dir())
        present = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
        unknown = sorted(set(present) - set(self.classes))
        if unknown:
            raise ValueError(
                f"imagefolder: {split_dir} has classes {unknown} that {class_dir} lacks"
            )
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            if (split_dir / name).is_dir()
            for path in sorted((split_dir / name).iterdir())
            if path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        if not self.samples:
            raise ValueError(
                f"imagefolder: no images ({', '.join(IMAGE_EXTENSIONS)}) in the class "
                f"subdirectories of {split_dir}"
            )
        self.num_classes = len(self.classes)
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        image = fit(read_image(path, self.channels), self.image_size, self.channels)
        return normalize(image), label


class Cifar10Dataset(Dataset):
    """CIFAR-10 from its python-batch directory (``cifar-10-batches-py``), held as uint8.

    Reads ``data_batch_1`` .. ``data_batch_5`` (train) or ``test_batch`` (test): pickles of
    ``{b"data": uint8 (N, 3072), b"labels": [N ints]}``. These are pickles, so only point
    ``data.root`` at files you trust. Never downloads: without the files it raises
    ``ValueError`` naming the missing ones.
    """

    num_classes = 10

    def __init__(self, root: str, split: str, image_size: int = 32, channels: int = 3) -> None:
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"cifar10: data.root {root!r} is not a directory")
        paths = [base / name for name in CIFAR10_FILES[split]]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ValueError(
                f"cifar10: missing {', '.join(missing)}; data.root must be the "
                "cifar-10-batches-py directory of the python version of CIFAR-10"
            )
        parts = [_cifar_batch(p) for p in paths]
        self.images = np.concatenate([x for x, _ in parts]).reshape(-1, 3, 32, 32)
        self.labels = np.concatenate([y for _, y in parts])
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(self.images[index]).float() / 255.0
        return normalize(fit(image, self.image_size, self.channels)), int(self.labels[index])


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch.get(b"data", batch.get("data")), dtype=np.uint8)
        labels = np.asarray(batch.get(b"labels", batch.get("labels")), dtype=np.int64)
    except Exception as err:  # unpickling garbage can raise almost anything
        raise ValueError(f"cifar10: cannot read batch file {path}: {err}") from err
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise ValueError(
            f"cifar10: {path} holds data of shape {data.shape} and {labels.size} labels; "
            "expected (N, 3072) uint8 and N labels"
        )
    return data, labels


def load_dataset(cfg: DataConfig, split: str, window: tuple[slice, ...] | None = None) -> Dataset:
    """The map-style dataset ``cfg`` names, for ``split`` ("train" or "test").

    ``window``: for sources with masks, the (rows, cols) of every mask to return (this rank's
    block under spatial parallelism; for volumes (D, H, W) slices, or (H, W) with all of D);
    images stay whole. WebDataset shards are streamed, not
    indexed: use :func:`parallelkit.data.build_loader`.
    """
    check_config(cfg, split)
    return open_dataset(cfg, split, window)


def open_dataset(cfg: DataConfig, split: str, window: tuple[slice, ...] | None) -> Dataset:
    """:func:`load_dataset` of a ``cfg`` checked already (``build_loader`` checks it once)."""
    size, channels = cfg.image_size, cfg.channels
    if cfg.name == "shapes":
        length = cfg.train_samples if split == "train" else cfg.test_samples
        base = SYNTHETIC_BASE[split]
        return ShapesDataset(length, size, channels, cfg.num_classes, base, window)
    if cfg.name == "segfolder":
        return SegFolderDataset(str(cfg.root), split, size, channels, cfg.num_classes, window)
    if cfg.name == "shapes3d":
        length = cfg.train_samples if split == "train" else cfg.test_samples
        base = SYNTHETIC_BASE[split]
        return ShapesVolumeDataset(length, size, channels, cfg.num_classes, base, window)
    if cfg.name == "segfolder3d":
        root = str(cfg.root)
        return VolumeFolderDataset(root, split, size, channels, cfg.num_classes, window)
    if cfg.name == "digits":
        return DigitsDataset(split, size, channels)
    if cfg.name == "synthetic":
        length = cfg.train_samples if split == "train" else cfg.test_samples
        return SyntheticDataset(length, size, channels, cfg.num_classes, SYNTHETIC_BASE[split])
    if cfg.name == "imagefolder":
        return ImageFolderDataset(str(cfg.root), split, size, channels)
    if cfg.name == "cifar10":
        return Cifar10Dataset(str(cfg.root), split, size, channels)
    raise ValueError(
        f"data.name={cfg.name!r} is streamed from tar shards and has no map-style dataset; "
        "use parallelkit.data.build_loader"
    )
