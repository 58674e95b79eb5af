"""The spatial region: a model run on this rank's block of every image, whole tensors out.

``pk.parallelize(model, comm, "spatial")`` wraps the model (with its leaf layers swapped for
spatial ones) in a :class:`SpatialRegion`. Its forward scatters the whole input into this
rank's block, runs the model under the spatial guard (``guard``: every operation on a
block is exact or refused) and gathers every output that is still split; outputs that became
whole inside (after a global pool) come back as they are, in the model's own containers.

With ``shares=True`` (what ``pk.parallelize`` builds) the gradients of whole tensors inside the
region are per-rank shares (:mod:`parallelkit.spatial.record`): no all-reduce per parameter in
backward. The region converts at its borders: a whole output's gradient, the same on every rank
outside, enters as its share (divided by the group size), and a whole extra input's shares are
summed on the way out. Its parameters' gradients are then shares of the dense ones, which
whoever wraps the region must sum over the spatial group: ``pk.parallelize`` wraps it in
DataParallel over the data x spatial group, whose bucketed all-reduces overlap with backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.fallback import check_fallback, forward_with_fallback
from parallelkit.spatial.grid import gather, grid_of, scatter
from parallelkit.spatial.guard import SpatialGuard, install_hooks
from parallelkit.spatial.rules.forms import gathered_whole


def check_whole_or_blocks(name: str, **given: str) -> None:
    """Each of ``given`` (an input or output of a spatial region) is "whole" or "blocks"; else
    a ``ValueError`` naming ``name`` and the argument. Checked once, here, for
    ``pk.parallelize`` and :class:`SpatialRegion` alike."""
    for key, value in given.items():
        if value not in ("whole", "blocks"):
            raise ValueError(f"{name}: {key} must be 'whole' or 'blocks', got {value!r}")


class SpatialRegion(nn.Module):
    """Scatter the whole input into this rank's block, run the model, gather what is split.

    ``whole_comm``: the data group, over which BatchNorm normalizes tensors that are whole
    inside the region (the spatial ranks all hold the same samples there).
    ``output``: "whole" gathers every split output; "blocks" returns this rank's block of it
    (tensor_split layout over the grid, as ``pk.spatial.scatter`` cuts), for a consumer that
    works on blocks and reduces exactly (a per-pixel loss): the whole output is never built.
    ``shares``: leave the parameters' gradients as shares (see the module docstring).
    ``fallback``: "refuse" (an operation without an exact rule raises a ValueError) or
    "gather" (the module holding it runs on gathered whole images: ``fallback``).
    ``input``: "whole" (the input is the whole batch, the region cuts this rank's block) or
    "blocks" (the input is this rank's block already, as ``pk.spatial.scatter`` cuts it: no
    rank holds a whole sample); ``size``, the whole samples' spatial size, then saves the
    host all-gather of the blocks' sizes (which also checks their layout) at every forward.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        grid: Sequence[int] | None,
        whole_comm: Communicator | None = None,
        output: str = "whole",
        shares: bool = False,
        fallback: str = "refuse",
        input: str = "whole",
        size: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        check_whole_or_blocks("SpatialRegion", output=output, input=input)
        check_fallback(fallback, "SpatialRegion")
        self.module, self.comm, self.grid = module, comm, grid
        self.whole_comm, self.output, self.shares = whole_comm, output, shares
        self.fallback, self.input = fallback, input
        self.size = None if size is None else tuple(int(n) for n in size)
        self._blocks = grid_of(comm, grid)  # the sub-groups, made once (split is collective)
        self._gathered: set[nn.Module] = set()  # modules found to need whole images
        self._warned: set = set()  # what the guards warned of, once per region
        install_hooks()  # here, not in forward: torch.compile traces forward

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.comm.size == 1:  # one rank holds the whole image: nothing to follow
            return self.module(x, *args, **kwargs)
        if torch.compiler.is_compiling():
            # Eager under torch.compile: the guard records blocks by tensor identity, and
            # dynamo guards on identity, so each step's new tensors recompiled every layer's
            # frame until dynamo's limit (8), after which it ran eager anyway, slower than
            # plain eager (docs/design.md, "Compiled steps"). dynamo is imported by then.
            return torch.compiler.disable(self._forward_blocks)(x, *args, **kwargs)
        return self._forward_blocks(x, *args, **kwargs)

    def _forward_blocks(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.input == "blocks":
            size, x_blk = self._whole_size(x), x
        else:
            size, x_blk = tuple(x.shape[2:]), scatter(x, self.comm, self._blocks)
        if self.shares:  # whole inputs' gradient shares are summed on the way out
            args, kwargs = tree_map(self._summed_on_exit, (args, kwargs))

        def attempt() -> tuple[SpatialGuard, Any]:
            guard = SpatialGuard(
                self.module, self.comm, self._blocks, self.whole_comm, self.shares, self._gathered
            )
            guard.warned = self._warned
            guard.mark(x_blk, size=size)
            with guard:
                return guard, self.module(x_blk, *args, **kwargs)

        if self.fallback == "gather":
            guard, y = forward_with_fallback(self.module, self._gathered, attempt, self.comm)
        else:
            guard, y = attempt()

        def out(t: Any) -> Any:
            if guard.is_split(t) and guard.folds(t):  # tokens (a ViT's hidden states): whole
                whole = None if self.output == "blocks" else gathered_whole(guard, t, full=True)
                if whole is None:
                    raise guard.refuse("the output", "it has spatial dimensions folded with "
                                       "others into one (a flatten, a window partition)",
                                       self.module)  # fmt: skip
                return whole
            if guard.is_split(t):
                if self.output == "blocks":
                    return t
                return self._gathered_output(t, guard)
            if self.shares and isinstance(t, torch.Tensor) and t.requires_grad:
                return _ShareOf.apply(t, self.comm.size)
            return t

        return tree_map(out, y)

    def _gathered_output(self, t: torch.Tensor, guard: SpatialGuard) -> torch.Tensor:
        """The whole of an output block ``t`` wherever its spatial dimensions are: an output
        need not be (N, C, *spatial). Deep supervision stacks heads, (N, heads, C, D, H, W);
        a channels-last output has C after them. The spatial dimensions go last, the others
        are folded into (rows, 1) for the gather and restored after it."""
        spatial = len(guard.places(t))
        where = tuple(t.dim() + d for d in guard.places(t))
        last = tuple(range(t.dim() - spatial, t.dim()))
        if where == last and t.dim() == spatial + 2:  # (N, C, *spatial)
            return gather(t, self.comm, self._blocks, size=guard.size_of(t))
        y = t.movedim(where, last)
        lead = y.shape[: y.dim() - spatial]
        y = y.reshape(-1, 1, *y.shape[len(lead) :])
        y = gather(y, self.comm, self._blocks, size=guard.size_of(t))
        return y.reshape(*lead, *y.shape[2:]).movedim(last, where)

    def _whole_size(self, x_blk: torch.Tensor) -> tuple[int, ...]:
        """The whole samples' spatial size of the input block ``x_blk``: ``size`` (this rank's
        block checked against it: a rank whose block is wrong raises, and the others stop at
        their next collective, by the communicator's timeout), else one host all-gather of
        the blocks' sizes, which checks the layout on every rank alike."""
        name = "pk.parallelize(spatial_input='blocks')"
        if self.size is None:
            return tuple(self._blocks.global_size(x_blk, name))
        want = self._blocks.block_layout(len(self.size)).shape(*self.size)
        if tuple(x_blk.shape[2:]) != want:
            raise ValueError(
                f"{name}: rank {self.comm.rank}'s block has spatial size "
                f"{tuple(x_blk.shape[2:])}, but its block of a {self.size} sample is {want} "
                "(pk.spatial.scatter's layout)"
            )
        return self.size

    def _summed_on_exit(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return pkf.copy_to_group(t, self.comm)
        return t


class _ShareOf(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the group size: a gradient that is
    the same on every rank becomes every rank's share of it (spatial.record)."""

    @staticmethod
    def forward(ctx, t, size):  # type: ignore[override]
        ctx.size = size
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad / ctx.size, None


class OnWholeSamples(nn.Module):
    """Runs a dense module on the whole tensor gathered from the blocks (``keep_dense``). Its
    output is whole on every rank: use it for the tail of a network."""

    takes_blocks = "ends"  # parallelkit.spatial.blocks

    def __init__(self, module: nn.Module, comm: Communicator, grid: tuple[int, int]) -> None:
        super().__init__()
        self.module, self.comm, self.grid = module, comm, grid

    def forward(self, x_blk: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x = gather(x_blk, self.comm, self.grid) if record.is_split(x_blk) else x_blk
        return self.module(x, *args, **kwargs)

    def to_dense(self) -> nn.Module:
        return self.module
