"""Numbers about each sample, computed once from the whole file and kept: per-sample intensity
statistics (``data.normalize=percentile``) and foreground positions (``data.foreground``).

Under spatial parallelism a rank reads only its block of a sample, but what it does with the
block may depend on the whole sample (the percentiles to clip at, where the labelled voxels
are). Every rank computes those numbers from the whole file, by the same deterministic
streaming pass, so every rank gets the same numbers; this module makes that pass happen once
per file rather than once per rank, epoch and DataLoader worker:

- in memory, per process, keyed by what the numbers depend on: the file (path, shape, dtype,
  modification time, pyramid level) and the parameters of the computation;
- in ``root/<name>.json``, a JSON object of those keys, so later runs and other processes
  (DataLoader workers forked before the first read, predict) find them. Written whole through
  a rename (ranks writing at once each write the same numbers); merged with what is there; left
  alone where ``root`` is read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_MEMORY: dict[str, Any] = {}


def sample_key(reader: Any, params: object) -> str:
    """What a sample's numbers depend on: its file, its level, and the computation's ``params``."""
    path = Path(reader.path)
    described = [str(path.resolve()), list(reader.shape), str(reader.dtype),
                 os.stat(path).st_mtime_ns, getattr(reader, "level", 0), params]  # fmt: skip
    return hashlib.sha1(json.dumps(described).encode()).hexdigest()


def per_sample(
    readers: Sequence[Any],
    params: object,
    compute: Callable[[Any], Any],
    cache: Path | None = None,
) -> list[Any]:
    """``compute(reader)`` for each reader (JSON-able values), each computed once: taken from
    memory, else from the JSON file ``cache``, else computed and kept in both."""
    keys = [sample_key(r, params) for r in readers]
    missing = [i for i, k in enumerate(keys) if k not in _MEMORY]
    if missing and cache is not None:
        saved = _load(cache)
        for i in missing:
            if keys[i] in saved:
                _MEMORY[keys[i]] = saved[keys[i]]
    computed = {keys[i]: compute(readers[i]) for i, k in enumerate(keys) if k not in _MEMORY}
    if computed:
        _MEMORY.update(computed)
        if cache is not None:
            save(cache, {**_load(cache), **computed})
    return [_MEMORY[k] for k in keys]


def _load(cache: Path) -> dict[str, Any]:
    try:
        saved = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def save(cache: Path, numbers: dict[str, Any]) -> None:
    """``numbers`` as the JSON file ``cache``, through a rename; nothing on a read-only disk."""
    try:  # written whole or not at all: other ranks may be writing the same numbers
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(numbers))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only data set: the numbers stay in memory
