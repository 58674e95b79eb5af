"""The cost model: step time (compute, exchange, reductions) and peak memory per rank of one
network under one process grid, from the walk's layers, a compute profile and a network.

Pure arithmetic: no torch, no processes, so every term can be tested by hand. What each
strategy does per step follows ``pk.parallelize`` (``parallelkit/parallel/parallelize.py``):

    grid            compute per rank                  exchange                  reductions
    data  d         the layers on batch/d images       -                         gradients: one
                                                                                 bucketed all-reduce
                                                                                 (25 MiB buckets)
                                                                                 overlapped with
                                                                                 backward
    spatial         region layers on the rank's block  per conv/pool: halo rows  parameter grads:
    z x r x c       (its share of D x H x W), the      along each split          shares summed by
                    rest whole                         dimension, forward and    DataParallel over
                                                       back (geometry.Window     data x z x r x c in
                                                       .plan); gather at region  overlapped buckets;
                                                       end (none for per-pixel   InstanceNorm and
                                                       outputs with blocks in)   GroupNorm stats
                                                                                 over z x r x c
    channel k       convolutions by k (their output    per conv: all-gather of   -
                    or input channels), the rest whole y (fwd), all-reduce of
                                                       dx (bwd)
    every grid      BatchNorm over data x spatial: one all-gather of (n, mean, M2) forward, one
                    all-reduce of two sums backward (SyncBatchNorm)

Token mixing (the walk's :class:`~parallelkit.plan.walk.Mixing` records; a column of its own,
``tokens``), under s > 1 spatial ranks, as ``parallelkit/spatial/rules/tokens.py`` runs it:

    self-attention, heads    the head all-to-all (DeepSpeed-Ulysses): q, k, v and the output
    divide by s, no mask     each cross once forward and once backward, (s-1)/s of the rank's
                             block of each; the rank holds its h/s heads of all L tokens
    self-attention, else     the ring: s-1 shifts of the key/value block forward; backward s-1
                             shifts of it with its gradients and one of the gradients home;
                             two key/value blocks in flight
    keys of another map,     an all-gather of each (reduce-scatter of its gradient); the whole
    the explicit q @ k^T     keys and values held
    contractions, maps over  an all-reduce of the (small) result, forward
    the token axis
    a matrix along one       BAT's p @ x, a Linear along W: each rank's partial map (whole along
    spatial dimension        it) reduce-scattered forward, all-gathered backward
    rows of other blocks     a flip along a split dimension or a grid_sample: a block of rows
    read (fetch)             fetched forward, its gradient sent home backward; a running sum
                             along one: each block's last row gathered (as a reduce)
    a map cut into groups    where a rank's block is not whole groups (windows of 7 on blocks
    (window partitions)      of 18 + 17 rows), the rows past the last whole group go to the
                             neighbour, forward and (their gradient) back

A sample has 1, 2 or 3 spatial dimensions; a spatial grid splits a volume's D by ``depth``, H
by ``rows`` and W by ``cols`` (an image's H and W by rows and cols, a signal's L by rows), as
:class:`parallelkit.spatial.grid.SpatialGrid` does.

Ranks that outnumber the cores share them: compute (and a local network's messages) slow by
``(ranks + other processes' load) / cores``. Memory per rank: the process baseline,
parameters + gradients + momentum (+ DataParallel's flat bucket buffers), the samples (the
input and its labels: whole on every rank of a spatial group, or with ``blocks_in``, as
``pk.parallelize(..., spatial_input="blocks")`` takes them, only the rank's block), the
activations autograd keeps (each leaf's output, the rank's share of it under spatial
parallelism plus the fetched halo block each convolution off the edge path saves), and the
largest activation gradient twice (backward's working set).

Each part is a module of its own, and this one adds them up for one grid (:func:`estimate`):
:mod:`~parallelkit.plan.grids` (the grids), :mod:`~parallelkit.plan.machine` (where the ranks
run), :mod:`~parallelkit.plan.shares` (a rank's share of a layer and its halo rows),
:mod:`~parallelkit.plan.step_time` (compute, exchange, reductions),
:mod:`~parallelkit.plan.mixing_cost` (token mixing) and :mod:`~parallelkit.plan.memory`. Their
names are importable from here too.

Legend: ``b`` samples per rank, ``s`` spatial ranks (depth x rows x cols), ``k`` channel
ranks, ``d`` data ranks; activations are fp32, per-pixel labels int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from parallelkit.plan.grids import Option, options
from parallelkit.plan.machine import Machine
from parallelkit.plan.measure import Profile
from parallelkit.plan.memory import I64, MIXING, SAMPLES, activation_bytes, memory, sample_bytes
from parallelkit.plan.mixing_cost import (
    Traffic,
    mixing_bytes,
    mixing_pattern,
    mixing_seconds,
    mixing_traffic,
)
from parallelkit.plan.network import Network
from parallelkit.plan.shares import F32, MIB, block_share, halo_bytes, halo_rows, spatial_share
from parallelkit.plan.step_time import (
    BUCKET_BYTES,
    compute_seconds,
    data_parallel_exposed,
    exchange_seconds,
    output_blocks,
    params_per_rank,
    reduction_seconds,
)
from parallelkit.plan.walk import Net

__all__ = [
    "BUCKET_BYTES", "F32", "I64", "MIB", "MIXING", "SAMPLES", "Estimate", "Machine", "Option",
    "Traffic", "activation_bytes", "block_share", "calibrate", "compute_seconds",
    "data_parallel_exposed", "estimate", "exchange_seconds", "halo_bytes", "halo_rows",
    "memory", "mixing_bytes", "mixing_pattern", "mixing_seconds", "mixing_traffic", "options",
    "output_blocks", "params_per_rank", "rank", "reduction_seconds", "sample_bytes",
    "sample_dims", "spatial_share",
]  # fmt: skip


@dataclass
class Estimate:
    """Predicted step (seconds) and peak memory per rank (MiB) of one grid."""

    option: Option
    compute_s: float = 0.0
    exchange_s: float = 0.0
    reductions_s: float = 0.0
    memory_mib: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # With blocks in: the peak memory per rank the same grid needs with whole samples in.
    whole_in_mib: float | None = None
    tokens_s: float = 0.0  # the token-mixing collectives (attention, contractions over tokens)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exchange_s + self.reductions_s + self.tokens_s

    @property
    def peak_mib(self) -> float:
        return sum(self.memory_mib.values())

    @property
    def feasible(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------- one grid
def estimate(
    nets: Sequence[Net],
    profiles: Sequence[Profile],
    opt: Option,
    batch: int,
    link: Network,
    machine: Machine,
    blocks_in: bool = False,
) -> Estimate:
    """Step time and memory per rank of ``nets`` (one training step runs them all) on ``opt``;
    ``blocks_in``: each rank passes only its block of every sample (:func:`sample_bytes`).

    Grids that ``pk.parallelize`` takes but this batch does not fit, or whose memory per rank
    exceeds ``machine.device_mib``, are kept, with the reason in ``problems``; they rank last.
    """
    est = Estimate(opt)
    if batch % opt.data:
        est.problems.append(f"global batch {batch} does not split over {opt.data} data ranks")
    if problem := _grid_problem(nets, opt):
        est.problems.append(problem)
    slow = machine.slowdown(opt.ranks)
    link_slow = slow if link.shares_cores else 1.0
    for net, prof in zip(nets, profiles, strict=True):
        compute = compute_seconds(net, prof, opt, batch)
        backward = compute * 2 / 3 / net.passes * slow  # the last pass's backward
        est.compute_s += compute * slow
        est.exchange_s += exchange_seconds(net, opt, batch, link, blocks_in) * link_slow
        est.reductions_s += reduction_seconds(net, prof, opt, batch, link, backward) * link_slow
        est.tokens_s += mixing_seconds(net, opt, batch, link) * link_slow
    est.memory_mib = memory(nets, opt, batch, machine, blocks_in)
    if blocks_in:
        est.whole_in_mib = sum(memory(nets, opt, batch, machine).values())
    if machine.device_mib is not None and est.peak_mib > machine.device_mib:
        est.problems.append(
            f"does not fit: {est.peak_mib:.0f} MiB per rank, the device holds "
            f"{machine.device_mib:.0f} MiB"
        )
    return est


def sample_dims(nets: Sequence[Net]) -> int:
    """Spatial dimensions of the samples ``nets`` take: 3 for volumes, 2 for images (also when
    no network records its input), 1 for signals."""
    return max((len(net.input_shape) - 1 for net in nets if net.input_shape), default=2)


def _grid_problem(nets: Sequence[Net], opt: Option) -> str | None:
    """Why ``opt`` cannot split these samples, if it cannot: ``depth`` splits a volume's D,
    ``cols`` an image's or a volume's W (a signal's L goes by rows)."""
    dims = sample_dims(nets)
    if (opt.depth > 1 and dims < 3) or (opt.cols > 1 and dims < 2):
        return f"{opt.label} cannot split samples with {dims} spatial dimension(s)"
    return None


def calibrate(nets: Sequence[Net], batch: int, machine: Machine, peak_mib: float) -> Machine:
    """``machine`` with the overhead that makes the 1-rank prediction at ``batch`` equal
    ``peak_mib``, a 1-rank step's measured peak (never below zero)."""
    bare = replace(machine, overhead_mib=0.0)
    predicted = sum(memory(nets, Option(), batch, bare).values())
    over = max(0.0, peak_mib - predicted)
    return replace(machine, overhead_mib=over)


def rank(estimates: Sequence[Estimate]) -> list[Estimate]:
    """Feasible grids fastest first, then the infeasible ones."""
    return sorted(estimates, key=lambda e: (not e.feasible, e.step_s))
