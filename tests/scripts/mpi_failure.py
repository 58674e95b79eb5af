"""Run under mpiexec -n 2 by test_failures.py: rank 1 fails in the way argv[1] names.

raise: rank 1 dies of an exception while rank 0 waits in an all-reduce -> the except hook
       aborts the job.
skip:  rank 1 skips the all-reduce and sleeps -> rank 0's watchdog aborts the job.
"""

import sys
import time

import torch

import parallelkit as pk

comm = pk.init("mpi")
if comm.rank == 1:
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(120)
comm.all_reduce(torch.ones(3))
print("rank 0 finished: the failure went unnoticed")
