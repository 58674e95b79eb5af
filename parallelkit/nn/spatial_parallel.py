"""Spatially parallel layers: one image split over a grid of ranks, each keeping its block.

Every layer here takes this rank's block (N, C, h, w) of images split over a
:class:`~parallelkit.spatial.SpatialGrid` in tensor_split layout, and returns its block of the
output in the same layout. From pure geometry (:mod:`parallelkit.geometry`) it knows which
input rows and columns its output block reads; it fetches what it does not hold with
:func:`parallelkit.functional.gather_rows` (usually a halo from the neighbours, from further
ranks when blocks are thinner than the halo; padding rows are zeros, or -inf for max pooling),
then runs the plain torch operation with no padding on the assembled block. Backward sends the
halo gradients back to their owners, who add them in.

Parameters are replicated over the grid and act on split activations, so each rank's
gradient is its share of the dense one: they pass through ``copy_to_group``, whose backward
sums the shares, and after backward every rank holds the dense gradient. Inside
``pk.parallelize``'s spatial region the shares are left as they are and summed after backward
in bucketed all-reduces (:mod:`parallelkit.spatial.layout`).

The whole images' (H, W) come from one small all-gather of the blocks' sizes per call; pass
``size=(H, W)`` to skip it.

Legend: ``_blk`` this rank's block, ``H W`` global sizes, ``[o0, o1)`` output block rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit.functional as pkf
from parallelkit.comm import Communicator, tensor_split_sizes
from parallelkit.geometry import Window, conv_padding, starts, transposed_needs
from parallelkit.nn import spatial_edges
from parallelkit.spatial import layout
from parallelkit.spatial.grid import SpatialGrid, grid_of


def _fetch(
    x_blk: torch.Tensor,
    grid: SpatialGrid,
    windows: tuple[Window, Window],
    size: tuple[int, int],
    fill: float = 0.0,
    native: bool = False,
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """The input rows and columns this rank's output block reads (padding as ``fill``), the
    output block's (h, w), and the padding left to the torch operation.

    ``native=True``: along a dimension that is not split (one rank), with equal padding on
    both sides, nothing is fetched and the operation pads by itself, which saves a copy of
    the whole block.
    """
    out, pads = [], []
    for dim, (win, n) in enumerate(zip(windows, size, strict=True)):
        comm, parts, _ = grid.axis(dim)
        in_sizes, out_sizes, want = win.plan(n, parts)
        if native and parts == 1 and win.pad_lo == win.pad_hi:
            pads.append(win.pad_lo)
        else:
            x_blk = pkf.gather_rows(x_blk, comm, 2 + dim, in_sizes, want, fill)
            pads.append(0)
        out.append(out_sizes[comm.rank])
    return x_blk, (out[0], out[1]), (pads[0], pads[1])


def _fetch_ranges(
    x_blk: torch.Tensor,
    grid: SpatialGrid,
    size: tuple[int, int],
    out_size: Callable[[int, int], int],
    needs: Callable[[int, int, int, int], tuple[int, int]],
) -> tuple[torch.Tensor, list[tuple[int, int]], list[int]]:
    """For layers whose output blocks read input rows that no :class:`Window` describes
    (transposed convolution, upsampling): along each dimension, ``out_size(dim, n)`` output
    rows in tensor_split blocks, and ``needs(dim, o0, o1, n)`` the input rows block
    ``[o0, o1)`` reads. Returns the fetched block, this rank's ``(o0, rows)`` output block and
    the first fetched input row, per dimension.
    """
    blocks, firsts = [], []
    for dim, n in enumerate(size):
        comm, parts, _ = grid.axis(dim)
        out_sizes = tensor_split_sizes(out_size(dim, n), parts)
        want = [
            needs(dim, o0, o0 + o, n) for o0, o in zip(starts(out_sizes), out_sizes, strict=True)
        ]
        x_blk = pkf.gather_rows(x_blk, comm, 2 + dim, tensor_split_sizes(n, parts), want)
        blocks.append((starts(out_sizes)[comm.rank], out_sizes[comm.rank]))
        firsts.append(want[comm.rank][0])
    return x_blk, blocks, firsts


def _crop(y: torch.Tensor, origins: Sequence[int], blocks: Sequence[tuple[int, int]]):
    """Cut (or zero-extend) a local result whose first row along each dimension is global row
    ``origins[dim]`` to this rank's output block ``(o0, rows)``: negative pads crop."""
    (top, bottom), (left, right) = (
        (origin - o0, o0 + o - origin - y.shape[2 + dim])
        for dim, (origin, (o0, o)) in enumerate(zip(origins, blocks, strict=True))
    )
    return F.pad(y, (left, right, top, bottom))


