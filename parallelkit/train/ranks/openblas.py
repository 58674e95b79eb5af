"""numpy's OpenBLAS, as a launcher that forks its ranks needs it: its thread pool stopped before
the forks, and each fork's thread count set as a new process's would be.

numpy loads OpenBLAS (its own copy, or the system's) when torch imports it, and OpenBLAS starts
a pool of threads there, one per core unless ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS``
says 1. A fork copies only the thread that forks, so the launcher forks only while it runs no
other (:mod:`parallelkit.train.ranks.rankproc`): a running pool made every rank a new process in a
user's usual environment. OpenBLAS stops the pool itself before every fork (its
``pthread_atfork`` handler calls ``blas_thread_shutdown_``) and starts it again at its next call;
here the launcher stops it before it counts its threads. The count OpenBLAS read at load is
the launcher's, so a fork sets its own, as a new process would read it from its environment
(:func:`threads_asked`).
The functions are found in the libraries this process has mapped (Linux), under the names
numpy's builds give them (``scipy_`` before, ``64_`` after, for its 64-bit integer build).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any


def _libraries() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries this process has loaded (none where /proc cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    found = []
    for path in sorted(p for p in paths if p.startswith("/")):
        with contextlib.suppress(OSError):
            found.append(ctypes.CDLL(path))  # the loaded library's own handle
    return found


def stop_pool() -> None:
    """Stop every loaded OpenBLAS's thread pool, as OpenBLAS does before a fork."""
    for lib in _libraries():
        with contextlib.suppress(AttributeError):
            lib.blas_thread_shutdown_()


def set_threads(n: int) -> None:
    """Let every loaded OpenBLAS compute on ``n`` threads (``openblas_set_num_threads``)."""
    for lib in _libraries():
        if (set_num_threads := _named(lib, "openblas_set_num_threads")) is not None:
            set_num_threads(ctypes.c_int(n))


def threads_asked(env: dict[str, str]) -> int | None:
    """The thread count OpenBLAS reads from environment ``env`` when it loads, if one is set:
    ``OPENBLAS_NUM_THREADS``, else ``GOTO_NUM_THREADS``, else ``OMP_NUM_THREADS``."""
    for key in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def threads() -> list[int]:
    """The thread count each loaded OpenBLAS computes on (``openblas_get_num_threads``)."""
    getters = (_named(lib, "openblas_get_num_threads") for lib in _libraries())
    return [int(get()) for get in getters if get is not None]


def _named(lib: ctypes.CDLL, name: str) -> Callable[..., Any] | None:
    """``lib``'s function ``name``, under the first of the names numpy's builds give it that
    ``lib`` has; None if it has none."""
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_", "_64"):
            with contextlib.suppress(AttributeError):
                return getattr(lib, f"{prefix}{name}{suffix}")
    return None
