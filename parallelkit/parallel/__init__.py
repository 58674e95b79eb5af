"""Parallelism strategies built on the layers: data parallelism (and, next, process grids and
``parallelize``)."""

from parallelkit.parallel.data_parallel import DataParallel

__all__ = ["DataParallel"]
