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
from parallelkit.nn.spatial_upsample import SpatialUpsample

Triple = tuple[str, torch.Tensor, torch.Tensor]


class DenseRejects(Exception):
    """The dense layer refuses the input (e.g. smaller than its window)."""


def dense_layer(kind: str, c_in: int, **kw) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv":
        return nn.Conv2d(c_in, kw.pop("c_out", 2), **kw)
    if kind == "convT":
        return nn.ConvTranspose2d(c_in, kw.pop("c_out", 2), **kw)
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
    return cls.get(kind, SpatialUpsample).from_dense(dense, comm, grid)


def layer_parity(
    comm: Communicator,
    kind: str,
    hw: tuple[int, int],
    grid=None,
    c_in: int = 2,
    batch: int = 2,
    dtype: torch.dtype = torch.float64,
    no_halo: bool = False,
    device: str | None = None,
    **kw,
) -> list[Triple]:
    """Spatial ``kind`` layer on this rank's block vs the dense layer on the whole input.

    ``no_halo=True`` is the negative control: each rank convolves its block alone, padding
    its edges as if they were the image's. ``device``: where the spatial layer runs.
    """
    dense = dense_layer(kind, c_in, **kw).to(dtype)
    layer = spatial_layer(kind, dense, comm, grid).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c_in, *hw, generator=g, dtype=dtype, requires_grad=True)
    try:
        y = dense(x)
    except RuntimeError as e:  # before any communication, the same on every rank
        raise DenseRejects(str(e)) from e
    dy = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(dy)

    blocks = pk.spatial.grid_of(comm, grid)
    rows, cols = blocks.block(*hw)
    out_rows, out_cols = blocks.block(*y.shape[2:])
    if kind == "globalpool":  # ends the spatial region: the whole output on every rank
        out_rows, out_cols = slice(None), slice(None)
    x_blk = x.detach()[:, :, rows, cols].clone().to(device).requires_grad_()
    y_blk = dense(x_blk) if no_halo else layer(x_blk)
    y_blk.backward(dy[:, :, out_rows, out_cols].to(device))
    triples = [
        ("output", y_blk, y.detach()[:, :, out_rows, out_cols]),
        ("input grad", x_blk.grad, x.grad[:, :, rows, cols]),
    ]
    for (name, p), q in zip(layer.named_parameters(), dense.parameters(), strict=True):
        triples.append((f"{name} grad", p.grad, q.grad))
    return triples


# ----------------------------------------------------------------------------- matrices
def conv_configs(c: int = 2):
    """The valid kernel x stride x padding x dilation x groups combinations of the issue."""
    for k in (1, 2, 3, 4, 5, 7):
        for s in (1, 2, 3):
            for p in (0, 1, 2, 3, "same"):
                for d in (1, 2):
                    for groups in (1, c):
                        if p == "same" and s != 1:
                            continue  # torch allows "same" with stride 1 only
                        yield dict(kernel_size=k, stride=s, padding=p, dilation=d, groups=groups)


def failures(comm: Communicator, kind: str, configs, hw, grid=None, **common) -> tuple[int, list]:
    """Run ``layer_parity`` for every config; (how many ran, descriptions of mismatches).

    Configs whose dense layer rejects the input size (too small for the window) are skipped
    on every rank alike: the spatial layer would raise the same way.
    """
    ran, bad = 0, []
    for kw in configs:
        try:
            triples = layer_parity(comm, kind, hw, grid, **common, **kw)
        except DenseRejects:
            continue
        ran += 1
        for label, got, expected in triples:
            if (
                got is None
                or got.shape != expected.shape
                or not torch.allclose(got, expected, rtol=1e-10, atol=1e-10)
            ):
                bad.append(f"{kind} {kw} {hw} grid={grid}: {label}")
    return ran, bad


def conv_transpose_configs(c: int = 2):
    for k in (1, 2, 3, 4, 5):
        for s in (1, 2, 3):
            for p in (0, 1, 2):
                for d in (1, 2):
                    for op in {0, s - 1, min(s, d) - 1}:
                        for groups in (1, c):
                            yield dict(
                                kernel_size=k, stride=s, padding=p, dilation=d, groups=groups,
                                output_padding=op,
                            )  # fmt: skip


