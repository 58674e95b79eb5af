"""The GPU tier: ``make test-gpu``, or ``python3 -m pytest tests/gpu`` with a CUDA build of torch.

Every test is skipped, with the reason, on a machine without CUDA. TF32 is off for every
process (``NVIDIA_TF32_OVERRIDE=0``), so float32 on the GPU is compared with the CPU at
float32 tolerances.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rank-side cases in tests/
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"  # inherited by every rank this tier starts

from parallelkit.testing import Ranks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device here; run this tier on a GPU machine")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_ranks() -> Iterator[Callable[[int, str], Ranks]]:
    """``cuda_ranks(n, backend)``: n local ranks on GPU 0 (gloo ranks share it, staging their
    collectives through host memory; one NCCL rank owns it)."""
    pools: dict[tuple[int, str], Ranks] = {}

    def get(n: int, backend: str = "gloo") -> Ranks:
        if (n, backend) not in pools:
            device = "cuda:0" if backend == "gloo" else None  # NCCL declares its own
            pools[n, backend] = Ranks(n, backend, device=device)
        return pools[n, backend]

    yield get
    for pool in pools.values():
        pool.close()
