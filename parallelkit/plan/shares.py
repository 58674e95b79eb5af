"""A rank's part of one layer under a spatial split: the largest share of the map (or of its
tokens) that one rank computes, and the halo rows it receives for the layer's windows.

The cost model's time, memory and token terms all start from these; the rows come from the
same geometry the spatial layers fetch by (:class:`parallelkit.geometry.Window`), so a plan's
halo is the one the layers move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from parallelkit.geometry import Window, blocks, received_rows, starts, transposed_needs
from parallelkit.plan.grids import Option
from parallelkit.plan.walk import Layer

F32 = 4
MIB = 1 << 20


def block_share(size: Sequence[int], parts: Sequence[int]) -> float:
    """The largest share of a sample of spatial ``size`` that one rank holds when each
    dimension is split into ``parts`` blocks (``torch.tensor_split``: the first ones larger)."""
    share = 1.0
    for n, p in zip(size, parts, strict=True):
        share *= max(b - a for a, b in blocks(n, p)) / n
    return share


def spatial_share(layer: Layer, opt: Option) -> float:
    """The largest share of the layer's output that one rank computes (1 outside the region):
    its block of the map, or of the map flattened into its tokens."""
    if not layer.spatial or opt.spatial == 1 or layer.dims < 1:
        return 1.0
    if layer.tokens:
        return block_share(layer.tokens, opt.parts(len(layer.tokens)))
    return block_share(layer.out_shape[1:], opt.parts(layer.dims))


def halo_rows(layer: Layer, dim: int, parts: int) -> tuple[int, int]:
    """(rows the busiest rank receives from others, input rows it then holds) along spatial
    ``dim`` (0 the first: a volume's D, an image's H) of ``layer`` split over ``parts`` ranks;
    (0, whole input) when nothing is split."""
    n, m = layer.in_shape[1 + dim], layer.out_shape[1 + dim]
    sizes = [b - a for a, b in blocks(n, parts)]
    if parts == 1:
        return 0, n
    if layer.kind == "convT":
        k, s, p, _, d = layer.window[dim]
        out = [b - a for a, b in blocks(m, parts)]
        want = [
            transposed_needs(o, o + sz, n, k, s, p, d)
            for o, sz in zip(starts(out), out, strict=True)
        ]
    else:
        k, s, lo, hi, d = layer.window[dim]
        _, _, want = Window(k, s, lo, hi, d).plan(n, parts)
    got = received_rows(sizes, want)
    r = max(range(parts), key=lambda i: got[i])
    return got[r], max(hi - lo for lo, hi in want)


def halo_bytes(layer: Layer, opt: Option, images: float) -> float:
    """Bytes the busiest rank receives in the layer's forward halo exchange.

    The exchange runs one dimension after another, the last first (W, then H, then D:
    :mod:`parallelkit.spatial.edges`), each on the block already extended along the
    dimensions exchanged before it, so the edges and corners ride along: along dimension i
    the received rows are as wide as the block along the earlier dimensions and as the
    extended block along the later ones.
    """
    if not layer.window or not layer.spatial or opt.spatial == 1:
        return 0.0
    size, parts = layer.in_shape[1:], opt.parts(layer.dims)
    received = [halo_rows(layer, i, p)[0] for i, p in enumerate(parts)]
    block = [math.ceil(n / p) for n, p in zip(size, parts, strict=True)]
    extended = [b + r for b, r in zip(block, received, strict=True)]
    total = 0
    for i, rows in enumerate(received):
        # exchanged after this dimension: the bare block; before it: the extended one
        total += rows * math.prod(block[:i]) * math.prod(extended[i + 1 :])
    return images * layer.in_shape[0] * F32 * total
