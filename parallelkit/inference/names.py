"""One output name per input sample, never two samples in one name.

A prediction is named after its input without the extension (``scan-07.nii.gz`` gives
``scan-07``). Data sets with a folder per subject (``sub-01/t1.nii.gz``, ``sub-02/t1.nii.gz``)
or a ``dataset.json`` listing ``imagesTr/c.npy`` and ``other/c.npy`` have samples of one file
name; written under one name, the second prediction replaced the first (and two data ranks
writing it at once broke both). So:

- a sample whose name no other sample has keeps it (the names users know stay put);
- samples that share a name are named by their path below the deepest folder they have in
  common, the folders joined to the name by :data:`SEPARATOR`: ``sub-01__t1`` and
  ``sub-02__t1``; ``imagesTr__c`` and ``other__c``;
- where that still gives one name twice (``a.npy`` and ``a.zarr`` in one folder, a file
  listed twice, a file already called ``sub-01__t1``), :func:`output_names` refuses before
  start, naming both files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from parallelkit.data.arrays import stem_of

SEPARATOR = "__"
"""Joins the folders of a sample whose file name another sample shares to that name."""


def output_names(paths: Sequence[Path]) -> list[str]:
    """The output name of each input path (see the module's docstring); a ``ValueError``
    naming two inputs that cannot be told apart."""
    stems = [stem_of(p) for p in paths]
    groups: dict[str, list[int]] = {}
    for i, stem in enumerate(stems):
        groups.setdefault(stem, []).append(i)
    names = list(stems)
    for stem, members in groups.items():
        if len(members) < 2:
            continue
        where = [Path(os.path.abspath(paths[i])).parent for i in members]
        common = Path(os.path.commonpath(where))
        for i, folder in zip(members, where, strict=True):
            names[i] = SEPARATOR.join((*folder.relative_to(common).parts, stem))
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            j = first[name]
            why = "is listed twice" if Path(paths[i]) == Path(paths[j]) else (
                f"and {paths[i]} would both be predicted into the name {name!r}")  # fmt: skip
            raise ValueError(f"{paths[j]} {why}: rename or remove one of them")
        first[name] = i
    return names
