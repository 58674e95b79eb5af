"""WebDataset tar shards on disk: writing them, their manifest, and reading samples back.

A shard directory holds ``<split>-000000.tar``, ``<split>-000001.tar``, ... and
``manifest.json``. Each sample is two tar members sharing a key (the sample's index in the
source dataset): ``<key>.png`` or ``<key>.npy`` (the image) and ``<key>.cls`` (the label in
ASCII). The manifest records, per split, every shard's file and sample count plus the image
geometry and encoding::

    {"format": "parallelkit-shards", "version": 1,
     "splits": {"train": {"shards": [{"file": "train-000000.tar", "samples": 512}, ...],
                          "samples": 1438, "image_size": 32, "channels": 3,
                          "num_classes": 10, "encoding": "png", "masks": false},
               "test": {...}}}

The counts are what let every rank compute, without communicating, how many batches every
other rank will produce (see ``shardstream``); they also let a reader notice a shard that ends
early instead of silently yielding fewer samples.

Encodings: ``png`` stores 8-bit pixels (lossless for 8-bit sources such as image folders and
CIFAR-10 at their own size, about 1/255 of quantisation otherwise, and several times smaller);
``npy`` stores the float32 tensor exactly (needed for synthetic Gaussian images, whose values
fall outside what 8 bits hold). Masks are always PNG: lossless for labels below 256.
Reading and writing go through the ``webdataset`` package.

Under spatial parallelism a rank needs only its block of each mask, but a PNG inflates row by
row from the top and PIL decodes whole images, so the mask is decoded whole and then cropped
(``decode_sample``'s ``window``); every rank of a spatial group reads the same tar bytes.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from parallelkit.data.pixels import denormalize, fit, from_uint8, normalize
from parallelkit.data.segfolder import check_labels, fit_mask

MANIFEST = "manifest.json"
FORMAT = "parallelkit-shards"
VERSION = 1
ENCODINGS = ("png", "npy")
TAR_BLOCK = 512


class ShardError(ValueError):
    """A shard is missing, corrupt or disagrees with its manifest; the message names the file."""


@dataclass(frozen=True)
class SplitShards:
    """One split of a shard directory, as its manifest describes it."""

    files: tuple[str, ...]  # paths of the shards, in manifest order
    counts: tuple[int, ...]  # samples in each shard
    image_size: int
    channels: int
    num_classes: int
    encoding: str
    masks: bool = False  # samples hold masks (segmentation) instead of labels

    @property
    def num_samples(self) -> int:
        return sum(self.counts)


# ----------------------------------------------------------------------------- writing
def write_shards(
    dataset: Dataset,
    out_dir: str,
    samples_per_shard: int,
    prefix: str,
    *,
    encoding: str = "png",
    shuffle_seed: int | None = 0,
) -> list[str]:
    """Write ``dataset``'s ``(image, label)`` samples to ``out_dir/<prefix>-NNNNNN.tar``.

    ``image`` is a normalised ``(C, S, S)`` tensor as the datasets here return; ``label`` an
    int, or an ``(S, S)`` integer mask (then every sample must have one). Samples are
    written in a permutation seeded by ``shuffle_seed`` (``None``: dataset order), because the
    loader shuffles only shards and a window of samples: a class-sorted image folder written in
    order would give single-class batches. ``prefix`` is the split ("train", "test") and
    becomes that split's entry in ``out_dir/manifest.json`` (other splits there are kept).
    Returns the shard paths.
    """
    import webdataset as wds

    n = len(dataset)  # type: ignore[arg-type]
    if encoding not in ENCODINGS:
        raise ValueError(f"write_shards: encoding={encoding!r} must be one of {ENCODINGS}")
    if samples_per_shard < 1:
        raise ValueError(f"write_shards: samples_per_shard={samples_per_shard} must be >= 1")
    if n == 0:
        raise ValueError(f"write_shards: the {prefix} dataset is empty")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if shuffle_seed is None:
        order = list(range(n))
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    pattern = str(out / prefix).replace("%", "%%") + "-%06d.tar"
    counts = [min(samples_per_shard, n - i) for i in range(0, n, samples_per_shard)]
    first, first_label = dataset[order[0]]
    masks = isinstance(first_label, torch.Tensor) and first_label.dim() == 2
    if first.dim() != 3 or first.shape[1] != first.shape[2] or first.shape[0] not in (1, 3):
        raise ValueError(
            f"write_shards: images must be (C, S, S) with C 1 or 3, got {tuple(first.shape)}"
        )
    labels_max = 0
    # mtime=0: the same data gives byte-identical shards.
    writer = wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0, mtime=0, encoder=False)
    with writer as w:
        for index in order:
            image, label = dataset[index]
            if tuple(image.shape) != tuple(first.shape):
                raise ValueError(
                    f"write_shards: sample {index} has shape {tuple(image.shape)}, the first "
                    f"{tuple(first.shape)}; all images of a split must share one shape"
                )
            if masks:
                labels_max = max(labels_max, _check_mask(label, image, index))
            else:
                labels_max = max(labels_max, int(label))
                label = int(label)
            w.write(encode_sample(image, label, encoding, f"{index:09d}"))
    files = [pattern % i for i in range(len(counts))]
    assert all(os.path.isfile(f) for f in files), "ShardWriter named its shards differently"
    channels, height, _ = first.shape
    split = {
        "shards": [
            {"file": Path(f).name, "samples": c} for f, c in zip(files, counts, strict=True)
        ],
        "samples": n,
        "image_size": int(height),
        "channels": int(channels),
        "num_classes": int(getattr(dataset, "num_classes", labels_max + 1)),
        "encoding": encoding,
        "masks": masks,
    }
    _update_manifest(out, prefix, split)
    return files


def _check_mask(mask: Any, image: torch.Tensor, index: int) -> int:
    """The largest class label of sample ``index``'s mask, after checking its shape."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(image.shape[1:]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"write_shards: sample {index} has mask {got}; expected {tuple(image.shape[1:])}, "
            "the image's height and width (and every sample of a split a mask)"
        )
    if mask.min() < 0 or mask.max() > 255:
        raise ValueError(f"write_shards: sample {index}'s mask has labels outside 0..255")
    labels = mask[mask != 255]
    return int(labels.max()) if labels.numel() else 0


