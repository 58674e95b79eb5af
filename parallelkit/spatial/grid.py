"""A grid of ranks holding blocks of the same samples, and scatter/gather of samples.

A sample has 1, 2 or 3 spatial dimensions: a signal (N, C, L), an image (N, C, H, W), a volume
(N, C, D, H, W). The grid is ``depth x rows x cols``: ``depth`` splits D, ``rows`` splits H (and
a signal's L, the first spatial dimension as H is an image's), ``cols`` splits W. The default
grid of a plain communicator splits the first spatial dimension over every rank (L, D, or H).
Rank ``(z * rows + i) * cols + j`` of ``comm`` holds depth block z, row block i and column block
j of every sample (``torch.tensor_split`` layout along each). Exchanges along one dimension run
over the ranks that differ only in that dimension's block (:meth:`SpatialGrid.axes`); doing
them one dimension after another on the extended block also fetches the edge and corner
rows, so one-dimensional exchanges make an N-dimensional one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.comm.local import LocalCommunicator
from parallelkit.geometry import BlockLayout, split_axes, tensor_split_sizes
from parallelkit.spatial import record

Axis = tuple[Communicator, int, int]
"""(communicator of the ranks along one dimension, number of blocks, this rank's block)."""


class SpatialGrid:
    """``comm`` arranged as ``depth x rows x cols`` (``grid``: ``(rows, cols)`` or
    ``(depth, rows, cols)``; default None: the first spatial dimension over every rank)."""

    def __init__(self, comm: Communicator, grid: Sequence[int] | None = None) -> None:
        given = (comm.size, 1, 1) if grid is None else tuple(int(v) for v in grid)
        shape = (1, *given) if len(given) == 2 else given
        if len(shape) != 3 or min(shape) < 1 or math.prod(shape) != comm.size:
            raise ValueError(
                f"spatial grid {' x '.join(map(str, given))} does not match a communicator of "
                f"{comm.size} ranks: give (rows, cols) or (depth, rows, cols) whose product is "
                f"{comm.size}"
            )
        self.comm, self.first = comm, grid is None
        self._layouts: dict[int, BlockLayout] = {}  # by the samples' spatial dimensions
        self.depth, self.rows, self.cols = shape
        rest, self.col = divmod(comm.rank, self.cols)
        self.layer, self.row = divmod(rest, self.rows)
        # A communicator per dimension, only where it is really split (split() is collective,
        # and every rank takes the same branches since the grid's shape is the same everywhere).
        one = LocalCommunicator(timeout=comm.timeout, device=comm.device)
        coords, strides = (self.layer, self.row, self.col), (self.rows * self.cols, self.cols, 1)
        self._comms: list[Communicator] = []
        for a, parts in enumerate(shape):
            if parts == 1:
                self._comms.append(one)
            elif parts == comm.size:
                self._comms.append(comm)
            else:  # the ranks that differ from this one along this dimension only
                color = comm.rank - coords[a] * strides[a]
                self._comms.append(comm.split(color=color, key=coords[a]))

    def __repr__(self) -> str:
        return (
            f"SpatialGrid({self.depth} x {self.rows} x {self.cols}, rank {self.comm.rank} at "
            f"{self.layer, self.row, self.col})"
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.depth, self.rows, self.cols

    @property
    def at_origin(self) -> bool:
        """Whether this rank holds the first block along every dimension (the group's rank 0,
        as the grid is laid out row-major): the one that keeps what the blocks hold once,
        such as a token fold's class tokens."""
        return self.layer == self.row == self.col == 0

    def axes(self, ndim: int) -> list[Axis]:
        """Per spatial dimension of a sample with ``ndim`` of them (1, 2 or 3): the
        communicator along it, its number of blocks and this rank's block."""
        mine = self.block_layout(ndim)
        comms = [self._comms[a] for a in split_axes(self.shape, ndim, self.first)]
        return list(zip(comms, mine.counts, mine.coords, strict=True))

    def block_layout(self, ndim: int) -> BlockLayout:
        """This rank's :class:`~parallelkit.geometry.BlockLayout` of samples with ``ndim``
        spatial dimensions: what the loader, the block readers and the region cut by. A grid
        that cannot split such samples is a ``ValueError``."""
        if ndim not in self._layouts:
            coords = (self.layer, self.row, self.col)
            self._layouts[ndim] = BlockLayout.of_grid(self.shape, coords, ndim, self.first)
        return self._layouts[ndim]

    def counts(self, ndim: int) -> tuple[int, ...]:
        """Blocks along each of the ``ndim`` spatial dimensions."""
        return self.block_layout(ndim).counts

    def global_size(self, x: torch.Tensor, name: str = "spatial layer") -> tuple[int, ...]:
        """The whole samples' spatial size whose block ``x`` (N, C, *spatial) this rank holds.

        Inside a spatial region the size travels with the block (``record.size_of``);
        elsewhere one small all-gather of every rank's block size, and the blocks must be in
        tensor_split layout, which is checked (the same ValueError on every rank).
        """
        if not 3 <= x.dim() <= 5:
            raise ValueError(
                f"{name}: expected an (N, C, L), (N, C, H, W) or (N, C, D, H, W) block, got "
                f"shape {tuple(x.shape)}"
            )
        ndim = x.dim() - 2
        axes = self.axes(ndim)
        if self.comm.size == 1:
            return tuple(x.shape[2:])
        if (known := record.size_of(x)) is not None:
            return known
        # Host metadata: every rank's (block index, block size) along each dimension.
        mine = [v for (_, _, i), n in zip(axes, x.shape[2:], strict=True) for v in (i, n)]
        rows = self.comm.all_gather_ints(mine)
        total = []
        for d, (_, parts, _) in enumerate(axes):
            sizes = dict((row[2 * d], row[2 * d + 1]) for row in rows)
            total.append(sum(sizes.values()))
            want = tensor_split_sizes(total[-1], parts)
            if len(sizes) != parts or any(row[2 * d + 1] != want[row[2 * d]] for row in rows):
                raise ValueError(
                    f"{name}: the ranks' blocks {[row[1::2] for row in rows]} (spatial sizes by "
                    f"rank) are not the tensor_split layout of samples over a "
                    f"{' x '.join(map(str, self.counts(ndim)))} grid; use pk.spatial.scatter "
                    "to split samples"
                )
        return tuple(total)

    def block(self, *size: int) -> tuple[slice, ...]:
        """This rank's slice along each spatial dimension of a sample of ``size``."""
        return self.block_layout(len(size)).slices(*size)


GridSpec = Sequence[int] | SpatialGrid | None
"""What every ``grid=`` argument of the spatial layers and of ``pk.spatial`` takes: ranks per
spatial dimension (``(rows, cols)`` or ``(depth, rows, cols)``), a :class:`SpatialGrid` made
before, or None for the default (every rank along the first spatial dimension).
:func:`grid_of` is its one conversion."""


def grid_of(comm: Communicator, grid: GridSpec = None) -> SpatialGrid:
    """The :class:`SpatialGrid` of ``comm`` with that shape, made once per communicator.

    Layers on the same communicator share its sub-communicators instead of splitting again.
    """
    if isinstance(grid, SpatialGrid):
        return grid
    key = None if grid is None else tuple(int(v) for v in grid)
    if key is not None and len(key) == 2:
        key = (1, *key)
    cache = comm.__dict__.setdefault("_spatial_grids", {})
    if key not in cache:
        cache[key] = SpatialGrid(comm, grid)
    return cache[key]


def _check_sample(x: torch.Tensor, name: str) -> int:
    if not 3 <= x.dim() <= 5:
        raise ValueError(
            f"{name}: expected (N, C, L), (N, C, H, W) or (N, C, D, H, W), got shape "
            f"{tuple(x.shape)}"
        )
    return x.dim() - 2


def scatter(
    x: torch.Tensor, comm: Communicator, grid: GridSpec = None
) -> torch.Tensor:
    """This rank's block of a replicated (N, C, *spatial) tensor; differentiable (backward
    gathers the blocks' gradients, so every rank gets the whole input gradient; where whole
    gradients are shares, :mod:`parallelkit.spatial.record`, the block's gradient is this
    rank's share)."""
    g = grid_of(comm, grid)
    axes = g.axes(_check_sample(x, "pk.spatial.scatter"))
    if record.shares():  # the whole gradient's share is this block's, zeros elsewhere
        return x[(slice(None), slice(None), *g.block(*x.shape[2:]))]
    for d, (group, parts, _) in enumerate(axes):
        if parts > 1:
            x = pkf.scatter_to_group(x, group, 2 + d, tensor_split_sizes(x.shape[2 + d], parts))
    return x


def gather(
    y: torch.Tensor,
    comm: Communicator,
    grid: GridSpec = None,
    size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole (N, C, *spatial) tensor again, on every rank, from each rank's block.

    Differentiable for a consumer that every rank runs identically (one replicated loss): the
    backward keeps this rank's block of the gradient. ``size``: the whole spatial size if
    known (it saves the all-gather of the blocks' sizes).
    """
    g = grid_of(comm, grid)
    axes = g.axes(_check_sample(y, "pk.spatial.gather"))
    size = size or g.global_size(y, "pk.spatial.gather")
    # Where whole gradients are shares, the block's gradient is the sum of every rank's share
    # of it: all_gather's backward (a reduce-scatter).
    cat = pkf.all_gather if record.shares() else pkf.gather_from_group
    for d in reversed(range(len(axes))):
        group, parts, _ = axes[d]
        if parts > 1:
            y = cat(y, group, 2 + d, tensor_split_sizes(size[d], parts))
    return y
