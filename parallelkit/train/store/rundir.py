"""A run directory belongs to one run at a time, and one run only.

Two runs that share a ``train.run_dir`` used to destroy each other: the second one's
checkpoints were pruned as the first one's older ones, and its ``--resume`` loaded the first
run's weights. Now:

- **Identity.** Every run has a run id (new for a fresh run, kept by a resumed one) and a
  config hash (of every key that changes what is trained: not ``ALLOWED_TO_DIFFER``). Both
  go into every checkpoint manifest, with the config itself.
- **A new run** into a directory holding checkpoints refuses, offering ``--resume``, another
  ``train.run_dir``, or ``train.overwrite=true`` (which deletes the earlier run's outputs).
- **A resumed run** refuses a checkpoint whose config differs in any other key, naming them.
- **One process at a time.** Rank 0 holds an exclusive lock (``flock`` on ``.lock``) for the
  whole run; a second run into the directory, resumed or not, refuses while the lock is held.
  The kernel releases the lock when the process dies, however it dies.

:func:`check` only reads, so the launcher calls it before starting any rank (and exits 2);
every rank calls it again, since torchrun or mpiexec may start the ranks directly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from parallelkit.train.schema import Config
from parallelkit.train.store import checkpoint
from parallelkit.train.store.files import atomic_text

LOCK = ".lock"
# Keys that do not change what is trained, so a resumed run may change them. The epoch count
# and max_steps change where the run stops (epochs also the length of a cosine schedule).
ALLOWED_TO_DIFFER = (
    "train.epochs",
    "train.max_steps",
    "train.log_every",
    "train.eval_every",
    "train.progress",
    "train.tensorboard",
    "train.resume",
    "train.resume_fallback",
    "train.overwrite",
    "train.run_dir",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.checkpoint_on_signal",
    "train.fail_at_step",
    "train.fail_rank",
    "train.fail_how",
    "parallel.ranks",  # the data dimension may change on resume
    "parallel.backend",
    "parallel.fallback",  # the same numbers either way: only whether a refusal stops the run
    "parallel.timeout",
    "parallel.bucket_cap_mb",
    "data.workers",
)
# What train.overwrite=true deletes: the files that parallelkit runs recorded writing (in
# RECORD, by rank 0, as each is written) and the checkpoint folders, never through a symbolic
# link and never outside run_dir; a directory only when that leaves it empty. Anything else a
# user keeps there stays.
RECORD = ".outputs"
OUTPUT_DIRS = ("checkpoints", "tensorboard", "samples")


def record(run_dir: Path, *paths: Path) -> None:
    """Note that this run wrote ``paths`` (inside ``run_dir``), for a later overwrite."""
    book = Path(run_dir) / RECORD
    known = set(book.read_text().splitlines()) if book.is_file() else set()
    new = [str(Path(p).relative_to(run_dir)) for p in paths]
    new = [p for p in dict.fromkeys(new) if p not in known]
    if new:
        with book.open("a") as f:
            f.write("".join(f"{p}\n" for p in new))


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"train.epochs": 6, ...}``: every leaf of the resolved config."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and prefix.count(".") < 2:  # sections, then their keys
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), "")
    return out


def identity_config(cfg: Config) -> dict[str, Any]:
    """The keys that define what is trained (the hashed part of the config), as JSON has them
    (tuples as lists), so that a config read back from a manifest compares equal."""
    kept = {k: v for k, v in flat_config(cfg).items() if k not in ALLOWED_TO_DIFFER}
    return json.loads(json.dumps(kept, default=str))


def config_hash(config: dict[str, Any]) -> str:
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Identity:
    """Written into every checkpoint manifest of the run."""

    run_id: str
    config_hash: str
    config: dict[str, Any]

    def as_manifest(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "config_hash": self.config_hash, "config": self.config}


def new_identity(cfg: Config, run_id: str | None = None) -> Identity:
    config = identity_config(cfg)
    return Identity(run_id or uuid.uuid4().hex[:12], config_hash(config), config)


def differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``key: saved -> here`` for every key that differs (keys allowed to differ excluded)."""
    keys = sorted((set(saved) | set(here)) - set(ALLOWED_TO_DIFFER))
    missing = "(absent)"
    return [
        f"{k}: {saved.get(k, missing)!r} -> {here.get(k, missing)!r}"
        for k in keys
        if saved.get(k, missing) != here.get(k, missing)
    ]


