"""Writing files so that a crash or a kill never leaves a half-written file under a final name.

Every file a run writes goes to a temporary name in the same directory (``.<name>.tmp-XXXX``),
is flushed and fsynced, and is renamed into place with ``os.replace``, which is atomic on
POSIX: a reader sees the old file or the new one, never a mixture, and a kill during the
export of ``model.pt`` leaves the earlier ``model.pt`` intact. Temporary files that a killed
process left behind are removed at the start of the next run (:func:`remove_stale`).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

TMP_MARK = ".tmp-"  # temporary names: ".<final name>.tmp-<random>"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp creates files 0600, the final files get the usual mode


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file, fsync it, and rename it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARK}")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_text(path: Path, text: str) -> None:
    atomic_bytes(path, text.encode())


def torch_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` as bytes (to checksum what is written)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def atomic_torch_save(path: Path, obj: Any) -> str:
    """``torch.save`` to ``path`` atomically; returns the SHA-256 of the bytes written."""
    data = torch_bytes(obj)
    atomic_bytes(path, data)
    return sha256(data)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remove_stale(folder: Path) -> list[Path]:
    """Remove temporary files left by a killed writer anywhere under ``folder``.

    Call only while no other process writes there (the run directory's lock is held).
    """
    stale = [p for p in Path(folder).rglob(f".*{TMP_MARK}*") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (the directory entry), where the OS allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
