"""The process grids the planner weighs: ``data x depth x rows x cols x channel`` ranks, and
every such grid of N ranks that ``pk.parallelize`` takes for a sample's spatial dimensions.

The cost model (:mod:`parallelkit.plan.cost`) prices one :class:`Option` at a time; the
planner (:mod:`parallelkit.plan.planner`) lists them with :func:`options`.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelkit.dims import GridDims


@dataclass(frozen=True)
class Option(GridDims):
    """A process grid the planner weighs: ``data x depth x rows x cols x channel`` ranks."""

    @property
    def ranks(self) -> int:
        return self.size

    @property
    def spatial(self) -> int:  # type: ignore[override]
        """Ranks that split one sample: ``depth * rows * cols`` (GridDims' ``spatial_size``;
        the planner counts them where GridDims lists them)."""
        return self.spatial_size

    def parts(self, dims: int) -> tuple[int, ...]:
        """Blocks along each spatial dimension of a sample with ``dims`` of them (D H W order):
        a volume's ``(depth, rows, cols)``, an image's ``(rows, cols)``, a signal's
        ``(rows,)`` (``parallelkit.spatial.grid.SpatialGrid.axes``)."""
        return ((self.rows,), (self.rows, self.cols), (self.depth, self.rows, self.cols))[dims - 1]


def options(ranks: int, dims: int = 2) -> list[Option]:
    """Every grid of ``ranks`` ranks that ``pk.parallelize`` takes for samples with ``dims``
    spatial dimensions: depth only for volumes (3), columns for images and volumes (spatial
    and channel parallelism are not combined)."""
    out = []
    for d in _divisors(ranks):
        rest = ranks // d
        for z in _divisors(rest) if dims == 3 else [1]:
            for r in _divisors(rest // z):
                for c in _divisors(rest // z // r) if dims >= 2 else [1]:
                    k = rest // z // r // c
                    if z * r * c > 1 and k > 1:
                        continue
                    out.append(Option(data=d, depth=z, rows=r, cols=c, channel=k))
    return out


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]
