"""parallelkit on XLA devices (TPU cores; CPU devices for tests): SPMD sharding and loaders.

Two ways to run on XLA, both needing ``torch_xla`` (its own environment: it pins torch):

- one process per device, ``pk.init("xla")`` under ``torch_xla.launch``: the communicator of
  :mod:`parallelkit.comm.xla` drives the parallel layers and DataParallel unchanged;
- SPMD, one process for all devices: :func:`parallelize` here (or
  ``pk.parallelize(model, grid, strategy, backend="xla-spmd")``) annotates a plain model and
  XLA partitions it.

See docs/tpu.md for commands on Cloud TPU VMs and pod slices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch_xla
import torch_xla.distributed.parallel_loader as pl

from parallelkit.xla.spmd import (
    ACTIVATION,
    AXES,
    GridSpec,
    SpmdGrid,
    SpmdModel,
    grid_spec,
    parallelize,
    shard,
)


def device_loader(loader: Iterable, model: SpmdModel | None = None) -> pl.MpDeviceLoader:
    """``loader``'s batches moved to the XLA device in the background (``MpDeviceLoader``).

    With an SPMD ``model`` the (N, C, H, W) inputs arrive already split like its input
    (``model.input_sharding()``); every other tensor of a batch is replicated. Without, each
    replica of a multi-process job loads its own batches to its own device.
    """
    sharding = model.input_sharding() if model is not None else None
    return pl.MpDeviceLoader(loader, torch_xla.device(), input_sharding=sharding)


__all__ = [
    "ACTIVATION",
    "AXES",
    "GridSpec",
    "SpmdGrid",
    "SpmdModel",
    "device_loader",
    "grid_spec",
    "parallelize",
    "shard",
]
