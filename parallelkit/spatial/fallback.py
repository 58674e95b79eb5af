"""``fallback="gather"``: a module the spatial rules refuse runs on gathered whole images.

Where an operation on blocks has no exact rule, the default refuses (the whole network stays
unparallel until the user acts). With ``fallback="gather"`` the smallest module of the model
whose forward holds that operation runs instead on the whole images: its block inputs are
gathered on every rank of the spatial group, it computes what the dense model computes (its
swapped layers and BatchNorm see whole tensors and act densely, statistics over the data
group), and its outputs are cut back into blocks, so the layers after it are split again.

Exactness: gathering and scattering are each other's adjoints in the region's gradient
convention (:mod:`parallelkit.spatial.record`), so the gathered module's parameters receive
shares of their dense gradients like every other parameter, and its input blocks the dense
input gradient. Nothing is applied twice: a refusal is found during a forward, which is then
abandoned and run again from the start with the module gathered, after the model's buffers
(BatchNorm running statistics) and the random generators are put back as they were. Every rank
refuses at the same operation, so every rank starts again together; a module, once found,
stays gathered for the region's life.

Cost: one warning per module names its path and the memory per rank of its whole input and
output (its activations inside are not split either).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from parallelkit.comm import Communicator
from parallelkit.spatial.grid import gather, scatter
from parallelkit.spatial.refusal import SpatialRefusal

FALLBACKS = ("refuse", "gather")


def check_fallback(fallback: str, where: str) -> None:
    if fallback not in FALLBACKS:
        raise ValueError(f"{where}: fallback must be one of {FALLBACKS}, got {fallback!r}")


def _snapshot(model: nn.Module) -> Callable[[], None]:
    """A function that puts the model's buffers and the random generators back as they are
    now."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore() -> None:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    return restore


def forward_with_fallback(
    model: nn.Module, gathered: set[nn.Module], attempt: Callable[[], Any], comm: Communicator
) -> Any:
    """``attempt()`` (one forward of ``model`` under a guard that gathers ``gathered``), again
    with each refused operation's module added to ``gathered``, until none is refused. A
    model's own error on blocks is acted on only where every rank of ``comm`` (the spatial
    group) raised it in the same module: one host all-gather says so."""
    while True:
        restore = _snapshot(model)
        try:
            return attempt()
        except SpatialRefusal as e:
            module = e.module if e.module is not None else model
            if module in gathered:  # its blocks did not come through its arguments
                raise
            if not e.same_everywhere:
                index = list(model.modules()).index(module)
                if any(row != [index] for row in comm.all_gather_ints([index])):
                    raise
            gathered.add(module)
            restore()


def _moves(t: Tensor, dims: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where the spatial dimensions ``dims`` of ``t`` are, and where (N, C, *spatial) has them
    (the last dimensions), both from the front."""
    return tuple(t.dim() + d for d in dims), tuple(range(t.dim() - len(dims), t.dim()))


def gather_inputs(guard: Any, args: tuple) -> tuple:
    """``args`` with every block replaced by the whole samples (gathered along wherever its
    spatial dimensions are)."""

    def whole(t: Any) -> Any:
        if not guard.is_split(t):
            return t
        where, last = _moves(t, guard.places(t))
        y = gather(t.movedim(where, last), guard.comm, guard.grid, size=guard.size_of(t))
        return y.movedim(last, where)

    with guard.suspended():
        return tree_map(whole, args)


def scatter_outputs(guard: Any, out: Any, dims: tuple[int, ...], ndim: int) -> Any:
    """``out`` with every tensor shaped like the gathered input (``ndim`` dimensions, the
    spatial ones at ``dims``, at least one row per rank along each) cut into this rank's
    blocks again."""
    counts = guard.grid.counts(len(dims))

    def block(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() != ndim:
            return t
        where, last = _moves(t, dims)
        size = tuple(t.shape[d] for d in where)
        if any(n < parts for n, parts in zip(size, counts, strict=True)):
            return t
        y = scatter(t.movedim(where, last), guard.comm, guard.grid).movedim(last, where)
        return guard.marked(_laid_out_like(y, t), dims, size=size)

    with guard.suspended():
        return tree_map(block, out)


def _laid_out_like(block: Tensor, whole: Tensor) -> Tensor:
    """``block`` contiguous in the memory format of ``whole``: a model that calls ``.view`` on
    the module's output (valid on the whole tensor) must find a block it can view, and a
    column block cut from a contiguous tensor is not contiguous."""
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        if whole.is_contiguous(memory_format=fmt):
            return block.contiguous(memory_format=fmt)
    return block


def gathered_message(path: str, module: nn.Module, args: tuple, out: Any) -> str:
    """The warning for a gathered module: its path and the memory of its whole input and
    output."""
    leaves = [t for t in tree_leaves((args, out)) if isinstance(t, Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in leaves)
    return (
        f"spatial parallelism (fallback='gather'): {path or 'the model'!r} "
        f"({type(module).__name__}) runs on the whole images, gathered on every rank: "
        f"{nbytes / 2**20:.1f} MiB per rank for its whole input and output, and its "
        "activations inside are not split"
    )
