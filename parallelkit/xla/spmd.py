"""XLA SPMD: parallelkit's strategies written as sharding annotations instead of layers.

Under SPMD (``xr.use_spmd()``) one process drives every device and traces the model once, as
if on a single device; annotations say how tensors are split over a device mesh, and XLA's
partitioner (GSPMD) writes the per-device program with its collectives. The parallel layers
of ``parallelkit.nn`` are not needed: a plain ``nn.Conv2d`` on activations split by height
gets its halo from the neighbours by a collective-permute that XLA inserts, and BatchNorm's
mean over (N, H, W) of a split tensor is already the global one.

The mesh is a parallelkit grid spec, ``data x depth x rows x cols x channel`` (the axes of
:class:`parallelkit.Grid`, in its data-major order: :class:`parallelkit.dims.GridDims`), over
all devices. Annotations:

    tensor                     partition spec                   strategy
    input, activations (N C H W)  (data, channel, rows, cols)   data, spatial (rows/cols)
    conv weight (C' C/g kh kw)    (channel, None, None, None)   channel (output channels)
    ConvTranspose2d weight        (None, channel, None, None)   channel (its dim 1 is C')
    conv bias, BatchNorm params   (channel,)                    channel

Every annotation names all four axes; an axis of size 1 replicates, so one rule covers data,
spatial, channel and their hybrids. A dimension smaller than its axis is left replicated
(the 1 x 1 latent of a DCGAN generator over two rows): splitting it would only pad.
Activations are annotated at the outputs of convolutions, normalizations, pools and
upsamplings (with their gradients, so that backward keeps the layout); what follows the
spatial region (global pooling, the classifier) is left to XLA's sharding propagation.
BatchNorm layers get one correction: torch_xla updates ``running_var`` with the biased
variance, torch with the unbiased one (:class:`_UnbiasedRunningVar`).

Legend: N batch, C channels, H W height and width; mesh axes ``data rows cols channel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

from parallelkit.dims import AXES, STRATEGY_AXIS, GridDims

STRATEGIES = tuple(STRATEGY_AXIS)
ACTIVATION = ("data", "channel", "rows", "cols")
"""Partition spec of an (N, C, H, W) activation."""
ACTIVATIONS = {
    3: ("data", "channel", "rows"),
    4: ACTIVATION,
    5: ("data", "channel", "depth", "rows", "cols"),
}
"""Partition specs of a signal's (N, C, L), an image's and a volume's (N, C, D, H, W)."""

_ANNOTATED = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.Upsample,
)  # fmt: skip


@dataclass(frozen=True)
class SpmdGrid(GridDims):
    """A ``data x depth x rows x cols x channel`` mesh over all devices (the product must
    match)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        devices = xr.global_runtime_device_count()
        self.check_size(devices, "SpmdGrid", f"XLA has {devices} devices")

    def mesh(self) -> xs.Mesh:
        """The device mesh, devices in data-major order like :class:`parallelkit.Grid`'s ranks."""
        return xs.Mesh(np.arange(self.size), self.shape, AXES)


GridSpec = SpmdGrid | Mapping[str, int] | None


def grid_spec(grid: GridSpec, strategy: str = "data") -> SpmdGrid:
    """An :class:`SpmdGrid` from a grid spec: an SpmdGrid, a dict such as ``{"data": 2,
    "rows": 2}``, or None (every device on ``strategy``'s axis: data, rows or channel)."""
    if isinstance(grid, SpmdGrid):
        return grid
    if grid is None:
        if strategy not in STRATEGIES:
            raise ValueError(
                f"parallelize: strategy must be one of {STRATEGIES} or a grid spec, "
                f"got {strategy!r}"
            )
        return SpmdGrid.along(strategy, xr.global_runtime_device_count())
    if unknown := sorted(set(grid) - set(AXES)):
        raise ValueError(f"grid spec: unknown axes {unknown}; use {AXES}")
    return SpmdGrid(**grid)


