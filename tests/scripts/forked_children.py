"""``supervise`` with forked children, in a process of its own (a fork of pytest's worker would
run pytest's exit functions): ``python forked_children.py OUT CASE``, then the job's status.

    ok       the child sees its environment, runs in a session of its own under its name, and
             its exit functions run when it returns
    raises   an uncaught exception reaches sys.excepthook; the launcher names the rank
    exits    sys.exit(3) is the child's exit status
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

from parallelkit.train.ranks.procs import Child, supervise

OUT = Path(sys.argv[1])


def ok() -> int:
    atexit.register((OUT / "atexit").write_text, "ran")
    seen = {
        "X": os.environ.get("X"),
        "own session": os.getsid(0) == os.getpid(),
        "name": Path("/proc/self/comm").read_text().strip(),
    }
    (OUT / "child.json").write_text(json.dumps(seen))
    return 0


def raises() -> int:
    raise ValueError("raised in the fork")


def exits() -> int:
    sys.exit(3)


if __name__ == "__main__":
    child = {"ok": ok, "raises": raises, "exits": exits}[sys.argv[2]]
    env = {**os.environ, "X": "1"}
    print("status", supervise([Child(["unused"], env, "rank 0", forked=child)]))
