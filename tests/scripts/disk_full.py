"""``parallelkit train`` on a file system that fills up after the first checkpoint: writing any
later shard fails half-way with ENOSPC. Run by tests/train/store/test_integrity.py with
parallel.ranks=1, so that the one rank is this process."""

import errno
import os
import sys
from pathlib import Path

from parallelkit import cli
from parallelkit.train.store import files

real_atomic_write = files.atomic_write
shards = []


def atomic_write(path, write):
    if Path(path).name.startswith("shard-") and Path(path).suffix == ".pt":
        shards.append(path)
        if len(shards) > 1:

            def full(f):
                f.write(b"\0" * 1024)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            return real_atomic_write(path, full)
    return real_atomic_write(path, write)


files.atomic_write = atomic_write
sys.exit(cli.main(["train", *sys.argv[1:]]))
