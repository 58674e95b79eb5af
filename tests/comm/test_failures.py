"""A failing rank never hangs the others: it fails the call at once, or a timeout stops them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallelkit.comm import CommError, Communicator
from parallelkit.testing import RankError, Ranks, free_port

SCRIPTS = Path(__file__).parents[1] / "scripts"


def rank1_raises(comm: Communicator) -> None:
    if comm.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    comm.all_reduce(torch.ones(3))  # rank 0 waits here for a rank that will never come


def test_exception_on_one_rank_fails_the_call_at_once(ranks):
    # The harness and the communicator both allow far more than the grace period, so the
    # message below can only come from noticing rank 1's exception, not from a timeout.
    with pytest.raises(RankError, match="rank 1 raised") as info:
        ranks(2).run(rank1_raises, timeout=300)
    assert "rank 1 fails on purpose" in str(info.value)


def rank1_skips(comm: Communicator) -> str:
    if comm.rank == 1:
        return "skipped"
    with pytest.raises(CommError) as info:
        comm.all_reduce(torch.ones(3))
    return str(info.value)


def test_gloo_collective_times_out_with_a_clear_error():
    with Ranks(2, comm_timeout=2) as pool:
        message, skipped = pool.run(rank1_skips, timeout=120)
    assert skipped == "skipped"
    assert "time out after 2 s" in message and "rank 0 of 2" in message


LATE_RANK = """
import os, sys, time
rank = int(sys.argv[1])
if rank == 1:
    time.sleep(float(sys.argv[2]))  # starts well after rank 0, past the collective timeout
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
import torch
import parallelkit as pk
comm = pk.init("gloo", timeout=2)
print(comm.all_reduce(torch.ones(2) * (rank + 1)).tolist())
"""


def test_a_rank_that_starts_after_the_collective_timeout_still_joins():
    """The start waits for late ranks up to its own limit; the 2 s collective timeout is
    for collectives (the test above), not for a rank that is still importing torch."""
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", LATE_RANK, str(r), "6", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=180) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["[3.0, 3.0]"] * 2


def rank1_dies(comm: Communicator) -> str:
    if comm.rank == 1:
        os._exit(3)
    with pytest.raises(CommError) as info:
        comm.all_reduce(torch.ones(3))
    return str(info.value)


def test_dead_rank_makes_the_others_fail():
    with Ranks(2, comm_timeout=600) as pool, pytest.raises(RankError, match="died") as info:
        pool.run(rank1_dies, timeout=300)
    # Rank 0 did not sit out the 600 s timeout: gloo saw the closed connection.
    assert "all_reduce failed on rank 0" in info.value.results[0]


mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


@pytest.mark.skipif(mpiexec is None, reason="no mpiexec (pip install mpich)")
@pytest.mark.parametrize(
    ("how", "message"),
    [("raise", "uncaught exception on rank 1"), ("skip", "did not finish within 3 s")],
)
def test_mpi_failure_aborts_the_job(how, message):
    timeout = "3" if how == "skip" else "600"  # "raise" must not need the watchdog
    # Rank 1 of the "skip" case sleeps 120 s, past this subprocess timeout: only an abort
    # ends the job in time.
    env = dict(os.environ, PARALLELKIT_TIMEOUT=timeout, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "mpi_failure.py"), how],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "went unnoticed" not in proc.stdout
