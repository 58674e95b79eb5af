"""Differentiable collectives: autograd pairs written once against any communicator.

Each public function wraps an ``autograd.Function`` whose backward calls its dual's ``apply``,
so gradients of gradients work too. Read each pair as a linear operator F and its adjoint F*
(⟨F x, y⟩ = ⟨x, F* y⟩, the sums running over every rank's local tensors):

    forward                          backward (adjoint)
    all_gather          (concat)     reduce_scatter (sum of each rank's block)
    reduce_scatter      (sum)        all_gather
    all_reduce          (sum)        all_reduce (sum)
    broadcast           (from src)   reduce (sum onto src, zeros elsewhere)
    reduce              (onto dst)   broadcast (from dst)
    copy_to_group       (identity)   all_reduce (sum)   -- input replicated, outputs per rank
    reduce_from_group   (all_reduce) identity           -- output replicated, one loss
    scatter_to_group    (own block)  all_gather         -- input replicated, outputs per rank
    gather_from_group   (all_gather) own block          -- output replicated, one loss
    halo_exchange       (fill ghosts) halo_accumulate (send ghost gradients back, add them)
    gather_rows         (any rows)   scatter_add_rows (send row gradients back, add them)

``copy_to_group`` / ``reduce_from_group`` and ``scatter_to_group`` / ``gather_from_group`` are
for values that every rank holds identically (a replicated input whose per-rank uses must be
summed; a result that every rank then uses identically to compute one replicated loss, so each
rank already holds the whole gradient and keeps only its own block of it). On a size-1
communicator every function is the identity (or, for the halo, plain padding) with no autograd
wrapper.

Shapes (``n_r`` = rank r's size along ``dim``):

    all_gather      x: (.., n_r, ..)            -> (.., sum_r n_r, ..)
    reduce_scatter  x: (.., sum_r n_r, ..)      -> (.., n_rank, ..)
    halo_exchange   x: (.., n, ..)              -> (.., lo + n + hi, ..)
    gather_rows     x: (.., n_rank, ..)         -> (.., stop_rank - start_rank, ..)

One module per kind, each with its public functions first and their autograd pairs below:
:mod:`.collectives` (whole tensors), :mod:`.rows` (``gather_rows``) and :mod:`.halo`
(``halo_exchange``). Import them from here: ``import parallelkit.functional as pkf``.
"""

from parallelkit.functional.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    copy_to_group,
    gather_from_group,
    reduce,
    reduce_from_group,
    reduce_scatter,
    scatter_to_group,
)
from parallelkit.functional.halo import halo_exchange
from parallelkit.functional.rows import gather_rows

__all__ = [
    "all_gather", "all_reduce", "broadcast", "copy_to_group", "gather_from_group", "gather_rows",
    "halo_exchange", "reduce", "reduce_from_group", "reduce_scatter", "scatter_to_group",
]  # fmt: skip
