"""Spatial geometry as pure functions: how rows are split over ranks and which input rows each
rank's output rows need. No communication; every rank computes the same answers.

A tensor split along one dimension over P ranks is split like ``torch.tensor_split``: rank i
holds rows ``[starts[i], starts[i] + sizes[i])``, the first blocks one larger. Every spatial
layer keeps its *output* split this way and asks its :class:`Window` which *input* rows each
output block needs; ranges may reach past the ends of the input (padding rows).

Legend: ``n`` input rows, ``m`` output rows, ``[o0, o1)`` an output block, ``(start, stop)``
a half-open range of global input rows.

A rank's block of a sample is a :class:`BlockLayout`: made once from the grid, it travels from
the loader and the block data set to the first convolution (``SpatialGrid.block`` cuts by it).

Nothing here imports the rest of parallelkit: communicators, layers and loaders all split
sizes with :func:`tensor_split_sizes` and read per-dimension arguments with :func:`per_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Range = tuple[int, int]
GRID_AXES = ("depth", "rows", "cols")
"""A spatial grid's dimensions, in the order of a volume's (D, H, W) that they split."""


def tensor_split_sizes(total: int, parts: int) -> list[int]:
    """Block sizes of ``torch.tensor_split(range(total), parts)``: the first blocks one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def per_dim(value: Any, dims: int = 2) -> tuple:
    """A layer argument per spatial dimension: one value repeated ``dims`` times, a sequence
    as a tuple (``kernel_size=3`` -> ``(3, 3)``, ``stride=(2, 1)`` -> ``(2, 1)``,
    ``scale_factor=2.0`` -> ``(2.0, 2.0)``, ``output_size=(7, None)`` as it is)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(value)
    return (value,) * dims


def starts(sizes: Sequence[int]) -> list[int]:
    """Where each block starts: ``[0, sizes[0], sizes[0] + sizes[1], ...]``."""
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def blocks(total: int, parts: int) -> list[Range]:
    """The ``(start, stop)`` of each rank's block of ``total`` rows."""
    sizes = tensor_split_sizes(total, parts)
    return [(a, a + s) for a, s in zip(starts(sizes), sizes, strict=True)]


def split_axes(grid: Sequence[int], ndim: int, first: bool = False) -> tuple[int, ...]:
    """Which axis of a ``(depth, rows, cols)`` grid splits each spatial dimension of a sample
    with ``ndim`` of them: a volume's (D, H, W) all three, an image's (H, W) rows and cols, a
    signal's L rows. ``first``: the grid of a plain communicator, whose depth axis holds every
    rank and splits the first spatial dimension whatever the sample (L, D, or H). A grid that
    splits along an axis the sample lacks is a ``ValueError``."""
    if first or ndim == 3:
        return (0, 1, 2)[:ndim]
    if ndim == 2 and grid[0] == 1:
        return (1, 2)
    if ndim == 1 and grid[0] == 1 and grid[2] == 1:
        return (1,)
    split = " x ".join(f"{v} {n}" for n, v in zip(GRID_AXES, grid, strict=True) if v > 1)
    why = {
        1: "signals (N, C, L) are split by rows only",
        2: "images (N, C, H, W) have no depth: depth splits the D of volumes",
    }
    raise ValueError(
        f"a spatial grid of {split} cannot split samples with {ndim} spatial dimensions: "
        + why.get(ndim, "samples are (N, C, L), (N, C, H, W) or (N, C, D, H, W)")
    )


