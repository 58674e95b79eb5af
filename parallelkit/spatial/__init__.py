"""Spatial parallelism helpers: the rows x cols grid of ranks, and scatter/gather of images.

x_blk = pk.spatial.scatter(x, comm, grid=(2, 2))   # this rank's block of (N, C, H, W)
y = pk.spatial.gather(y_blk, comm, grid=(2, 2))    # whole tensor again, on every rank
"""

from parallelkit.spatial.grid import SpatialGrid, gather, grid_of, scatter

__all__ = ["SpatialGrid", "gather", "grid_of", "scatter"]
