"""Sample lists in JSON: the Medical Segmentation Decathlon's ``dataset.json``, and MONAI's
datalists.

Why: medical data sets seldom come as ``train/images`` and ``train/masks`` folders. The
Decathlon's tasks (and nnU-Net's raw data) ship ``imagesTr/``, ``labelsTr/`` and a
``dataset.json`` listing the pairs; MONAI users keep a datalist JSON of their own splits
(``monai.data.load_decathlon_datalist`` reads both). A block folder (``data.name=nifti:DIR``, any
block format) is read from such a list when ``DIR/dataset.json`` exists and ``DIR/train/images``
does not (a MONAI datalist saved there as ``dataset.json`` too)::

    {"training":   [{"image": "./imagesTr/a.nii.gz", "label": "./labelsTr/a.nii.gz"}, ...],
     "validation": [{"image": ..., "label": ...}, ...],          (optional)
     "test":       ["./imagesTs/b.nii.gz", ...]}                 (unlabelled: not used)

Paths are relative to the JSON file's folder (as MONAI's ``base_dir`` default). The training
split is ``training``; the test split, which needs labels to be scored, is ``validation`` when
the file has one, and otherwise every fifth entry of ``training`` (the 5th, 10th, ...), held
out of the training split: the same split for every run and rank, said in the run's log by the
sample counts.
"""

from __future__ import annotations

import json
from pathlib import Path

HOLD_OUT = 5
"""Without a ``validation`` list, every ``HOLD_OUT``-th training entry is a test sample."""


def find(root: str | Path) -> Path | None:
    """The JSON list to read for a block folder ``root``: ``root/dataset.json`` when ``root``
    has no ``train/images`` folder; None: read the folders."""
    listing = Path(root) / "dataset.json"
    return listing if listing.is_file() and not (Path(root) / "train" / "images").is_dir() else None


def pairs(listing: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, label) paths of ``split`` (``train`` or ``test``) from a JSON list; a
    ``ValueError`` naming the file for a list that cannot be read or a file that is missing."""
    try:
        content = json.loads(listing.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"data list {listing}: cannot be read as JSON ({e})") from None
    training = _entries(content, "training", listing)
    if "validation" in content:
        chosen = training if split == "train" else _entries(content, "validation", listing)
    else:
        held = [i % HOLD_OUT == HOLD_OUT - 1 for i in range(len(training))]
        chosen = [e for e, h in zip(training, held, strict=True) if h == (split == "test")]
    if not chosen:
        what = "validation" if "validation" in content else f"every {HOLD_OUT}th training entry"
        raise ValueError(f"data list {listing}: no {split} samples ({what})")
    base = listing.parent
    out = [((base / image).resolve(), (base / label).resolve()) for image, label in chosen]
    if missing := [p for pair in out for p in pair if not p.exists()]:
        raise ValueError(f"data list {listing}: {missing[0]} does not exist ({len(missing)} "
                         "missing)")  # fmt: skip
    return out


def _entries(content: object, key: str, listing: Path) -> list[tuple[str, str]]:
    """The ``key`` list's (image, label) pairs."""
    entries = content.get(key) if isinstance(content, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("image"), str) and isinstance(e.get("label"), str)
        for e in entries
    ):
        raise ValueError(
            f"data list {listing}: {key!r} must be a list of {{\"image\": PATH, \"label\": "
            "PATH}} entries (the Decathlon's dataset.json, or a MONAI datalist)"
        )
    return [(e["image"], e["label"]) for e in entries]
