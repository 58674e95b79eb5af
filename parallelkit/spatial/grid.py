"""A rows x cols grid of ranks holding blocks of the same images, and scatter/gather of images.

Rank ``i * cols + j`` of ``comm`` holds row block i and column block j of every image
(``torch.tensor_split`` layout along H and W). Exchanges along H run over the ranks of one grid
column (``col_comm``), along W over one grid row (``row_comm``); doing H first and then W on the
H-extended block also fetches the corner rows, so two one-dimensional exchanges make a 2-D one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import parallelkit.functional as pkf
from parallelkit.comm import Communicator, tensor_split_sizes
from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial import layout


class SpatialGrid:
    """``comm`` arranged as ``rows x cols`` (default ``(comm.size, 1)``: split H only)."""

    def __init__(self, comm: Communicator, grid: Sequence[int] | None = None) -> None:
        rows, cols = (comm.size, 1) if grid is None else (int(grid[0]), int(grid[1]))
        if rows < 1 or cols < 1 or rows * cols != comm.size:
            raise ValueError(
                f"spatial grid {rows} x {cols} does not match a communicator of {comm.size} "
                f"ranks: rows * cols must equal {comm.size}"
            )
        self.comm, self.rows, self.cols = comm, rows, cols
        self.row, self.col = divmod(comm.rank, cols)
        # Sub-communicators only where a dimension is really split (split() is collective,
        # and every rank takes the same branches since the grid shape is the same everywhere).
        one = LocalCommunicator(timeout=comm.timeout, device=comm.device)
        if cols == 1:
            self.col_comm: Communicator = comm
            self.row_comm: Communicator = one
        elif rows == 1:
            self.col_comm, self.row_comm = one, comm
        else:
            self.col_comm = comm.split(color=self.col, key=self.row)
            self.row_comm = comm.split(color=self.row, key=self.col)

    def __repr__(self) -> str:
        return (
            f"SpatialGrid({self.rows} x {self.cols}, rank {self.comm.rank} at {self.row, self.col})"
        )

    def axis(self, dim: int) -> tuple[Communicator, int, int]:
        """(communicator, number of blocks, this rank's block) along H (dim 0) or W (dim 1)."""
        return (
            (self.col_comm, self.rows, self.row)
            if dim == 0
            else (self.row_comm, self.cols, self.col)
        )

    def global_size(self, x: torch.Tensor, name: str = "spatial layer") -> tuple[int, int]:
        """(H, W) of the whole images whose block ``x`` (N, C, h, w) this rank holds.

        Inside a spatial region the size travels with the block (``layout.size_of``);
        elsewhere one small all-gather of every rank's (h, w), and the blocks must be in
        tensor_split layout, which is checked (the same ValueError on every rank).
        """
        if x.dim() != 4:
            raise ValueError(f"{name}: expected an (N, C, H, W) block, got shape {tuple(x.shape)}")
        if self.comm.size == 1:
            return x.shape[2], x.shape[3]
        if (known := layout.size_of(x)) is not None:
            return known
        # Host metadata: every rank's (h, w), by grid position.
        hw = self.comm.all_gather_ints([x.shape[2], x.shape[3]])
        heights = [h for h, _ in hw[:: self.cols]]
        widths = [w for _, w in hw[: self.cols]]
        h_total, w_total = sum(heights), sum(widths)
        want_h = tensor_split_sizes(h_total, self.rows)
        want_w = tensor_split_sizes(w_total, self.cols)
        want = [[want_h[r], want_w[c]] for r in range(self.rows) for c in range(self.cols)]
        if hw != want:
            blocks = [hw[r * self.cols : (r + 1) * self.cols] for r in range(self.rows)]
            raise ValueError(
                f"{name}: the ranks' blocks {blocks} (h, w per grid position) are not the "
                f"tensor_split layout of {h_total} x {w_total} images over a {self.rows} x "
                f"{self.cols} grid; use pk.spatial.scatter to split images"
            )
        return h_total, w_total

    def block(self, h: int, w: int) -> tuple[slice, slice]:
        """This rank's rows and columns of an H x W image."""
        hs, ws = tensor_split_sizes(h, self.rows), tensor_split_sizes(w, self.cols)
        h0, w0 = sum(hs[: self.row]), sum(ws[: self.col])
        return slice(h0, h0 + hs[self.row]), slice(w0, w0 + ws[self.col])


def grid_of(comm: Communicator, grid: Sequence[int] | SpatialGrid | None = None) -> SpatialGrid:
    """The :class:`SpatialGrid` of ``comm`` with that shape, made once per communicator.

    Layers on the same communicator share its sub-communicators instead of splitting again.
    """
    if isinstance(grid, SpatialGrid):
        return grid
    shape = (comm.size, 1) if grid is None else (int(grid[0]), int(grid[1]))
    cache = comm.__dict__.setdefault("_spatial_grids", {})
    if shape not in cache:
        cache[shape] = SpatialGrid(comm, shape)
    return cache[shape]


def scatter(
    x: torch.Tensor, comm: Communicator, grid: Sequence[int] | SpatialGrid | None = None
) -> torch.Tensor:
    """This rank's block of a replicated (N, C, H, W) tensor; differentiable (backward gathers
    the blocks' gradients, so every rank gets the whole input gradient; where whole gradients
    are shares, :mod:`parallelkit.spatial.layout`, the block's gradient is this rank's share)."""
    g = grid_of(comm, grid)
    if x.dim() != 4:
        raise ValueError(f"pk.spatial.scatter: expected (N, C, H, W), got shape {tuple(x.shape)}")
    if layout.shares():  # the whole gradient's share is this block's, zeros elsewhere
        rows, cols = g.block(x.shape[2], x.shape[3])
        return x[:, :, rows, cols]
    x = pkf.scatter_to_group(x, g.col_comm, 2, tensor_split_sizes(x.shape[2], g.rows))
    return pkf.scatter_to_group(x, g.row_comm, 3, tensor_split_sizes(x.shape[3], g.cols))


def gather(
    y: torch.Tensor,
    comm: Communicator,
    grid: Sequence[int] | SpatialGrid | None = None,
    size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The whole (N, C, H, W) tensor again, on every rank, from each rank's block.

    Differentiable for a consumer that every rank runs identically (one replicated loss): the
    backward keeps this rank's block of the gradient. ``size``: the whole (H, W) if known
    (it saves the all-gather of the blocks' sizes).
    """
    g = grid_of(comm, grid)
    h, w = size or g.global_size(y, "pk.spatial.gather")
    # Where whole gradients are shares, the block's gradient is the sum of every rank's share
    # of it: all_gather's backward (a reduce-scatter).
    cat = pkf.all_gather if layout.shares() else pkf.gather_from_group
    y = cat(y, g.row_comm, 3, tensor_split_sizes(w, g.cols))
    return cat(y, g.col_comm, 2, tensor_split_sizes(h, g.rows))