def check(cfg: Config, lock: bool = True) -> str | None:
    """Refuse (``ValueError``) a run that would clash with what ``run_dir`` holds; returns a
    note for the user, or None. Reads only. ``lock``: also refuse while another process holds
    the directory (ranks other than 0 skip this: their rank 0 may hold it already)."""
    t = cfg.train
    run_dir = Path(t.run_dir)
    if lock and (holder := lock_holder(run_dir)) is not None:
        raise ValueError(
            f"train.run_dir={run_dir} is in use by another parallelkit train (pid {holder}); "
            "wait for it to end or stop it, or choose another train.run_dir"
        )
    found = checkpoint.complete(run_dir)
    if not t.resume:
        if found and not t.overwrite:
            newest = checkpoint.describe(found[-1])
            raise ValueError(
                f"train.run_dir={run_dir} holds the checkpoints of another run ({newest}); "
                "continue it with --resume, choose a new train.run_dir, or replace it with "
                "train.overwrite=true"
            )
        return None
    if not checkpoint.candidates(run_dir):
        return f"--resume: no checkpoint in {run_dir}; starting a new run"
    if not found:
        return None  # none can be read: --resume reports each one
    saved = (checkpoint.read_manifest_or_none(found[-1]) or {}).get("config")
    if saved is not None and (diff := differences(saved, identity_config(cfg))):
        raise ValueError(
            f"--resume: checkpoint {found[-1]} was written with another config; it differs in "
            f"{'; '.join(diff)} (only train.epochs, train.max_steps, logging, checkpointing "
            "and rank counts may change on resume)"
        )
    return None


def clear_outputs(run_dir: Path) -> None:
    """train.overwrite=true: remove the earlier runs' outputs, and only those (rank 0, under
    the lock): the files they recorded and their checkpoint folders, then their directories
    where they are left empty. Nothing is reached through a symbolic link."""
    book = run_dir / RECORD
    recorded = book.read_text().splitlines() if book.is_file() else []
    for name in recorded:
        path = run_dir / name
        if _own(run_dir, path) and path.is_file():
            path.unlink()
    for path in sorted((run_dir / "checkpoints").glob("step-*")):
        if _own(run_dir, path) and path.is_dir():
            shutil.rmtree(path)
    for name in OUTPUT_DIRS:
        folder = run_dir / name
        if _own(run_dir, folder) and folder.is_dir():
            for sub in sorted(folder.rglob("*"), reverse=True):  # deepest first
                if sub.is_dir() and not sub.is_symlink():
                    with contextlib.suppress(OSError):
                        sub.rmdir()  # only when empty
            with contextlib.suppress(OSError):
                folder.rmdir()
    book.unlink(missing_ok=True)


def _own(run_dir: Path, path: Path) -> bool:
    """``path`` lies in ``run_dir`` without a symbolic link on the way (itself included)."""
    try:
        parts = path.relative_to(run_dir).parts
    except ValueError:
        return False
    if ".." in parts:
        return False
    here = run_dir
    for part in parts:
        here = here / part
        if here.is_symlink():
            return False
    return True


class Lock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` holding the owner's pid; released by
    :meth:`release` or when the process dies."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        self.path = Path(run_dir) / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ValueError(
                    f"train.run_dir={run_dir} is in use by another parallelkit train "
                    f"(pid {_read_pid(self.path)}); wait for it to end or stop it"
                ) from None
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def lock_holder(run_dir: Path) -> str | None:
    """The pid holding ``run_dir``'s lock, or None when nobody does."""
    import fcntl

    path = Path(run_dir) / LOCK
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_pid(path)
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return None


def _read_pid(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text().strip() or "?"
    return "?"


NORMALIZATION = "normalization.json"
"""The per-channel mean and std that a run's block reader normalizes with (FORMAT:DIR data)."""


def save_normalization(run_dir: Path, loader) -> None:
    """Keep the training data's normalization in the run, so that ``parallelkit predict``
    normalizes as training did without the training data at hand."""
    dataset = loader.dataloader.dataset
    if getattr(dataset, "normalizer", None) is not None:
        atomic_text(run_dir / NORMALIZATION, json.dumps(dataset.normalizer.spec()))
        record(run_dir, run_dir / NORMALIZATION)