def encode_sample(
    image: torch.Tensor, label: int | torch.Tensor, encoding: str, key: str
) -> dict[str, Any]:
    """The tar members of one sample: ``{"__key__", "png" | "npy", "cls" | "mask.png"}`` as
    bytes (``mask.png`` when ``label`` is an ``(H, W)`` mask)."""
    buf = io.BytesIO()
    if encoding == "npy":
        np.save(buf, image.detach().cpu().numpy().astype(np.float32), allow_pickle=False)
    else:
        from PIL import Image

        x01 = denormalize(image.detach().cpu().float())
        if x01.min() < -1e-3 or x01.max() > 1 + 1e-3:
            raise ValueError(
                f"write_shards: sample {key} has values outside what 8-bit PNG holds "
                f"(normalised range [{image.min():.3g}, {image.max():.3g}], expected [-1, 1]); "
                "write it with encoding='npy'"
            )
        pixels = (x01 * 255).round().clamp(0, 255).to(torch.uint8)
        array = pixels[0].numpy() if pixels.shape[0] == 1 else pixels.permute(1, 2, 0).numpy()
        Image.fromarray(array).save(buf, format="PNG")
    if isinstance(label, torch.Tensor):
        return {"__key__": key, encoding: buf.getvalue(), "mask.png": _png(label)}
    return {"__key__": key, encoding: buf.getvalue(), "cls": str(label).encode("ascii")}


