"""The shape of a process grid, defined once: ``data x depth x rows x cols x channel`` ranks.

Four places speak of a grid's shape: the process grid of communicators
(:class:`parallelkit.Grid`), the XLA SPMD mesh (:class:`parallelkit.xla.SpmdGrid`), the
planner's options (:class:`parallelkit.plan.grids.Option`) and the training config's
``parallel.data/depth/rows/cols/channel`` (:func:`parallelkit.train.config.grid_dims`).
``depth``, ``rows`` and ``cols`` split a sample's D, H and W (a signal's L by rows). They all read
it from :class:`GridDims`: like torchtitan's ``ParallelDims``, a small dataclass that checks
itself when it is made and answers what is asked of a shape (its size, a rank's coordinates,
the strategy it amounts to). It holds no communicator and moves nothing, so it sits at the
bottom of the package beside :mod:`parallelkit.geometry`.

Rank order is data-major, ``rank = (((d * depth + z) * rows + r) * cols + c) * channel + k``:
the ranks of one model replica (same d) are neighbours, and a spatial or channel group stays
inside a node when the launcher places consecutive ranks together. XLA's device mesh lists its
devices the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

AXES = ("data", "depth", "rows", "cols", "channel")
STRATEGY_AXIS = {"data": "data", "spatial": "rows", "channel": "channel"}
"""The axis that a strategy named alone puts every rank on ("spatial" splits by rows; the
spatial strategy on a plain communicator splits a sample's first spatial dimension)."""
SPATIAL_AXES = ("depth", "rows", "cols")


@dataclass(frozen=True)
class GridDims:
    """``data x depth x rows x cols x channel`` ranks (the fields in :data:`AXES` order): every
    dimension a positive integer."""

    data: int = 1
    depth: int = 1
    rows: int = 1
    cols: int = 1
    channel: int = 1

    def __post_init__(self) -> None:
        # Named by its shape, not its class: Grid, SpmdGrid, the planner and the config share it.
        if any(int(v) != v or v < 1 for v in self.shape):
            raise ValueError(
                f"grid {self._text}: every dimension must be a positive integer"
            )

    @property
    def _text(self) -> str:
        return f"{' x '.join(AXES)} = {' x '.join(map(str, self.shape))}"

    @classmethod
    def along(cls, strategy: str, ranks: int) -> GridDims:
        """Every one of ``ranks`` on ``strategy``'s axis: data, spatial (rows) or channel."""
        if strategy not in STRATEGY_AXIS:
            raise ValueError(f"strategy must be one of {tuple(STRATEGY_AXIS)}, got {strategy!r}")
        return cls(**{STRATEGY_AXIS[strategy]: ranks})

    @property
    def size(self) -> int:
        """Ranks in all: ``data * rows * cols * channel``."""
        return self.data * self.model

    @property
    def model(self) -> int:
        """Ranks that share one replica of the model: ``depth * rows * cols * channel``."""
        return self.spatial_size * self.channel

    @property
    def spatial_size(self) -> int:
        """Ranks that share one sample's blocks: ``depth * rows * cols``."""
        return self.depth * self.rows * self.cols

    @property
    def spatial(self) -> tuple[int, int, int]:
        return self.depth, self.rows, self.cols

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.data, self.depth, self.rows, self.cols, self.channel

    def as_dict(self) -> dict[str, int]:
        return dict(zip(AXES, self.shape, strict=True))

    def with_data(self, data: int) -> GridDims:
        """The same model grid, replicated ``data`` times."""
        return replace(self, data=data)

    def coords(self, rank: int) -> tuple[int, int, int, int, int]:
        """``(d, z, r, c, k)`` of ``rank`` in data-major order."""
        rest, k = divmod(rank, self.channel)
        rest, c = divmod(rest, self.cols)
        rest, r = divmod(rest, self.rows)
        d, z = divmod(rest, self.depth)
        return d, z, r, c, k

    def check_size(self, size: int, owner: str, has: str) -> None:
        """Raise unless the grid has ``size`` ranks; ``has`` says what holds them ("the
        communicator has 4 ranks"), ``owner`` who asks."""
        if self.size != size:
            raise ValueError(
                f"{owner}: {self._text} = {self.size}, but {has}; choose dimensions whose "
                f"product is {size}"
            )

    @property
    def strategy(self) -> str:
        """What ``parallelkit train``'s ``parallel.strategy`` calls this grid."""
        spatial = self.spatial_size
        if self.model == 1:
            return "data" if self.data > 1 else "dense"
        if self.data > 1:
            return "hybrid"
        return "spatial" if spatial > 1 else "channel"

    @property
    def label(self) -> str:
        """The dimensions larger than 1, as ``"2 data x 2 rows"`` ("1 rank" for none)."""
        parts = [f"{v} {n}" for n, v in self.as_dict().items() if v > 1]
        return " x ".join(parts) or "1 rank"