@dataclass(frozen=True)
class BlockLayout:
    """The block of a sample that one rank holds, for samples of any size: ``counts[d]`` parts
    along spatial dimension ``d`` (``torch.tensor_split`` layout, as ``pk.spatial.scatter``
    cuts), of which this rank holds part ``coords[d]``.

    Made once from the grid's shape (:meth:`of_grid`, ``SpatialGrid.block_layout``) and the
    one description of a block from the loader and the block data set to the spatial region.
    Plain numbers, no communicator: it pickles into DataLoader workers.
    """

    counts: tuple[int, ...]
    coords: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(int(p) for p in self.counts))
        object.__setattr__(self, "coords", tuple(int(i) for i in self.coords))
        if len(self.counts) != len(self.coords) or not all(
            0 <= i < p for p, i in zip(self.counts, self.coords, strict=True)
        ):
            raise ValueError(
                f"BlockLayout: coords {self.coords} do not name a block of a grid of "
                f"{self.counts} (one coordinate per count, each in [0, count))"
            )

    @classmethod
    def of_grid(
        cls, grid: Sequence[int], coords: Sequence[int], ndim: int, first: bool = False
    ) -> BlockLayout:
        """The layout of the rank at ``coords`` ``(z, row, col)`` of a ``(depth, rows, cols)``
        grid for samples with ``ndim`` spatial dimensions (:func:`split_axes` says which grid
        axis splits each)."""
        axes = split_axes(grid, ndim, first)
        return cls(tuple(int(grid[a]) for a in axes), tuple(int(coords[a]) for a in axes))

    @property
    def ndim(self) -> int:
        """The spatial dimensions of the samples it splits."""
        return len(self.counts)

    @property
    def split(self) -> bool:
        """Whether any dimension is split (else this rank's block is the whole sample)."""
        return any(p > 1 for p in self.counts)

    def slices(self, *size: int) -> tuple[slice, ...]:
        """This rank's slice along each spatial dimension of a sample of ``size``."""
        if len(size) != self.ndim:
            raise ValueError(
                f"a grid of {self.counts} splits samples of {self.ndim} "
                f"spatial dimensions, not {size}"
            )
        return tuple(
            slice(*blocks(n, p)[i]) for n, p, i in zip(size, self.counts, self.coords, strict=True)
        )

    def shape(self, *size: int) -> tuple[int, ...]:
        """This rank's block size along each spatial dimension of a sample of ``size``."""
        return tuple(s.stop - s.start for s in self.slices(*size))


def in_whole_groups(groups: int, size: int, parts: int) -> bool:
    """Whether ``groups * size`` rows split over ``parts`` ranks are each rank's block of the
    ``groups`` groups of ``size`` rows, every group whole: where they are, regrouping the rows
    (space-to-depth, a window partition, and their reverses) keeps the tensor_split layout."""
    whole = tensor_split_sizes(groups * size, parts)
    return whole == [g * size for g in tensor_split_sizes(groups, parts)]