def _png(mask: torch.Tensor) -> bytes:
    """An ``(H, W)`` mask of labels 0..255 as one-channel 8-bit PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(mask.to(torch.uint8).numpy(), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _update_manifest(out: Path, split: str, entry: dict[str, Any]) -> None:
    path = out / MANIFEST
    manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "splits": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("format") == FORMAT:
                manifest["splits"] = old.get("splits", {})
        except (OSError, ValueError):
            pass  # an unreadable old manifest is replaced
    manifest["splits"][split] = entry
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)  # readers never see half a manifest


# ----------------------------------------------------------------------------- reading
def load_split(root: str, split: str) -> SplitShards:
    """``split``'s entry of ``root/manifest.json``; ``ValueError`` naming what is wrong."""
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise ValueError(f"webdataset: data.root {root!r} is not a directory")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"webdataset: {path} not found; write shards with `parallelkit data shard SRC {root}`"
        ) from None
    except (OSError, ValueError) as err:
        raise ValueError(f"webdataset: cannot read manifest {path}: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"webdataset: {path} is not a parallelkit shard manifest")
    entry = manifest.get("splits", {}).get(split)
    if entry is None:
        raise ValueError(f"webdataset: {path} has no {split!r} split")
    try:
        shards = SplitShards(
            files=tuple(str(Path(root) / s["file"]) for s in entry["shards"]),
            counts=tuple(int(s["samples"]) for s in entry["shards"]),
            image_size=int(entry["image_size"]),
            channels=int(entry["channels"]),
            num_classes=int(entry["num_classes"]),
            encoding=str(entry["encoding"]),
            masks=bool(entry.get("masks", False)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"webdataset: {path}: malformed {split!r} entry ({err!r})") from err
    if shards.encoding not in ENCODINGS or min(shards.counts, default=0) < 1:
        raise ValueError(f"webdataset: {path}: bad encoding or shard counts in {split!r}")
    return shards


def check_shards(shards: SplitShards) -> None:
    """Raise :class:`ShardError` for a missing, empty, truncated or non-tar shard.

    Cheap (a stat and one 512-byte read per shard) and run for *all* shards on every rank
    before training, so every rank stops with the same error instead of one rank failing
    mid-epoch while the others wait for it in a collective. Damage deeper inside a file is
    caught when it is read (:func:`read_samples`).
    """
    for path in shards.files:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(TAR_BLOCK)
        except OSError as err:
            raise ShardError(f"shard {path} cannot be opened: {err.strerror or err}") from err
        if size == 0 or size % TAR_BLOCK:
            raise ShardError(
                f"shard {path} is truncated or not a tar file: its {size} bytes are not a "
                f"whole number of {TAR_BLOCK}-byte tar blocks"
            )
        try:
            tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        except tarfile.TarError as err:
            raise ShardError(f"shard {path} is not a tar file (first header: {err})") from err


def read_samples(path: str, start: int, stop: int) -> Iterator[dict[str, Any]]:
    """Samples ``start .. stop-1`` of the shard at ``path`` as raw ``{"__key__", ext: bytes}``.

    Earlier samples are read past but not decoded. Any tar error, and a shard that ends before
    ``stop`` (it holds fewer samples than its manifest says), raises :class:`ShardError` naming
    the file: a rank that silently produced fewer batches would leave the others waiting.
    """
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    def members(f: Any) -> Iterator[dict[str, Any]]:
        for member in tar_file_iterator(f):
            member["__url__"] = path
            yield member

    seen = 0
    try:
        with open(path, "rb") as f:
            for sample in group_by_keys(members(f)):
                if seen >= start:
                    yield sample
                seen += 1
                if seen >= stop:
                    return
    except (tarfile.TarError, OSError, EOFError, ValueError) as err:
        # webdataset appends " @ <file object>" to tar errors; the path is named below.
        reason = str(err.args[0]).split(" @ ")[0] if err.args else type(err).__name__
        raise ShardError(f"corrupt shard {path} (after {seen} samples): {reason}") from err
    raise ShardError(
        f"shard {path} ends after {seen} samples but its manifest promises at least {stop}: "
        "the file is truncated or the manifest is stale (write the shards again)"
    )


def decode_sample(
    sample: dict[str, Any],
    shards: SplitShards,
    image_size: int,
    channels: int,
    window: tuple[slice, slice] | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """A raw sample as ``(normalised (channels, S, S) float32 image, label)``; for shards with
    masks the label is the ``(S, S)`` int64 mask, or its ``window`` (rows, cols)."""
    where = f"shard {sample.get('__url__')}, sample {sample.get('__key__')}"
    target = "mask.png" if shards.masks else "cls"
    data, cls = sample.get(shards.encoding), sample.get(target)
    if data is None or cls is None:
        raise ShardError(
            f"{where}: needs .{shards.encoding} and .{target} members, has {list(sample)}"
        )
    try:
        label = _decode_mask(cls, shards, image_size, window, where) if shards.masks else int(cls)
        if shards.encoding == "npy":
            image = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
            return fit(image.float(), image_size, channels), label
        from PIL import Image

        with Image.open(io.BytesIO(data)) as png:
            x01 = from_uint8(np.asarray(png))
    except (OSError, SyntaxError, ValueError) as err:
        raise ShardError(f"{where}: cannot decode: {err}") from err
    return normalize(fit(x01, image_size, channels)), label


def _decode_mask(
    data: bytes, shards: SplitShards, size: int, window: tuple[slice, slice] | None, where: str
) -> torch.Tensor:
    """The mask member: decoded whole (PNG cannot be decoded by rows), checked, cropped."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as png:
        mask = torch.from_numpy(np.array(png, dtype=np.int64))
    mask = fit_mask(check_labels(mask, shards.num_classes, where), size)
    return mask[window] if window is not None else mask
