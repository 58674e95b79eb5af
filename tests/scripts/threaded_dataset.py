"""A user's data set whose module runs a thread pool from the moment it is imported, as a
module-level ``ThreadPoolExecutor`` does (``data.name=threaded_dataset:Threaded``, for
tests/train/ranks/test_startup.py): a fork of the launcher would copy none of its threads, and its
first ``submit`` would wait for ever for the thread the pool believes it has.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
from startup_code import Random

POOL = ThreadPoolExecutor(max_workers=2)
POOL.submit(time.sleep, 0).result()  # the pool's first thread runs, and stays


class Threaded(Random):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return POOL.submit(super().__getitem__, i).result()
