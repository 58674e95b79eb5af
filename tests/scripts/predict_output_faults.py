"""``parallelkit predict`` on an output folder that fails in one way, named by the first
argument; the rest are predict's keys. Run by tests/train/predict/test_folder.py with
parallel.ranks=1, so that the one rank is this process.

    full        the file system is full when a prediction's file is allocated (ENOSPC from
                posix_fallocate, as a full disk gives it; without the allocation the memory
                map would die of SIGBUS)
    no-room     the launcher's check sees 1 MiB free
    read-only   the output folder is not writable (os.access says so: tests run as root,
                where chmod does not stop writes)
"""

import errno
import os
import shutil
import sys
from collections import namedtuple

from parallelkit import cli

mode, argv = sys.argv[1], sys.argv[2:]
output = next(a.partition("=")[2] for a in argv if a.startswith("predict.output="))

if mode == "full":

    def posix_fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.posix_fallocate = posix_fallocate
elif mode == "no-room":
    real_usage = shutil.disk_usage
    Usage = namedtuple("Usage", "total used free")
    shutil.disk_usage = lambda path: Usage(real_usage(path).total, 0, 1 << 20)
elif mode == "read-only":
    real_access = os.access

    def access(path, how, **kw):
        inside = os.path.realpath(path).startswith(os.path.realpath(output))
        return False if inside and how & os.W_OK else real_access(path, how, **kw)

    os.access = access
else:
    raise SystemExit(f"unknown mode {mode}")
sys.exit(cli.main(["predict", *argv]))
