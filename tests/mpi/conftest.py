"""The mpiexec tier: ``mpiexec -n N python -m pytest tests/mpi`` runs these on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cases.py

import parallelkit as pk


@pytest.fixture(scope="session")
def comm():
    world = pk.init("auto")
    assert world.backend == "mpi", "run this tier under mpiexec"
    return world
