"""Parallelism strategies built on the layers: data parallelism, the process grid, and
``parallelize`` / ``to_dense`` which swap parallel layers into an unchanged model."""

from parallelkit.parallel.data_parallel import DataParallel
from parallelkit.parallel.grid import Grid
from parallelkit.parallel.parallelize import SpatialRegion, parallelize, to_dense

__all__ = ["DataParallel", "Grid", "SpatialRegion", "parallelize", "to_dense"]
