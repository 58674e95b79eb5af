"""The spatial region: a model run on this rank's block of every image, whole tensors out.

``pk.parallelize(model, comm, "spatial")`` wraps the model (with its leaf layers swapped for
spatial ones) in a :class:`SpatialRegion`. Its forward scatters the whole input into this
rank's block, runs the model under the spatial guard (``spatial_guard``: every operation on a
block is exact or refused) and gathers every output that is still split; outputs that became
whole inside (after a global pool) come back as they are, in the model's own containers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from parallelkit.comm import Communicator
from parallelkit.parallel.spatial_guard import SpatialGuard
from parallelkit.spatial import layout
from parallelkit.spatial.grid import gather, grid_of, scatter


class SpatialRegion(nn.Module):
    """Scatter the whole input into this rank's block, run the model, gather what is split.

    ``whole_comm``: the data group, over which BatchNorm normalizes tensors that are whole
    inside the region (the spatial ranks all hold the same samples there).
    ``output``: "whole" gathers every split output; "blocks" returns this rank's block of it
    (tensor_split layout over the grid, as ``pk.spatial.scatter`` cuts), for a consumer that
    works on blocks and reduces exactly (a per-pixel loss): the whole output is never built.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        grid: tuple[int, int],
        whole_comm: Communicator | None = None,
        output: str = "whole",
    ) -> None:
        super().__init__()
        if output not in ("whole", "blocks"):
            raise ValueError(f"SpatialRegion: output must be 'whole' or 'blocks', got {output!r}")
        self.module, self.comm, self.grid = module, comm, grid
        self.whole_comm, self.output = whole_comm, output
        self._blocks = grid_of(comm, grid)  # the sub-groups, made once (split is collective)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.comm.size == 1:  # one rank holds the whole image: nothing to follow
            return self.module(x, *args, **kwargs)
        x_blk = scatter(x, self.comm, self._blocks)
        guard = SpatialGuard(self.module, self.comm, self._blocks, self.whole_comm)
        guard.mark(x_blk)
        with guard:
            y = self.module(x_blk, *args, **kwargs)
        if self.output == "blocks":
            return y
        whole = lambda t: gather(t, self.comm, self._blocks) if guard.is_split(t) else t  # noqa: E731
        return tree_map(whole, y)


class _OnWholeImage(nn.Module):
    """Runs a dense module on the whole tensor gathered from the blocks (``keep_dense``). Its
    output is whole on every rank: use it for the tail of a network."""

    ends_spatial_region = True  # for parallelkit.parallel.spatial_guard

    def __init__(self, module: nn.Module, comm: Communicator, grid: tuple[int, int]) -> None:
        super().__init__()
        self.module, self.comm, self.grid = module, comm, grid

    def forward(self, x_blk: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x = gather(x_blk, self.comm, self.grid) if layout.is_split(x_blk) else x_blk
        return self.module(x, *args, **kwargs)

    def to_dense(self) -> nn.Module:
        return self.module
