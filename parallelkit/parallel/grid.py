"""The process grid: one communicator split into data x spatial (depth x rows x cols) x channel
groups.

The grid's shape and rank order (data-major) are :class:`~parallelkit.dims.GridDims`'; what
this file adds is the communicators of each group, made once, collectively, on every rank.

    group          ranks that share ...                    used for
    data           (z, r, c, k): the same shard of the model  averaging gradients (DataParallel)
    spatial        (d, k): the same samples, other blocks   halo exchange, parameter-grad sums
    channel        (d, z, r, c): the same input, other channels  channel-parallel convolution
    batch          k: data x spatial                       BatchNorm statistics over batch and image
"""

from __future__ import annotations

from parallelkit.comm import Communicator
from parallelkit.comm.local import LocalCommunicator
from parallelkit.dims import GridDims


class Grid:
    """``comm`` split as ``data x depth x rows x cols x channel``; the product must be
    ``comm.size``. ``depth``, ``rows`` and ``cols`` split a sample's D, H and W (a signal's L
    by rows); see :class:`parallelkit.spatial.SpatialGrid`."""

    def __init__(
        self,
        comm: Communicator,
        data: int = 1,
        rows: int = 1,
        cols: int = 1,
        channel: int = 1,
        *,
        depth: int = 1,
    ) -> None:
        self.comm = comm
        self.dims = GridDims(data=data, depth=depth, rows=rows, cols=cols, channel=channel)
        self.dims.check_size(comm.size, "Grid", f"the communicator has {comm.size} ranks")
        self.coords = d, z, r, c, k = self.dims.coords(comm.rank)
        spatial = depth * rows * cols
        s = (z * rows + r) * cols + c  # this rank's block among the spatial group
        # Every rank makes the same split() calls in the same order (they are collective).
        self.data_comm = self._group(s * channel + k, d, data)
        self.spatial_comm = self._group(d * channel + k, s, spatial)
        self.channel_comm = self._group(comm.rank // channel, k, channel)
        self.batch_comm = self._group(k, d * spatial + s, data * spatial)

    def _group(self, color: int, key: int, size: int) -> Communicator:
        if size == 1:
            return LocalCommunicator(timeout=self.comm.timeout, device=self.comm.device)
        if size == self.comm.size:
            return self.comm
        return self.comm.split(color, key)

    @property
    def data(self) -> int:
        return self.dims.data

    @property
    def rows(self) -> int:
        return self.dims.rows

    @property
    def cols(self) -> int:
        return self.dims.cols

    @property
    def channel(self) -> int:
        return self.dims.channel

    @property
    def depth(self) -> int:
        return self.dims.depth

    @property
    def spatial(self) -> tuple[int, int, int]:
        """``(depth, rows, cols)``: the spatial group's :class:`~parallelkit.spatial.SpatialGrid`
        shape."""
        return self.dims.spatial

    @property
    def model_rank(self) -> int:
        """This rank's position inside its model replica (same numbering in every replica)."""
        return self.comm.rank % self.dims.model

    def __repr__(self) -> str:
        d, z, r, c, k = self.coords
        return (
            f"Grid(data={self.data}, depth={self.depth}, rows={self.rows}, cols={self.cols}, "
            f"channel={self.channel}; rank {self.comm.rank} at d={d} z={z} r={r} c={c} k={k})"
        )