@dataclass(frozen=True)
class Window:
    """A sliding window along one dimension: convolution, pooling.

    Output row ``o`` reads input rows ``o * stride - pad_lo + dilation * t`` for
    ``t = 0 .. kernel - 1``; rows outside ``[0, n)`` are padding. ``pad_lo`` and ``pad_hi`` may
    differ ("same" padding of an even kernel pads more at the end, as torch does). ``ceil``:
    pooling's ``ceil_mode``, one more output row where a last window would start inside the
    input or its leading padding and overhang the end (it reads rows past the padding, which
    pooling leaves out).
    """

    kernel: int
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    dilation: int = 1
    ceil: bool = False

    @property
    def span(self) -> int:
        """Input rows one output row reads, first to last: ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        """Output rows for ``n`` input rows (what torch's conv and pooling give)."""
        room = n + self.pad_lo + self.pad_hi - self.span
        if not self.ceil:
            return room // self.stride + 1
        m = -(-room // self.stride) + 1
        return m - 1 if (m - 1) * self.stride >= n + self.pad_lo else m

    def needs(self, o0: int, o1: int) -> Range:
        """Input rows that output rows ``[o0, o1)`` read; ``(o0*stride - pad_lo,)*2`` if empty."""
        first = o0 * self.stride - self.pad_lo
        if o1 <= o0:
            return first, first
        return first, (o1 - 1) * self.stride - self.pad_lo + self.span

    def plan(self, n: int, parts: int) -> tuple[list[int], list[int], list[Range]]:
        """(input block sizes, output block sizes, input rows each rank needs) for ``parts``."""
        m = self.out_size(n)
        if m < 1:
            raise ValueError(
                f"window {self} gives no output rows for an input of {n} rows "
                f"(needs at least {self.span - self.pad_lo - self.pad_hi})"
            )
        out_sizes = tensor_split_sizes(m, parts)
        want = [self.needs(a, a + s) for a, s in zip(starts(out_sizes), out_sizes, strict=True)]
        return tensor_split_sizes(n, parts), out_sizes, want


def conv_padding(
    padding: int | str | Sequence[int], kernel: Sequence[int], dilation: Sequence[int]
) -> list[tuple[int, int]]:
    """Per spatial dimension ``(pad_lo, pad_hi)`` for nn.Conv2d's ``padding`` argument.

    "same" pads ``dilation * (kernel - 1)`` in all, the extra row at the end as torch does;
    "valid" pads nothing.
    """
    dims = len(kernel)
    if padding == "same":
        total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return [(t // 2, t - t // 2) for t in total]
    if padding == "valid":
        return [(0, 0)] * dims
    if isinstance(padding, str):
        raise ValueError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
    pads = per_dim(padding, dims)
    return [(p, p) for p in pads]


def transposed_needs(
    o0: int, o1: int, n: int, kernel: int, stride: int, padding: int, dilation: int
) -> Range:
    """Input rows of a transposed convolution that output rows ``[o0, o1)`` receive from.

    Input row i scatters into output rows ``i * stride - padding + dilation * t``; so output row
    o receives from the i with ``o + padding - dilation * t = i * stride`` for some t. The range
    is clipped to ``[0, n)``: a transposed convolution has no padding rows to fetch.
    """
    if o1 <= o0:
        return 0, 0
    lo = math.ceil((o0 + padding - dilation * (kernel - 1)) / stride)
    hi = (o1 - 1 + padding) // stride + 1
    lo, hi = max(lo, 0), min(hi, n)
    return (lo, hi) if hi > lo else (0, 0)


def transposed_halo(
    n: int, m: int, parts: int, kernel: int, stride: int, padding: int, dilation: int
) -> tuple[int, int] | None:
    """``(lo, hi)``: the most input rows before and after its own block that any rank's output
    block of a transposed convolution receives from (``n`` input rows and ``m`` output rows in
    ``parts`` tensor_split blocks); None where a block is empty or thinner than the rows its
    neighbours want from it, so that the edge path
    (:func:`parallelkit.spatial.edges.conv_transpose`) does not apply."""
    sizes, outs = tensor_split_sizes(n, parts), tensor_split_sizes(m, parts)
    lo = hi = 0
    for a0, size, o0, o in zip(starts(sizes), sizes, starts(outs), outs, strict=True):
        a, b = transposed_needs(o0, o0 + o, n, kernel, stride, padding, dilation)
        if b > a:
            lo, hi = max(lo, a0 - a), max(hi, b - a0 - size)
    return (lo, hi) if min(sizes) >= max(lo, hi, 1) and min(outs) >= 1 else None


def received_rows(sizes: Sequence[int], want: Sequence[Range]) -> list[int]:
    """How many rows each rank receives from other ranks when it fetches ``want`` (what
    :func:`parallelkit.functional.gather_rows` moves): the wanted rows inside the tensor that
    another rank holds. Padding rows and the rank's own rows cost nothing."""
    total, out = sum(sizes), []
    for r, ((lo, hi), a) in enumerate(zip(want, starts(sizes), strict=True)):
        b = a + sizes[r]
        inside = max(0, min(hi, total) - max(lo, 0))
        own = max(0, min(hi, b) - max(lo, a))
        out.append(inside - own)
    return out
