"""Pooling and upsampling of blocks: the kernels under the spatial layers and the functional
rules alike.

As :mod:`parallelkit.spatial.conv`: each function takes this rank's block (N, C, *spatial) of
whole samples of ``size`` split over a grid in tensor_split layout, fetches the input rows its
output block reads (:mod:`parallelkit.spatial.fetch`: max pooling pads with -inf, average
pooling with zeros) and runs the plain torch operation on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parallelkit.geometry import Window, per_dim
from parallelkit.spatial.fetch import crop, empty_output, fetch, fetch_ranges
from parallelkit.spatial.grid import SpatialGrid

MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
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


def _avg_pool(x: torch.Tensor, kernel, stride, padding, divisor_override=None) -> torch.Tensor:
    """``F.avg_pool1d/2d/3d``; 1-D through 2-D, since avg_pool1d has no ``divisor_override``."""
    ndim = x.dim() - 2
    if ndim == 1:
        y = F.avg_pool2d(x.unsqueeze(-1), (*kernel, 1), (*stride, 1), (*padding, 0),
                         divisor_override=divisor_override)  # fmt: skip
        return y.squeeze(-1)
    avg = F.avg_pool2d if ndim == 2 else F.avg_pool3d
    return avg(x, kernel, stride, padding, divisor_override=divisor_override)


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
