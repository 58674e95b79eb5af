"""A fault in a user's data file: a label out of range, a corrupt chunk, a value type that would
be lost. It is the file's fault, not the program's, so a run ends on it with one line naming
the file and exit status 2, never a traceback (``parallelkit train`` checks one batch of each
split on every rank before training, and a fault met later ends the run the same way)."""

from __future__ import annotations


class DataError(ValueError):
    """A data file that cannot be used as it is; the message names the file."""


class CropError(ValueError):
    """A crop that does not fit in a sample; callers that know the key that set the crop name
    it (:func:`parallelkit.data.loader.block_dataset`)."""


def one_line(error: BaseException) -> str:
    """``error``'s message on one line. A DataLoader worker's exception comes back re-raised
    with the worker's traceback in its message: its last line holds the original message."""
    text = str(error).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        name = f"{type(error).__name__}: "
        return last[last.index(name) + len(name):] if name in last else last
    return text.splitlines()[0] if text else type(error).__name__
