"""Shared fixtures: pools of local gloo ranks, started once per world size and reused.

``pytest --fast tests`` (``make test-fast``) is the inner loop: the pure tests and the pool
tests on 2 ranks. It leaves out the end-to-end modules (``parallelkit train`` and the examples
as subprocesses, faults, the lazy-device tier) and every case on 1, 3 or 4 ranks; ``make test``
runs them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from parallelkit.testing import Ranks

# Whole modules of subprocess runs (seconds to minutes each: ``parallelkit train`` and
# ``predict``, the examples as subprocesses, faults), compiles or lazy-tensor tracing: not in
# --fast. Listed longest first: ``make test`` hands whole modules to 2 pytest-xdist workers in
# collection order (``--dist loadfile --no-loadscope-reorder``), and :func:`longest_first` puts
# these first; xdist's own reorder, most cases first, would hand out these modules of few long
# cases last and leave one worker running them alone at the end.
SLOW_MODULES = (
    "train/predict/test_folder.py", "parallel/test_compile.py", "train/loop/test_faults.py",
    "train/loop/test_trainer.py", "train/ranks/test_startup.py", "data/test_decathlon.py",
    "train/loop/test_train_segment.py", "test_examples.py",
    "train/loop/test_train_segment_volumes.py", "comm/test_device_discipline.py",
    "train/store/test_integrity.py", "train/loop/test_preflight.py",
    "train/loop/test_train_blocks.py", "train/predict/test_command.py", "data/test_msd.py",
    "train/ranks/test_slurm.py", "test_doc_commands.py", "models/test_imported.py",
    "data/test_slides.py",
)  # fmt: skip
FAST_SIZES = (2,)
TESTS = Path(__file__).parent
TIERS = ("mpi", "xla", "gpu", "zoo")  # run by their own commands (Makefile), not by --fast


def _module(item: pytest.Item) -> str:
    """The test module's path under tests/, as SLOW_MODULES names it."""
    return item.path.relative_to(TESTS).as_posix()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true",
        help="the inner loop: pure tests and 2-rank pool tests only (make test-fast)",
    )  # fmt: skip


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` module by module (stable within a module): SLOW_MODULES in their
    order, then the others, most cases first."""
    count: dict[object, int] = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1

    def key(item: pytest.Item) -> tuple[int, int, str]:
        name = _module(item)
        if name in SLOW_MODULES:
            return (SLOW_MODULES.index(name), 0, "")
        return (len(SLOW_MODULES), -count[item.path], str(item.path))

    items.sort(key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)
    if not config.getoption("--fast"):
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = _module(item)
        slow = module in SLOW_MODULES or module.split("/")[0] in TIERS
        sizes = [params[k] for k in ("size", "ranks") if isinstance(params.get(k), int)]
        (drop if slow or any(n not in FAST_SIZES for n in sizes) else keep).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture(scope="session")
def ranks(pytestconfig: pytest.Config) -> Iterator[Callable[[int], Ranks]]:
    """``ranks(n)`` is a pool of n gloo ranks; ``ranks(n).run(fn, ...)`` runs fn on each."""
    pools: dict[int, Ranks] = {}
    fast = pytestconfig.getoption("--fast")

    def get(n: int) -> Ranks:
        if fast and n not in FAST_SIZES:
            pytest.skip(f"--fast runs 2-rank pools only; this case needs {n} ranks")
        if n not in pools:
            pools[n] = Ranks(n, "gloo")
        return pools[n]

    yield get
    close_all(pools.values())


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
    close_all(pools.values())


def close_all(pools) -> None:
    """Close pools together: every worker is told to stop first, so that their exits (each
    rank's leave-together barrier and process-group teardown) overlap instead of queueing."""
    pools = list(pools)
    for pool in pools:
        for inbox in getattr(pool, "_inboxes", []):
            with contextlib.suppress(Exception):
                inbox.put(None)
    for pool in pools:
        pool.close()
