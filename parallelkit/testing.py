"""The test harness: run a function on N local ranks and get every rank's result back, with a
deadline (:class:`~parallelkit.local_ranks.Ranks`; the library's own planner uses it too, so
it lives in :mod:`parallelkit.local_ranks`). Tests import it from here::

    from parallelkit.testing import Ranks

    with Ranks(4) as ranks:                      # 4 processes joined by gloo, started once
        results = ranks.run(fn, x, timeout=60)   # fn(comm, x) on every rank; list by rank
"""

from parallelkit.local_ranks import RankError, Ranks, free_port, on_host

__all__ = ["RankError", "Ranks", "free_port", "on_host"]
