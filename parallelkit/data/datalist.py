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
out of the training split: the same split for every run and rank, named with its rule in the
run's header (:func:`rule`).

The Decathlon's own test cases (``test``, ``imagesTs/``) have no labels and are not trained
or scored on; ``parallelkit predict`` predicts them by default (:func:`test_images`), scored
where a ``labelsTs/`` folder holds their labels.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallelkit.data.source import Source

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


TEST_IMAGES, TEST_LABELS = "imagesTs", "labelsTs"


def rule(listing: Path) -> str:
    """The test split of a JSON list and how it was chosen, for the run's header."""
    try:
        content = json.loads(Path(listing).read_text())
        count = len(content.get("training", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return f"test split: from {listing}"
    if "validation" in content:
        return (f"test split: the {len(content['validation'])} cases of the 'validation' list of "
                f"{listing}")
    held = count // HOLD_OUT
    return (f"test split: {held} of the {count} 'training' cases of {listing}, every "
            f"{HOLD_OUT}th (the {HOLD_OUT}th, {2 * HOLD_OUT}th, ...), held out of training (no "
            "'validation' list)")


def split_note(source: Source) -> str:
    """For the run's header: the test split of the block folder ``source`` and its rule where
    it is a JSON list (:func:`rule`); '' otherwise."""
    if not source.is_block_folder or (listing := find(source.root)) is None:
        return ""
    return rule(listing)


def test_images(listing: Path) -> list[tuple[Path, Path | None]]:
    """The Decathlon's test cases: the list's ``test`` entries (paths, or ``{"image": PATH}``)
    where it has any, else the files of ``imagesTs/`` beside it; each with its label in
    ``labelsTs/`` (the same file name) where there is one. [] when there are none."""
    from parallelkit.data.arrays import format_of

    base = Path(listing).parent
    try:
        entries = json.loads(Path(listing).read_text()).get("test") or []
    except (OSError, ValueError, AttributeError):
        entries = []
    images = [base / (e["image"] if isinstance(e, dict) else e) for e in entries
              if isinstance(e, str | dict) and (isinstance(e, str) or "image" in e)]
    if not images and (base / TEST_IMAGES).is_dir():
        images = sorted(p for p in (base / TEST_IMAGES).iterdir()
                        if format_of(p) and not p.name.startswith("."))
    images = [p.resolve() for p in images]
    if missing := [p for p in images if not p.exists()]:
        raise ValueError(f"data list {listing}: test image {missing[0]} does not exist "
                         f"({len(missing)} missing)")
    labels = base / TEST_LABELS
    return [(p, (labels / p.name) if (labels / p.name).exists() else None) for p in images]
