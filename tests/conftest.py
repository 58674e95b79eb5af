"""Shared fixtures: pools of local gloo ranks, started once per world size and reused."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from parallelkit.testing import Ranks


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], Ranks]]:
    """``ranks(n)`` is a pool of n gloo ranks; ``ranks(n).run(fn, ...)`` runs fn on each."""
    pools: dict[int, Ranks] = {}

    def get(n: int) -> Ranks:
        if n not in pools:
            pools[n] = Ranks(n, "gloo")
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def device_ranks() -> Iterator[Callable[[int], Ranks]]:
    """``device_ranks(n)``: n gloo ranks whose communicators are declared for the lazy-tensor
    device, so that they refuse host tensors as NCCL does (``parallelkit.testing``)."""
    pools: dict[int, Ranks] = {}

    def get(n: int) -> Ranks:
        if n not in pools:
            pools[n] = Ranks(n, "gloo", device="lazy")
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()
