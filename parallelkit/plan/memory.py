"""Peak memory per rank, by part: the process baseline, parameters with their gradients and
optimizer state, the samples (whole, or only the rank's block with blocks in), the
activations autograd keeps, backward's working set, the token collectives' buffers, and what
a real step holds beyond its tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from parallelkit.geometry import transposed_halo
from parallelkit.plan.grids import Option
from parallelkit.plan.machine import Machine
from parallelkit.plan.mixing_cost import mixing_bytes
from parallelkit.plan.shares import F32, MIB, block_share, halo_rows, spatial_share
from parallelkit.plan.step_time import params_per_rank
from parallelkit.plan.walk import Layer, Net

I64 = 8  # a label: one per sample, or one per pixel (voxel) of a per-pixel network
SAMPLES = "input and labels"  # the memory part that blocks in divides
MIXING = "token mixing"  # the memory part of the token collectives' buffers


def sample_bytes(net: Net, opt: Option, batch: int, blocks_in: bool = False) -> float:
    """The samples one rank holds: its images' input (fp32) and labels (int64: one per pixel
    for a per-pixel network, else one per sample).

    Without ``blocks_in`` every rank of a spatial group holds each whole sample (``pk
    .parallelize``'s default ``spatial_input="whole"``: the region cuts its block from it);
    with ``blocks_in``, only its block of each (``spatial_input="blocks"``, a block reader's
    output), labels alike.
    """
    if not net.input_shape:
        return 0.0
    b, size = batch / opt.data, net.input_shape[1:]
    share = block_share(size, opt.parts(len(size))) if blocks_in and size else 1.0
    labels = math.prod(size) if net.per_pixel else 1
    return b * (math.prod(net.input_shape) * F32 + labels * I64) * share


def activation_bytes(net: Net, opt: Option, batch: int) -> float:
    """What autograd keeps for backward on one rank: every leaf's output (its block under
    spatial parallelism), plus the fetched input block each spatial convolution saves."""
    b, total = batch / opt.data, 0.0
    for layer in net.layers:
        share = spatial_share(layer, opt)
        if not layer.inplace:
            total += b * layer.out_numel * F32 * share
        if opt.spatial > 1 and layer.spatial and layer.window and not _edge_path(layer, opt):
            parts = opt.parts(layer.dims)
            held = [halo_rows(layer, i, p)[1] for i, p in enumerate(parts)]
            total += b * layer.in_shape[0] * math.prod(held) * F32
    return total


def _edge_path(layer: Layer, opt: Option) -> bool:
    """A convolution that saves no fetched block (``parallelkit.spatial.edges.plan``):
    stride 1 and equal padding along every dimension, "same" padding ``p >= 1`` along every
    split one, whose blocks all hold at least ``p`` rows; a transposed convolution whose
    blocks all hold the rows their neighbours want (``transposed_plan``)."""
    parts = opt.parts(layer.dims) if layer.dims else ()
    if layer.kind not in ("conv", "convT") or not any(p > 1 for p in parts):
        return False
    if layer.kind == "convT":
        return all(
            p == 1 or transposed_halo(n, m, p, k, s, pad, d) is not None
            for (k, s, pad, _, d), p, n, m in zip(
                layer.window, parts, layer.in_shape[1:], layer.out_shape[1:], strict=True
            )
        )
    return all(
        s == 1 and lo == hi and (p == 1 or (lo >= 1 and d * (k - 1) == 2 * lo and n // p >= lo))
        for (k, s, lo, hi, d), p, n in zip(layer.window, parts, layer.in_shape[1:], strict=True)
    )


def memory(
    nets: Sequence[Net], opt: Option, batch: int, machine: Machine, blocks_in: bool = False
) -> dict[str, float]:
    """Peak memory per rank, MiB, by part (``blocks_in``: see :func:`sample_bytes`)."""
    params = sum(params_per_rank(net, opt) for net in nets)
    state = params * F32 * (3 + (1 if opt.data > 1 or opt.spatial > 1 else 0))
    samples = sum(sample_bytes(net, opt, batch, blocks_in) for net in nets)
    live = sum(min(net.passes, 2) * activation_bytes(net, opt, batch) for net in nets)
    largest = max(
        layer.out_numel * spatial_share(layer, opt) for net in nets for layer in net.layers
    )
    working = 2 * batch / opt.data * largest * F32
    return {
        "baseline": machine.baseline_mib,
        "parameters, gradients, optimizer": state / MIB,
        SAMPLES: samples / MIB,
        "activations": live / MIB,
        "backward working set": working / MIB,
        MIXING: sum(mixing_bytes(net, opt, batch) for net in nets) / MIB,
        "allocator and workspaces": machine.overhead_mib,
    }
