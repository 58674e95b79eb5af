"""Rank-side spatial-layer cases, shared by the gloo and mpiexec tiers.

Every rank builds the same dense layer and whole input, runs the dense layer on all of it, and
runs the spatial layer (holding the same parameters) on its block. Triples compare this rank's
block of the output and of the input gradient, and the parameter gradients, which after
backward must equal the dense ones on every rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.nn import spatial_parallel as sp
from parallelkit.nn import spatial_pooling as spool

Triple = tuple[str, torch.Tensor, torch.Tensor]


def dense_layer(kind: str, c_in: int, **kw) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv":
        return nn.Conv2d(c_in, kw.pop("c_out", 3), **kw)
    if kind == "convT":
        return nn.ConvTranspose2d(c_in, kw.pop("c_out", 3), **kw)
    return {
        "maxpool": nn.MaxPool2d,
        "avgpool": nn.AvgPool2d,
        "upsample": nn.Upsample,
        "globalpool": lambda: nn.AdaptiveAvgPool2d(1),
    }[kind](**kw)


def spatial_layer(kind: str, dense: nn.Module, comm: Communicator, grid) -> nn.Module:
    if kind == "conv":
        return sp.SpatialParallelConv2d.from_dense(copy.deepcopy(dense), comm, grid)
    if kind == "convT":
        return sp.SpatialConvTranspose2d.from_dense(copy.deepcopy(dense), comm, grid)
    if kind == "globalpool":
        return spool.SpatialGlobalAvgPool2d(comm=comm)
    cls = {"maxpool": spool.SpatialMaxPool2d, "avgpool": spool.SpatialAvgPool2d}
    return cls.get(kind, spool.SpatialUpsample).from_dense(dense, comm, grid)


def layer_parity(
    comm: Communicator,
    kind: str,
    hw: tuple[int, int],
    grid=None,
    c_in: int = 2,
    batch: int = 2,
    dtype: torch.dtype = torch.float64,
    no_halo: bool = False,
    **kw,
) -> list[Triple]:
    """Spatial ``kind`` layer on this rank's block vs the dense layer on the whole input.

    ``no_halo=True`` is the negative control: each rank convolves its block alone, padding
    its edges as if they were the image's.
    """
    dense = dense_layer(kind, c_in, **kw).to(dtype)
    layer = spatial_layer(kind, dense, comm, grid)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c_in, *hw, generator=g, dtype=dtype, requires_grad=True)
    y = dense(x)
    dy = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(dy)

    blocks = pk.spatial.grid_of(comm, grid)
    rows, cols = blocks.block(*hw)
    out_rows, out_cols = blocks.block(*y.shape[2:])
    if kind == "globalpool":  # ends the spatial region: the whole output on every rank
        out_rows, out_cols = slice(None), slice(None)
    x_blk = x.detach()[:, :, rows, cols].clone().requires_grad_()
    y_blk = dense(x_blk) if no_halo else layer(x_blk)
    y_blk.backward(dy[:, :, out_rows, out_cols])
    triples = [
        ("output", y_blk, y.detach()[:, :, out_rows, out_cols]),
        ("input grad", x_blk.grad, x.grad[:, :, rows, cols]),
    ]
    for (name, p), q in zip(layer.named_parameters(), dense.parameters(), strict=True):
        triples.append((f"{name} grad", p.grad, q.grad))
    return triples