POOL_CONFIGS = [
    ("maxpool", dict(kernel_size=3, stride=2, padding=1)),  # the ResNet stem
    ("maxpool", dict(kernel_size=2)),
    ("maxpool", dict(kernel_size=3, stride=1, padding=1, dilation=2)),
    ("maxpool", dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0))),
    ("avgpool", dict(kernel_size=3, stride=2, padding=1)),
    ("avgpool", dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    ("avgpool", dict(kernel_size=2)),
    ("avgpool", dict(kernel_size=4, stride=3, padding=2, divisor_override=5)),
    # ceil_mode: last windows past the padding (counted up to its end, or not at all)
    ("maxpool", dict(kernel_size=2, ceil_mode=True)),
    ("maxpool", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("avgpool", dict(kernel_size=2, ceil_mode=True)),
    ("avgpool", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("avgpool", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("avgpool", dict(kernel_size=2, stride=3, ceil_mode=True, divisor_override=3)),
    ("upsample", dict(scale_factor=2)),
    ("upsample", dict(scale_factor=3)),
    ("upsample", dict(scale_factor=2, mode="bilinear")),
    ("upsample", dict(scale_factor=3, mode="bilinear")),
    ("globalpool", {}),
]


def other_failures(comm: Communicator, hw, grid=None) -> tuple[int, list]:
    ran, bad = 0, []
    for kind, kw in POOL_CONFIGS:
        n, b = failures(comm, kind, [kw], hw, grid)
        ran, bad = ran + n, bad + b
    return ran, bad


def bad_grid(comm: Communicator) -> str:
    try:
        sp.SpatialParallelConv2d(2, 2, 3, comm=comm, grid=(comm.size + 1, 1))
    except ValueError as e:
        return str(e)
    return "no error"


def bad_layout(comm: Communicator) -> str:
    """Blocks that are not the tensor_split layout of any image raise on every rank."""
    layer = sp.SpatialParallelConv2d(2, 2, 3, padding=1, comm=comm)
    try:
        layer(torch.zeros(1, 2, 2 + 2 * comm.rank, 5))
    except ValueError as e:
        return str(e)
    return "no error"


def scatter_gather(comm: Communicator, grid) -> list[Triple]:
    x = torch.randn(2, 3, 7, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = pk.spatial.gather(pk.spatial.scatter(x, comm, grid) * 2, comm, grid)
    y.backward(torch.ones_like(y))
    return [("round trip", y, x.detach() * 2), ("gradient", x.grad, torch.full_like(x, 2.0))]


def constructed_on_every_rank(comm: Communicator) -> list[Triple]:
    """Ranks seeded differently still hold rank 0's parameters after construction."""
    torch.manual_seed(comm.rank)
    layers = [
        sp.SpatialParallelConv2d(2, 3, 3, comm=comm),
        sp.SpatialConvTranspose2d(2, 3, 4, 2, 1, comm=comm),
    ]
    out = []
    for layer in layers:
        for name, p in layer.named_parameters():
            out.append((name, p.detach(), comm.broadcast(p.detach(), src=0)))
    return out


def overlapped(comm: Communicator, *args, **kwargs) -> tuple[int, list]:
    """``failures`` with SpatialParallelConv2d fetching its halo rows on a helper thread."""
    from parallelkit.nn import SpatialParallelConv2d

    SpatialParallelConv2d.overlap = True
    try:
        return failures(comm, *args, **kwargs)
    finally:
        SpatialParallelConv2d.overlap = False


def edges_left_out(comm: Communicator, size: tuple[int, int], grid=None) -> list[str]:
    """Negative control of the edge path: with the halo rows' terms not added to the block's
    edge rows, the output and the gradients must not match."""
    from parallelkit.spatial import edges as spatial_edges

    real = spatial_edges.add_halo_terms
    spatial_edges.add_halo_terms = lambda y, *args: y
    try:
        _, bad = failures(comm, "conv", [dict(kernel_size=3, padding=1)], size, grid)
    finally:
        spatial_edges.add_halo_terms = real
    return bad


def transposed_halos_left_out(comm: Communicator, size: tuple[int, int], grid=None) -> list[str]:
    """Negative control of the transposed edge path: with no halo rows fetched (every block
    scattered alone), the output and the gradients must not match."""
    import dataclasses

    from parallelkit.spatial import edges as spatial_edges

    real = spatial_edges.transposed_plan

    def no_halos(*args):
        plans = real(*args)
        assert plans is not None, "the control needs the edge path"
        return tuple(dataclasses.replace(e, lo=0, hi=0) for e in plans)

    spatial_edges.transposed_plan = no_halos
    try:
        _, bad = failures(comm, "convT", [dict(kernel_size=4, stride=2, padding=1)], size, grid)
    finally:
        spatial_edges.transposed_plan = real
    return bad


def saved_bytes(
    comm: Communicator, hw: tuple[int, int], grid=None, stride: int = 1, kind: str = "conv"
):
    """What a spatial 3x3 convolution (``kind="convT"``: a 4x4, stride 2 transposed one)
    keeps for backward beyond its parameters and its input block (which the previous layer
    saves anyway), measured with saved_tensors_hooks: the edge path keeps only thin slabs,
    where assembling the halo-extended block (the general path, taken by a stride of 2) keeps
    a copy."""
    from parallelkit.nn import SpatialConvTranspose2d, SpatialParallelConv2d

    torch.manual_seed(0)
    if kind == "convT":
        dense = nn.ConvTranspose2d(8, 8, 4, 2, padding=1).double()
        layer = SpatialConvTranspose2d.from_dense(dense, comm, grid)
    else:
        dense = nn.Conv2d(8, 8, 3, stride, padding=1).double()
        layer = SpatialParallelConv2d.from_dense(dense, comm, grid)
    x = torch.randn(2, 8, *hw, dtype=torch.float64)
    x_blk = pk.spatial.scatter(x, comm, grid).requires_grad_()
    known = {x_blk.data_ptr(), layer.weight.data_ptr()}
    extra: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in known:
            extra.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x_blk)
    block = x_blk.numel() * x_blk.element_size()
    h, w = x_blk.shape[2:]
    return {"extra": sum(extra), "block": block, "row": block // h, "column": block // w, "w": w}