def _empty_output(
    x: torch.Tensor, channels: int, hw: tuple[int, int], *params: torch.Tensor | None
) -> torch.Tensor:
    """An empty output block that still depends on the fetched input and the parameters, so
    that this rank joins the backward exchanges and all-reduces like every other rank."""
    y = x.new_zeros(x.shape[0], channels, *hw)
    for p in params:
        if p is not None:
            y = y + (0 * p).sum()  # a full zero gradient for p, not an expanded one
    return y


def _same_on_every_rank(layer: nn.Module, comm: Communicator) -> None:
    """Replicated parameters start as rank 0's: ranks may have drawn different ones."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for p in layer.parameters():
            if p.device.type != "meta":
                comm.broadcast(p.data, src=0, out=p.data)


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_windows(
    kernel: Sequence[int],
    stride: int | Sequence[int],
    padding: int | str | Sequence[int],
    dilation: int | Sequence[int],
) -> tuple[Window, Window]:
    """The (H, W) windows of a convolution with ``F.conv2d``'s arguments."""
    kernel, stride, dilation = _pair(kernel), _pair(stride), _pair(dilation)
    pads = conv_padding(padding, kernel, dilation)
    return tuple(  # type: ignore[return-value]
        Window(k, s, lo, hi, d)
        for k, s, (lo, hi), d in zip(kernel, stride, pads, dilation, strict=True)
    )


def conv2d_blocks(
    x_blk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: tuple[Window, Window],
    groups: int,
    grid: SpatialGrid,
    size: tuple[int, int],
    overlap: bool = False,
) -> torch.Tensor:
    """This rank's block of ``F.conv2d`` of the whole images of ``size``, whose blocks over
    ``grid`` ``x_blk`` is one of: the edge path where it applies, else the halo fetch.
    ``weight`` and ``bias`` are used as given (the caller picks their gradient convention)."""
    if (edges := spatial_edges.plan(grid, windows, size)) is not None:
        return spatial_edges.conv2d(x_blk, weight, bias, windows, groups, grid, edges, overlap)
    x_halo, out_hw, pad = _fetch(x_blk, grid, windows, size, native=True)
    if min(out_hw) == 0:
        return _empty_output(x_halo, weight.shape[0], out_hw, x_halo, weight, bias)
    stride = tuple(w.stride for w in windows)
    dilation = tuple(w.dilation for w in windows)
    return F.conv2d(x_halo, weight, bias, stride, pad, dilation, groups)


class SpatialParallelConv2d(nn.Conv2d):
    """``nn.Conv2d`` on images split over a ``rows x cols`` grid of ranks (default: rows).

    Any kernel size, stride, padding (ints, tuples, "same", "valid"), dilation and groups;
    uneven splits and blocks thinner than the halo (rows then come from further ranks).
    Forward: fetch the halo, convolve with no padding; backward: return the halo gradients and
    sum the parameter gradients over the grid. Constructed directly, every rank must construct
    it: the parameters start as rank 0's.

    A stride-1 "same" convolution along every split dimension skips the fetch: it convolves
    the block as it is and adds the halo rows' terms to its edge rows
    (:mod:`parallelkit.nn.spatial_edges`), copying nothing; ``overlap = True`` fetches those
    rows on a helper thread while the block is convolved.
    """

    overlap = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | str | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        comm: Communicator,
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        if padding_mode != "zeros":
            raise ValueError(
                f"SpatialParallelConv2d: padding_mode {padding_mode!r} is not supported; "
                "use 'zeros'"
            )
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device, dtype,
        )  # fmt: skip
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)
        self.windows = conv_windows(self.kernel_size, self.stride, padding, self.dilation)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        if x_blk.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}: input has {x_blk.shape[1]} channels, expected "
                f"{self.in_channels} (block shape {tuple(x_blk.shape)})"
            )
        weight = layout.replicated(self.weight, self.comm)
        bias = None if self.bias is None else layout.replicated(self.bias, self.comm)
        return conv2d_blocks(
            x_blk, weight, bias, self.windows, self.groups, self.grid, size, self.overlap
        )

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The whole output's (H, W) for whole inputs of ``size``: geometry only."""
        return self.windows[0].out_size(size[0]), self.windows[1].out_size(size[1])

    @classmethod
    def from_dense(
        cls, conv: nn.Conv2d, comm: Communicator, grid: Sequence[int] | None = None
    ) -> SpatialParallelConv2d:
        """A spatial layer holding ``conv``'s parameters (the same tensors)."""
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.Conv2d:
        """The plain ``nn.Conv2d`` holding this layer's parameters (they are replicated)."""
        conv = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, self.bias is not None, self.padding_mode, device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)


class SpatialConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on images split over a grid of ranks (e.g. the DCGAN generator's
    kernel 4, stride 2, padding 1 upsampling).

    Output row o receives from input rows i with ``i * stride - padding + dilation * t = o``.
    Each rank fetches the input rows its output block receives from (geometry:
    :func:`~parallelkit.geometry.transposed_needs`), runs the transposed convolution on them
    with no padding, and crops (or zero-extends, where no input row reaches) the result to its
    block. The bias is added after cropping, so rows that no input reaches get it too.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        output_padding: int | Sequence[int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | Sequence[int] = 1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        comm: Communicator,
        grid: Sequence[int] | SpatialGrid | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
            bias, dilation, padding_mode, device, dtype,
        )  # fmt: skip
        self.comm, self.grid = comm, grid_of(comm, grid)
        _same_on_every_rank(self, comm)

    def forward(self, x_blk: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if not layout.is_split(x_blk):  # a whole tensor inside a spatial region
            return self.to_dense()(x_blk)
        size = size or self.grid.global_size(x_blk, type(self).__name__)
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation

        def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
            return transposed_needs(o0, o1, n, k[dim], s[dim], p[dim], d[dim])

        x_blk, blocks, firsts = _fetch_ranges(x_blk, self.grid, size, self._out_rows, needs)
        out_hw = (blocks[0][1], blocks[1][1])
        weight = layout.replicated(self.weight, self.comm)
        bias = None if self.bias is None else layout.replicated(self.bias, self.comm)
        if min(out_hw) == 0 or min(x_blk.shape[2:]) == 0:
            y = _empty_output(x_blk, self.out_channels, out_hw, x_blk, weight)
        else:
            y = F.conv_transpose2d(x_blk, weight, None, s, 0, 0, self.groups, d)
            # Local row 0 is where the first fetched input row lands: a * stride - padding.
            y = _crop(y, [firsts[i] * s[i] - p[i] for i in range(2)], blocks)
        return y if bias is None else y + bias.view(-1, 1, 1)

    def _out_rows(self, dim: int, n: int) -> int:
        span = self.dilation[dim] * (self.kernel_size[dim] - 1) + 1
        pad, stride = self.padding[dim], self.stride[dim]
        return (n - 1) * stride - 2 * pad + span + self.output_padding[dim]

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The whole output's (H, W) for whole inputs of ``size``: geometry only."""
        return self._out_rows(0, size[0]), self._out_rows(1, size[1])

    @classmethod
    def from_dense(
        cls, conv: nn.ConvTranspose2d, comm: Communicator, grid: Sequence[int] | None = None
    ) -> SpatialConvTranspose2d:
        if conv.padding_mode != "zeros":
            raise ValueError("SpatialConvTranspose2d: only padding_mode='zeros'")
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.output_padding, conv.groups, conv.bias is not None, conv.dilation,
            device="meta", comm=comm, grid=grid,
        )  # fmt: skip
        layer.weight, layer.bias = conv.weight, conv.bias
        return layer.train(conv.training)

    def to_dense(self) -> nn.ConvTranspose2d:
        conv = nn.ConvTranspose2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.output_padding, self.groups, self.bias is not None, self.dilation,
            device="meta",
        )  # fmt: skip
        conv.weight, conv.bias = self.weight, self.bias
        return conv.train(self.training)