def spec(t: torch.Tensor, mesh: xs.Mesh, axes: tuple[str | None, ...]) -> tuple:
    """``axes`` with every axis the tensor's dimension cannot be split by dropped (None)."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape, strict=True))
    return tuple(
        a if a is not None and sizes[a] > 1 and n >= sizes[a] else None
        for a, n in zip(axes, t.shape, strict=True)
    )


def shard(t: torch.Tensor, mesh: xs.Mesh, axes: tuple[str | None, ...]) -> torch.Tensor:
    """Annotate ``t`` (a device tensor: input or parameter) in place; returns ``t``."""
    xs.mark_sharding(t, mesh, spec(t, mesh, axes))
    return t


class _UnbiasedRunningVar:
    """Makes an ``nn.BatchNorm*d`` on XLA update ``running_var`` like torch does.

    torch_xla's batch norm (2.9) moves ``running_var`` towards the *biased* batch variance;
    torch uses the unbiased one, ``n / (n - 1)`` times larger for ``n`` values per channel.
    With the running variance before the call kept, the update is rescaled afterwards:
    ``new = old + (xla_new - old) * c`` with ``c = n / (n - 1)`` on the moved part, where
    ``xla_new - old = factor * (biased - old)``; so
    ``new = old * (1 - factor) + (xla_new - old * (1 - factor)) * n / (n - 1)``.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        self.before: torch.Tensor | None = None
        bn.register_forward_pre_hook(self.keep)
        bn.register_forward_hook(self.rescale)

    def keep(self, bn: nn.modules.batchnorm._BatchNorm, inputs: tuple) -> None:
        self.before = bn.running_var.clone() if _updates_running_stats(bn) else None

    def rescale(self, bn: nn.modules.batchnorm._BatchNorm, inputs: tuple, _y) -> None:
        if self.before is None:
            return
        x = inputs[0]
        n = x.numel() // x.shape[1]
        if n < 2:
            return
        factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        with torch.no_grad():  # a new tensor: XLA's batch norm saved the old for backward
            kept = self.before * (1 - factor)
            bn.running_var = kept + (bn.running_var - kept) * (n / (n - 1))
        self.before = None


def _updates_running_stats(bn: nn.modules.batchnorm._BatchNorm) -> bool:
    return bn.training and bn.track_running_stats and bn.running_var is not None


class SpmdModel(nn.Module):
    """``module`` with its input and activations annotated over ``grid``'s mesh.

    Parameters are annotated once, here (they must already be on the XLA device); the input
    at every call. The output is the whole result, as the dense model's: XLA gathers what
    the next operation needs.
    """

    def __init__(self, module: nn.Module, grid: SpmdGrid) -> None:
        super().__init__()
        self.module, self.grid = module, grid
        self.mesh = grid.mesh()
        for m in module.modules():
            _shard_parameters(m, self.mesh)
            if isinstance(m, _ANNOTATED):
                m.register_forward_hook(self._annotate)
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                _UnbiasedRunningVar(m)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if x.dim() in ACTIVATIONS:
            shard(x, self.mesh, ACTIVATIONS[x.dim()])
        return self.module(x, *args, **kwargs)

    def input_sharding(self, ndim: int = 4) -> xs.ShardingSpec:
        """How a batch of ``ndim`` dimensions (4: (N, C, H, W), 5: (N, C, D, H, W)) is
        split: for ``MpDeviceLoader(input_sharding=...)``."""
        return xs.ShardingSpec(self.mesh, ACTIVATIONS[ndim])

    def _annotate(self, _module: nn.Module, _inputs, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(y, torch.Tensor) or y.dim() not in ACTIVATIONS:
            return y
        axes = ACTIVATIONS[y.dim()]
        return xs.mark_sharding_with_gradients(y, self.mesh, spec(y, self.mesh, axes))


def _shard_parameters(m: nn.Module, mesh: xs.Mesh) -> None:
    """Output channels of convolutions, and the per-channel parameters, over ``channel``."""
    if isinstance(m, nn.modules.conv._ConvNd):  # weight (out, in, *kernel); transposed (in, out)
        rest = (None,) * (m.weight.dim() - 2)
        axes = (None, "channel") if m.transposed else ("channel", None)
        shard(m.weight, mesh, (*axes, *rest))
    elif not isinstance(m, nn.modules.batchnorm._BatchNorm):
        return
    for p in (getattr(m, "bias", None), getattr(m, "weight", None)):
        if p is not None and p.dim() == 1:
            shard(p, mesh, ("channel",))


def parallelize(model: nn.Module, grid: GridSpec = None, strategy: str = "data") -> SpmdModel:
    """``model`` (on the XLA device, SPMD enabled) annotated for ``strategy`` over ``grid``.

    grid: an :class:`SpmdGrid` or a dict of its axes, e.g. ``{"data": 2, "rows": 2}`` for
        data x spatial, ``{"depth": 4}`` for volumes split over D; None puts every device on
        ``strategy``'s axis.
    strategy: "data" | "spatial" | "channel": which axis a grid of None puts every device on.
        A grid spec says everything itself (its axes of size 1 replicate; several axes larger
        than 1 make a hybrid), so with one, ``strategy`` is not used.
    """
    if not xr.is_spmd():
        raise ValueError(
            "parallelize(backend='xla-spmd'): call torch_xla.runtime.use_spmd() first, before "
            "any tensor is put on the XLA device"
        )
    return SpmdModel(model, grid_spec(grid, strategy))
