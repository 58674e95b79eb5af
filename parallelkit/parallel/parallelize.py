"""``pk.parallelize``: swap parallel layers into an unchanged model; ``pk.to_dense`` undoes it.

The model keeps its module tree and parameter names; only leaf layers are replaced, by
parallel layers holding the same parameter tensors. In order:

1. spatial: every Conv2d / ConvTranspose2d / MaxPool2d / AvgPool2d / Upsample becomes its
   spatial version over the grid's spatial group, AdaptiveAvgPool2d(1) the global pool that
   ends the spatial region, and the model is wrapped so that its input is scattered into
   blocks and (unless a global pool already made it whole) its output gathered again.
   channel: every Conv1d/2d/3d (ConvTranspose1d/2d/3d) becomes a ChannelParallelConv1d/2d/3d
   (ChannelParallelConvTranspose1d/2d/3d) over the channel group, taking and returning whole
   tensors: split by output channels, or by input channels where there are fewer output
   channels than ranks (a layer with too few of both stays dense). A model in which no layer
   can be split is refused (a ValueError naming it): every rank would run all of it.
2. BatchNorm becomes SyncBatchNorm over the ranks that hold parts of the same batch of images
   (data x spatial).
3. With a data dimension, DataParallel over the data group averages the gradients. Under
   spatial parallelism each rank's parameter gradients are its block's shares of the dense
   ones (:mod:`parallelkit.spatial.record`): DataParallel over the data x spatial group sums
   them and divides by the data dimension, in bucketed all-reduces overlapped with backward.

Every rank passes the same whole input and gets the same whole output (or the loss computed
from it), as from the dense model. Layers named in ``keep_dense`` run on whole (gathered)
tensors instead (under channel parallelism: stay dense), e.g. a discriminator's last 4x4
convolution.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from parallelkit.comm import Communicator
from parallelkit.nn import channel_parallel as cp
from parallelkit.nn import channel_transposed as ct
from parallelkit.nn.batchnorm_subclass import is_plain_batchnorm, sync_subclass
from parallelkit.nn.sync_batchnorm import SyncBatchNorm
from parallelkit.parallel.data_parallel import DataParallel
from parallelkit.parallel.grid import Grid
from parallelkit.spatial.blocks import spatial_layer
from parallelkit.spatial.fallback import check_fallback
from parallelkit.spatial.region import (
    OnWholeSamples,
    SpatialRegion,
    check_whole_or_blocks,
)

STRATEGIES = ("data", "spatial", "channel")


def parallelize(
    model: nn.Module,
    comm: Communicator | Grid,
    strategy: str | Grid = "data",
    *,
    keep_dense: Sequence[str] = (),
    backend: str | None = None,
    spatial_output: str = "whole",
    spatial_input: str = "whole",
    spatial_size: Sequence[int] | None = None,
    fallback: str = "refuse",
    **data_parallel_kwargs,
) -> nn.Module:
    """``model`` with its layers swapped for parallel ones (see the module docstring).

    comm: a communicator (the whole of it does ``strategy``) or a :class:`Grid`.
    strategy: "data" | "spatial" | "channel", or a Grid (its model-parallel dimension picks the
        strategy, and its data dimension adds data parallelism).
    keep_dense: names of modules to run on whole tensors under spatial parallelism.
    backend: None (layers over ``comm``) or "xla-spmd": the same strategies as XLA sharding
        annotations (:func:`parallelkit.xla.parallelize`); ``comm`` is then a grid spec
        (``parallelkit.xla.SpmdGrid``, a dict such as ``{"data": 2, "rows": 2}``, or None).
    spatial_output: "whole" (every rank gets the whole output, wherever its spatial
        dimensions are: a flatten, a ViT's hidden tokens) or "blocks": under spatial
        parallelism outputs that are still split come back as this rank's block, as
        ``pk.spatial.scatter(output, grid.spatial_comm, grid.spatial)`` would cut them, for a
        loss computed on blocks and reduced exactly (segmentation at full resolution).
    spatial_input: "whole" (every rank passes the whole input, the region cuts its block) or
        "blocks": every rank passes only its block of the input, in the layout
        ``pk.spatial.scatter`` cuts, so that no rank ever holds a whole sample (a block
        reader's output). The whole size comes from ``spatial_size`` (the sample's spatial
        size, e.g. ``(D, H, W)``), or else from one small host all-gather of the blocks'
        sizes per forward, which also checks the layout.
    fallback: under spatial parallelism, what an operation without an exact rule for blocks
        does: "refuse" (a ValueError naming it, before any rank waits) or "gather" (the
        smallest module holding it runs on the whole images, gathered on every rank, and its
        outputs are split again: exact, at that module's memory cost, warned once per module).
    data_parallel_kwargs: passed to DataParallel (with a data dimension, and under spatial
        parallelism, where it sums the parameter gradients over the spatial group).
    """
    if backend == "xla-spmd":
        from parallelkit.xla import parallelize as parallelize_spmd

        return parallelize_spmd(model, comm, strategy)  # type: ignore[arg-type]
    if backend is not None:
        raise ValueError(f"parallelize: backend must be None or 'xla-spmd', got {backend!r}")
    check_whole_or_blocks("parallelize", spatial_output=spatial_output, spatial_input=spatial_input)
    check_fallback(fallback, "parallelize")
    grid = _grid(comm, strategy)
    spatial = grid.dims.spatial_size
    # The spatial strategy on a plain communicator splits a sample's first spatial dimension
    # (L, D, or H), whatever the model's; a Grid says which dimensions it splits.
    shape = None if not isinstance(comm, Grid) and strategy == "spatial" else grid.spatial
    if isinstance(strategy, Grid):
        strategy = "spatial" if spatial > 1 else "channel" if grid.channel > 1 else "data"
    if strategy not in STRATEGIES:
        raise ValueError(
            f"parallelize: strategy must be one of {STRATEGIES} or a Grid, got {strategy!r}"
        )
    if strategy == "data" and grid.dims.model > 1:
        raise ValueError(f"parallelize: strategy 'data' with a model-parallel grid {grid}")
    if spatial > 1 and grid.channel > 1:
        raise ValueError("parallelize: spatial and channel parallelism together are not supported")

    names = dict(model.named_modules())
    if unknown := sorted(set(keep_dense) - set(names)):
        raise ValueError(f"parallelize: keep_dense names unknown modules {unknown}")
    if strategy == "spatial":
        for name in keep_dense:
            _replace(model, name, OnWholeSamples(names[name], grid.spatial_comm, shape))
        _swap(model, lambda m: _spatial_layer(m, grid.spatial_comm, shape), skip=keep_dense)
    elif strategy == "channel":
        _swap(model, lambda m: _channel_layer(m, grid.channel_comm), skip=keep_dense)
        _check_channel_split(model, grid.channel_comm.size, keep_dense)
    spatial_grad = grid.spatial_comm if strategy == "spatial" else None
    _swap(model, lambda m: _sync_batchnorm(m, grid.batch_comm, spatial_grad))
    if strategy == "spatial":
        model = SpatialRegion(
            model, grid.spatial_comm, shape, grid.data_comm, spatial_output, shares=True,
            fallback=fallback, input=spatial_input, size=spatial_size,
        )
        # Its parameters' gradients are shares: summed over data x spatial, divided by the
        # data dimension. With no data dimension this is an implementation detail: parameters
        # unused in a step keep their gradient, as the dense model's do, and the spatial
        # group's buffers are equal already (SyncBatchNorm).
        if grid.data == 1:
            data_parallel_kwargs = {
                "find_unused_parameters": True, "broadcast_buffers": False, **data_parallel_kwargs
            }
        model = DataParallel(model, grid.batch_comm, replicas=grid.data, **data_parallel_kwargs)
    elif grid.data > 1:
        model = DataParallel(model, grid.data_comm, **data_parallel_kwargs)
    return model


def to_dense(model: nn.Module) -> nn.Module:
    """The original architecture again: same module tree and state_dict keys, holding the
    current parameters and buffers (the same tensors; ``copy.deepcopy`` the result to detach
    it). Channel-sharded weights are gathered, so every rank of the group must call this."""
    while isinstance(model, DataParallel | SpatialRegion):
        model = model.module
    if hasattr(model, "to_dense"):
        return model.to_dense()
    dense = copy.copy(model)
    dense._modules = {name: to_dense(child) for name, child in model._modules.items()}
    return dense


# --------------------------------------------------------------------------- swapping
def _spatial_layer(m: nn.Module, comm: Communicator, shape: Any) -> nn.Module | None:
    """The spatial layer that stands for ``m`` (:mod:`parallelkit.spatial.blocks`); a module no
    layer covers stays as it is, and its forward's functional calls meet the guard."""
    layer = spatial_layer(m)
    return None if layer is None else layer.from_dense(m, comm, shape)


def _sync_batchnorm(
    m: nn.Module, comm: Communicator, grad_comm: Communicator | None
) -> nn.Module | None:
    """BatchNorm -> SyncBatchNorm; a subclass with behaviour of its own keeps it and its class
    and synchronizes the ``F.batch_norm`` calls of its forward."""
    if not isinstance(m, nn.modules.batchnorm._BatchNorm):
        return None
    if is_plain_batchnorm(m):
        return SyncBatchNorm.from_dense(m, comm, grad_comm=grad_comm)
    return sync_subclass(m, comm, grad_comm)


_CHANNEL_CONVS: dict[type, type[cp.ChannelParallelConvNd]] = {
    nn.Conv1d: cp.ChannelParallelConv1d,
    nn.Conv2d: cp.ChannelParallelConv2d,
    nn.Conv3d: cp.ChannelParallelConv3d,
}
_CHANNEL_TRANSPOSED: dict[type, type[ct.ChannelParallelConvTransposeNd]] = {
    nn.ConvTranspose1d: ct.ChannelParallelConvTranspose1d,
    nn.ConvTranspose2d: ct.ChannelParallelConvTranspose2d,
    nn.ConvTranspose3d: ct.ChannelParallelConvTranspose3d,
}
_CHANNEL_SPLIT = (cp.ChannelParallelConvNd, ct.ChannelParallelConvTransposeNd)


def _channel_layer(m: nn.Module, comm: Communicator) -> nn.Module | None:
    """Split by output channels where there are enough of them, else by input channels; a
    layer with too few of either stays dense (it runs whole on every rank, exactly)."""
    kind, n = type(m), comm.size
    if kind in _CHANNEL_CONVS:
        groups = m.groups
        if groups == 1 or groups >= n:
            for split, channels in (("out", m.out_channels), ("in", m.in_channels)):
                if channels >= n and (groups == 1 or split == "out"):
                    return _CHANNEL_CONVS[kind].from_dense(m, comm, split=split)
    if kind in _CHANNEL_TRANSPOSED and m.groups == 1 and max(m.in_channels, m.out_channels) >= n:
        return _CHANNEL_TRANSPOSED[kind].from_dense(m, comm)
    return None


def _check_channel_split(model: nn.Module, ranks: int, keep_dense: Sequence[str]) -> None:
    """Refuse a channel strategy that split nothing: every rank would run the whole model.

    Decided from the model's structure alone, so every rank refuses alike, before any
    collective."""
    if ranks == 1 or any(isinstance(m, _CHANNEL_SPLIT) for m in model.modules()):
        return
    kinds = (*_CHANNEL_CONVS, *_CHANNEL_TRANSPOSED)
    convs = [(n, m) for n, m in model.named_modules() if type(m) in kinds]
    if not convs:
        why = (
            "it has no nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d, the layers this strategy "
            "splits by channels"
        )
    else:
        shown = ", ".join(
            f"{n or 'the model'} ({type(m).__name__} {m.in_channels} -> {m.out_channels}"
            + (f", groups={m.groups})" if m.groups > 1 else ")")
            for n, m in convs[:4]
        )
        more = f" and {len(convs) - 4} more" if len(convs) > 4 else ""
        kept = f" or named in keep_dense={list(keep_dense)}" if keep_dense else ""
        why = (
            f"each of its {len(convs)} convolutions has fewer than {ranks} channels on both "
            f"sides (or groups it cannot split into whole groups over {ranks} ranks){kept}: "
            f"{shown}{more}"
        )
    raise ValueError(
        f"parallelize: the channel strategy over {ranks} ranks splits nothing in "
        f"{type(model).__name__}: {why}. Every rank would run the whole model; use the data "
        "strategy (or spatial), or fewer channel ranks"
    )


def _swap(module: nn.Module, make, skip: Sequence[str] = (), prefix: str = "") -> None:
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if full in skip or isinstance(child, OnWholeSamples):
            continue
        new = make(child)
        if new is not None:
            setattr(module, name, new)
        else:
            _swap(child, make, skip, f"{full}.")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _grid(comm: Communicator | Grid, strategy: str | Grid) -> Grid:
    if isinstance(strategy, Grid):
        return strategy
    if isinstance(comm, Grid):
        return comm
    n = comm.size
    shape = {"data": dict(data=n), "spatial": dict(rows=n), "channel": dict(channel=n)}
    if strategy not in shape:
        raise ValueError(
            f"parallelize: strategy must be one of {STRATEGIES} or a Grid, got {strategy!r}"
        )
    return Grid(comm, **shape[strategy])
