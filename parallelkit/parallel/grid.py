"""The process grid: one communicator split into data x spatial (rows x cols) x channel groups.

The grid's shape and rank order (data-major) are :class:`~parallelkit.dims.GridDims`'; what
this file adds is the communicators of each group, made once, collectively, on every rank.

    group          ranks that share ...                    used for
    data           (r, c, k): the same shard of the model  averaging gradients (DataParallel)
    spatial        (d, k): the same images, other blocks   halo exchange, parameter-grad sums
    channel        (d, r, c): the same input, other channels  channel-parallel convolution
    batch          k: data x spatial                       BatchNorm statistics over batch and image
"""

from __future__ import annotations

from parallelkit.comm import Communicator
from parallelkit.comm.local import LocalCommunicator
from parallelkit.dims import GridDims


class Grid:
    """``comm`` split as ``data x rows x cols x channel``; the product must be ``comm.size``."""

    def __init__(
        self, comm: Communicator, data: int = 1, rows: int = 1, cols: int = 1, channel: int = 1
    ) -> None:
        self.comm = comm
        self.dims = GridDims(data, rows, cols, channel)
        self.dims.check_size(comm.size, "Grid", f"the communicator has {comm.size} ranks")
        self.coords = d, r, c, k = self.dims.coords(comm.rank)
        spatial = rows * cols
        # Every rank makes the same split() calls in the same order (they are collective).
        self.data_comm = self._group(r * cols * channel + c * channel + k, d, data)
        self.spatial_comm = self._group(d * channel + k, r * cols + c, spatial)
        self.channel_comm = self._group(comm.rank // channel, k, channel)
        self.batch_comm = self._group(k, d * spatial + r * cols + c, data * spatial)

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
    def spatial(self) -> tuple[int, int]:
        return self.rows, self.cols

    def __repr__(self) -> str:
        d, r, c, k = self.coords
        return (
            f"Grid(data={self.data}, rows={self.rows}, cols={self.cols}, channel={self.channel}; "
            f"rank {self.comm.rank} at d={d} r={r} c={c} k={k})"
        )
