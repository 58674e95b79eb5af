"""Pooling and upsampling of blocks: the kernels under the spatial layers and the functional
rules alike.

As :mod:`parallelkit.spatial.conv`: each function takes this rank's block (N, C, *spatial) of
whole samples of ``size`` split over a grid in tensor_split layout, fetches the input rows its
output block reads (:mod:`parallelkit.spatial.fetch`: max pooling pads with -inf, average
pooling with zeros) and runs the plain torch operation on them.

Max pooling with indices numbers them in the whole sample's plane, as the dense pooling does,
and max unpooling takes such indices back to this rank's block of the output: each output
block fetches the pooled rows whose windows reach it (the rows a transposed convolution's
output block receives from) with their indices, and unpools them locally.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parallelkit.comm import Communicator
from parallelkit.geometry import Window, per_dim, starts, transposed_needs
from parallelkit.spatial import record
from parallelkit.spatial.fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial.grid import SpatialGrid

MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
MAX_POOL_INDICES = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices,
                    3: F.max_pool3d_with_indices}  # fmt: skip
INTERPOLATING = {"linear": 1, "bilinear": 2, "trilinear": 3}  # mode: its spatial dimensions


def pool_windows(
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None,
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    ceil_mode: bool,
    dims: int,
    name: str,
) -> tuple[Window, ...]:
    """The window along each of ``dims`` spatial dimensions of a pooling with
    ``F.max_pool*d``'s arguments (stride None: the kernel), refused as torch refuses it."""
    k, d, p = per_dim(kernel_size, dims), per_dim(dilation, dims), per_dim(padding, dims)
    s = k if stride is None else per_dim(stride, dims)
    if any(pi > ki // 2 for pi, ki in zip(p, k, strict=True)):
        raise ValueError(f"{name}: padding {p} must be at most half the kernel {k}, as in torch")
    return tuple(Window(k[i], s[i], p[i], p[i], d[i], bool(ceil_mode)) for i in range(dims))


def _fetch(x_blk: torch.Tensor, grid: SpatialGrid, windows: Sequence[Window],
           size: Sequence[int], fill: float, native: bool):  # fmt: skip
    """(fetched block, output block size, padding left to the torch operation). With
    ``ceil_mode`` every row is fetched (padding too), and the operation pads nothing."""
    return fetch(x_blk, grid, windows, size, fill, native and not windows[0].ceil)


def max_pool_blocks(
    x_blk: torch.Tensor, windows: Sequence[Window], grid: SpatialGrid, size: Sequence[int]
) -> torch.Tensor:
    """This rank's block of ``F.max_pool1d/2d/3d``: padding rows are -inf, and so are rows
    past the padding that a ``ceil_mode`` window reads (max pooling pads with -inf itself,
    like the fetch)."""
    x, out_size, pad = _fetch(x_blk, grid, windows, size, float("-inf"), native=True)
    if min(out_size) == 0:
        return empty_output(x, x.shape[1], out_size, x)
    kernel, stride, dilation = zip(*((w.kernel, w.stride, w.dilation) for w in windows),
                                   strict=True)  # fmt: skip
    return MAX_POOL[len(windows)](x, kernel, stride, pad, dilation)


def max_pool_indices_blocks(
    x_blk: torch.Tensor, windows: Sequence[Window], grid: SpatialGrid, size: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's block of ``F.max_pool1d/2d/3d(return_indices=True)``: the values, and
    their indices numbered in the whole sample's (unpadded) plane.

    The fetched rows are pooled for the indices only; the values are then read at them, so
    that autograd sends each gradient to the one place torch's backward sends it, and the
    fetch's backward returns it to its owner. The fetch pads with -inf rows, which torch's
    pooling does not count: a window whose real values are all -inf keeps, as in torch, its
    first real position (along each dimension its first row at or past row 0), where the
    pooling of the fetched block names its first padding row."""
    x, out_size, pad = _fetch(x_blk, grid, windows, size, float("-inf"), native=True)
    if min(out_size) == 0:
        y = empty_output(x, x.shape[1], out_size, x)
        return y, torch.zeros(y.shape, dtype=torch.long, device=y.device)
    kernel, stride, dilation = zip(*((w.kernel, w.stride, w.dilation) for w in windows),
                                   strict=True)  # fmt: skip
    with torch.no_grad():
        _, local = MAX_POOL_INDICES[len(windows)](x, kernel, stride, pad, dilation, False, True)
    rows, firsts = _whole_rows(_unflatten(local, x.shape[2:]), windows, grid, size, pad)
    at = _flatten([r - a for r, a in zip(rows, firsts, strict=True)], x.shape[2:])
    return x.flatten(2).gather(2, at.flatten(2)).view(local.shape), _flatten(rows, size)


def _whole_rows(rows: list[torch.Tensor], windows: Sequence[Window], grid: SpatialGrid,
                size: Sequence[int], pad: Sequence[int]) -> tuple[list, list[int]]:  # fmt: skip
    """Per dimension, the rows of the fetched block that its pooling names (one per output
    position) as rows of the whole sample, a padding row taken to its window's first real
    row; and the whole row of the fetched block's row 0 (0 where torch pads, nothing
    fetched)."""
    whole, firsts = [], []
    for dim, (win, n, (_, parts, idx)) in enumerate(
        zip(windows, size, grid.axes(len(windows)), strict=True)
    ):
        _, out_sizes, want = win.plan(n, parts)
        first = 0 if pad[dim] else want[idx][0]
        o = starts(out_sizes)[idx] + torch.arange(out_sizes[idx], device=rows[dim].device)
        real = _first_real_row(o * win.stride - win.pad_lo, win.dilation)
        view = [1] * len(windows)
        view[dim] = -1
        row = rows[dim] + first
        whole.append(torch.where(row < 0, real.view(view), row))
        firsts.append(first)
    return whole, firsts


def _first_real_row(start: torch.Tensor, dilation: int) -> torch.Tensor:
    """The first row at or past row 0 that a window starting at ``start`` reads."""
    return start + dilation * ((-start).clamp(min=0) + dilation - 1).div(
        dilation, rounding_mode="floor"
    )


def _unflatten(index: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    """Flat indices into a plane of ``shape`` as one row index per dimension."""
    rows, rest = [], index
    for n in reversed(shape):
        rows.append(rest % n)
        rest = rest.div(n, rounding_mode="floor")
    return rows[::-1]


def _flatten(rows: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """One row index per dimension as flat indices into a plane of ``shape``."""
    flat = torch.zeros_like(rows[0])
    for r, n in zip(rows, shape, strict=True):
        flat = flat * n + r
    return flat


def max_unpool_blocks(
    x_blk: torch.Tensor,
    index_blk: torch.Tensor,
    windows: Sequence[Window],
    grid: SpatialGrid,
    size: Sequence[int],
    out_size: Sequence[int],
) -> torch.Tensor:
    """This rank's block of ``F.max_unpool1d/2d/3d`` of blocks of the pooled map (``size``)
    whose indices are numbered in the whole output plane (``out_size``), each inside its
    value's window, as max pooling with these windows gives them.

    The output block fetches the pooled rows whose windows reach it, values and indices (a
    transposed convolution's halo), and unpools them into the rows those windows cover; what
    falls outside the block is cut off. Unpooling writes, it does not add: where windows
    overlap, two values may name one place, and the one torch's kernel writes last (on the
    CPU the later in the pooled map's order, which the fetched rows keep) must win; a sum of
    the ranks' scatters would add them. The backward reads the output's gradient at every
    index, as torch's does: the rank whose block holds the place gives it, the others'
    copies zero, and the fetch's backward adds them up on the value's owner."""

    def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
        w = windows[dim]
        return transposed_needs(o0, o1, n, w.kernel, w.stride, w.pad_lo, w.dilation)

    def whole(dim: int, _: int) -> int:
        return out_size[dim]

    x, blocks, firsts = fetch_ranges(x_blk, grid, size, whole, needs)
    index, _, _ = fetch_ranges(index_blk, grid, size, whole, needs)
    rows = [o for _, o in blocks]
    if min(rows) == 0 or min(x.shape[2:]) == 0:
        return empty_output(x, x.shape[1], rows, x)
    reach = []  # the output rows the fetched rows' windows cover, (first, rows)
    for w, first, m, n in zip(windows, firsts, x.shape[2:], out_size, strict=True):
        lo, hi = w.needs(first, first + m)
        reach.append((max(lo, 0), min(hi, n) - max(lo, 0)))
    local = _unflatten(index, out_size)
    inside = torch.ones_like(index, dtype=torch.bool)
    for dim, (a, m) in enumerate(reach):
        local[dim] = local[dim] - a
        inside &= (local[dim] >= 0) & (local[dim] < m)
    flat = torch.where(inside, _flatten(local, [m for _, m in reach]), -1)  # -1: torch says
    y = _unpool(x, flat, [m for _, m in reach])  # "invalid max index", as dense would
    return crop(y, [a for a, _ in reach], blocks)


def _unpool(x: torch.Tensor, index: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """torch's max unpooling of ``x`` to flat ``index`` into a plane of ``shape`` (no
    window arguments: the places are given)."""
    if len(shape) == 1:
        y = torch.ops.aten.max_unpool2d(x.unsqueeze(-1), index.unsqueeze(-1), [shape[0], 1])
        return y.squeeze(-1)
    if len(shape) == 2:
        return torch.ops.aten.max_unpool2d(x, index, shape)
    return torch.ops.aten.max_unpool3d(x, index, shape, [1, 1, 1], [0, 0, 0])


def _avg_pool(x: torch.Tensor, kernel, stride, padding, divisor_override=None) -> torch.Tensor:
    """``F.avg_pool1d/2d/3d``; 1-D through 2-D, since avg_pool1d has no ``divisor_override``."""
    ndim = x.dim() - 2
    if ndim == 1:
        y = F.avg_pool2d(x.unsqueeze(-1), (*kernel, 1), (*stride, 1), (*padding, 0),
                         divisor_override=divisor_override)  # fmt: skip
        return y.squeeze(-1)
    avg = F.avg_pool2d if ndim == 2 else F.avg_pool3d
    return avg(x, kernel, stride, padding, divisor_override=divisor_override)


def avg_pool_tokens(x: torch.Tensor, index: torch.Tensor, count: int, kernel: int, stride: int,
                    comm: Communicator) -> torch.Tensor:  # fmt: skip
    """``F.avg_pool1d`` without padding over the whole order of a block's flattened tokens
    (``index``: the whole indices of its tokens, of ``count``), whole on every rank: each
    rank sums its tokens into the windows they fall in, then one all-reduce. Next-ViT reduces
    its keys so, in windows of k * k consecutive tokens that cross the map's rows."""
    windows = (count - kernel) // stride + 1
    y = x.new_zeros((*x.shape[:-1], windows))
    for offset in [index % stride] if kernel == stride else range(kernel):
        start = index - offset
        win = torch.div(start, stride, rounding_mode="floor")
        ok = (start >= 0) & (start % stride == 0) & (win < windows)
        y = y.index_add(-1, win[ok], x[..., ok])
    return record.summed(y, comm) / kernel


def avg_pool_blocks(
    x_blk: torch.Tensor,
    windows: Sequence[Window],
    grid: SpatialGrid,
    size: Sequence[int],
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """This rank's block of ``F.avg_pool1d/2d/3d``. ``count_include_pad=False`` divides by
    the number of real (non-padding) inputs in each window, which each rank computes locally
    from the geometry; so does ``ceil_mode``, whose last windows count only the rows up to the
    end of the padding, as torch's do."""
    ceil, padded = windows[0].ceil, max(w.pad_lo for w in windows) > 0
    # Zero padding counted in the mean (or none), and no window past the padding: avg_pool
    # may pad by itself.
    plain = divisor_override is not None or (not ceil and (count_include_pad or not padded))
    x, out_size, pad = _fetch(x_blk, grid, windows, size, 0.0, native=plain)
    if min(out_size) == 0:
        return empty_output(x, x.shape[1], out_size, x)
    k, s = tuple(w.kernel for w in windows), tuple(w.stride for w in windows)
    if plain:
        return _avg_pool(x, k, s, pad, divisor_override)
    zero = (0,) * len(windows)
    real = _counted(x, windows, grid, size, count_include_pad)
    return _avg_pool(x, k, s, zero, 1) / _avg_pool(real, k, s, zero, 1)


def _counted(x: torch.Tensor, windows: Sequence[Window], grid: SpatialGrid,
             size: Sequence[int], count_include_pad: bool) -> torch.Tensor:  # fmt: skip
    """1 where the fetched block holds what the mean counts (the sample, and its padding
    with ``count_include_pad``), 0 elsewhere (pure geometry)."""
    ndim = len(windows)
    mask = x.new_ones((1, 1) + (1,) * ndim)
    for dim, (win, n, (_, parts, idx)) in enumerate(zip(windows, size, grid.axes(ndim),
                                                        strict=True)):  # fmt: skip
        _, _, want = win.plan(n, parts)
        lo, hi = want[idx]
        rows = torch.arange(lo, hi, device=x.device)
        first, stop = (-win.pad_lo, n + win.pad_hi) if count_include_pad else (0, n)
        shape = [1] * (2 + ndim)
        shape[2 + dim] = -1
        mask = mask * ((rows >= first) & (rows < stop)).to(x.dtype).view(shape)
    return mask


def upsample_factor(
    factors: Sequence[float | None], mode: str, align_corners: bool | None, ndim: int | None = None
) -> int | None:
    """The one integer factor (at least 1) of an upsampling that :func:`upsample_blocks` does
    exactly: the same factor along every dimension, mode "nearest" or the linear mode of
    ``ndim`` spatial dimensions (of any, where ``ndim`` is None), without ``align_corners``;
    None for any other (the layer stays dense, the rule resamples by weights)."""
    dims = INTERPOLATING.get(mode)
    if align_corners or (mode != "nearest" and (dims is None or ndim not in (None, dims))):
        return None
    if factors[0] is None or len(set(factors)) != 1 or not float(factors[0]).is_integer():
        return None
    return int(factors[0]) if factors[0] >= 1 else None


def check_upsample(scale_factor: float, mode: str, align_corners: bool | None, name: str) -> int:
    """:func:`upsample_factor` of one ``scale_factor``, or a ``ValueError`` saying what the
    kernel takes."""
    factor = upsample_factor((scale_factor,), mode, align_corners)
    if factor is None:
        raise ValueError(
            f"{name}: takes a positive integer scale_factor and mode 'nearest', 'linear', "
            f"'bilinear' or 'trilinear' with align_corners=False, got scale_factor="
            f"{scale_factor}, mode={mode!r}, align_corners={align_corners}"
        )
    return factor


def upsample_blocks(
    x_blk: torch.Tensor, scale: int, mode: str, grid: SpatialGrid, size: Sequence[int]
) -> torch.Tensor:
    """This rank's block of ``F.interpolate`` by the integer ``scale``, mode "nearest" or
    (bi-, tri-)linear without ``align_corners``: the input rows its output block interpolates
    from are fetched, plus one row on each side for the interpolating modes, so that no
    interpolation is clamped at a block edge that is not the sample's edge; then upsampled
    and cropped to the block."""
    extra = 1 if mode in INTERPOLATING else 0

    def needs(dim: int, o0: int, o1: int, n: int) -> tuple[int, int]:
        return (max(o0 // scale - extra, 0), min(-(-o1 // scale) + extra, n)) if o1 > o0 else (0, 0)

    x_blk, blocks, firsts = fetch_ranges(x_blk, grid, size, lambda _, n: n * scale, needs)
    if min(o for _, o in blocks) == 0:
        return empty_output(x_blk, x_blk.shape[1], [o for _, o in blocks], x_blk)
    y = F.interpolate(x_blk, scale_factor=scale, mode=mode)
    return crop(y, [a * scale for a in firsts], blocks)  # local row 0 is global row a * scale
