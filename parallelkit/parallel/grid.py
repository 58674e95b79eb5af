"""The process grid: one communicator split into data x spatial (rows x cols) x channel groups.

Rank order is data-major: ``rank = ((d * rows + r) * cols + c) * channel + k``, so the ranks of
one model replica (same d) are neighbours, and a spatial or channel group stays inside a node
when the launcher places consecutive ranks together.

    group          ranks that share ...                    used for
    data           (r, c, k): the same shard of the model  averaging gradients (DataParallel)
    spatial        (d, k): the same images, other blocks   halo exchange, parameter-grad sums
    channel        (d, r, c): the same input, other channels  channel-parallel convolution
    batch          k: data x spatial                       BatchNorm statistics over batch and image
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallelkit.comm import Communicator
from parallelkit.comm.local import LocalCommunicator


@dataclass
class Grid:
    """``comm`` split as ``data x rows x cols x channel``; the product must be ``comm.size``."""

    comm: Communicator
    data: int = 1
    rows: int = 1
    cols: int = 1
    channel: int = 1
    coords: tuple[int, int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        dims = {"data": self.data, "rows": self.rows, "cols": self.cols, "channel": self.channel}
        if any(int(v) != v or v < 1 for v in dims.values()):
            raise ValueError(f"Grid: every dimension must be a positive integer, got {dims}")
        if self.data * self.rows * self.cols * self.channel != self.comm.size:
            raise ValueError(
                f"Grid: data x rows x cols x channel = {self.data} x {self.rows} x {self.cols} "
                f"x {self.channel} = {self.data * self.rows * self.cols * self.channel}, but the "
                f"communicator has {self.comm.size} ranks; choose dimensions whose product is "
                f"{self.comm.size}"
            )
        rest, k = divmod(self.comm.rank, self.channel)
        rest, c = divmod(rest, self.cols)
        d, r = divmod(rest, self.rows)
        self.coords = (d, r, c, k)
        spatial = self.rows * self.cols
        # Every rank makes the same split() calls in the same order (they are collective).
        self.data_comm = self._group(
            r * self.cols * self.channel + c * self.channel + k, d, self.data
        )
        self.spatial_comm = self._group(d * self.channel + k, r * self.cols + c, spatial)
        self.channel_comm = self._group(self.comm.rank // self.channel, k, self.channel)
        self.batch_comm = self._group(k, d * spatial + r * self.cols + c, self.data * spatial)

    def _group(self, color: int, key: int, size: int) -> Communicator:
        if size == 1:
            return LocalCommunicator(timeout=self.comm.timeout, device=self.comm.device)
        if size == self.comm.size:
            return self.comm
        return self.comm.split(color, key)

    @property
    def spatial(self) -> tuple[int, int]:
        return self.rows, self.cols

    def __repr__(self) -> str:
        d, r, c, k = self.coords
        return (
            f"Grid(data={self.data}, rows={self.rows}, cols={self.cols}, channel={self.channel}; "
            f"rank {self.comm.rank} at d={d} r={r} c={c} k={k})"
        )
