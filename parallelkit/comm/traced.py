"""Collectives that ``torch.compile`` traces: torch's functional collectives.

Eager collectives write into buffers through ``torch.distributed``'s in-place, possibly
asynchronous calls, with checks and host metadata around them; dynamo cannot trace them, so
every one would end a graph (a parallelized ResNet-18 compiled into 35 graphs). While dynamo
traces, :class:`~parallelkit.comm.torch_dist.TorchCommunicator` hands the common cases to
``torch.distributed._functional_collectives`` instead: pure functions returning new tensors,
which dynamo keeps inside the graph (as DTensor and torch's DDP under compile do).

Only what needs no host metadata is served here: all-reduce, broadcast, an all-gather whose
sizes the caller gives and are equal, an even reduce-scatter. Everything else (uneven sizes,
``out=`` buffers, debug mode, device tensors staged through gloo, neighbour exchanges) takes
the eager path, and dynamo breaks the graph there, as before. MPI and XLA communicators keep
their eager paths: mpi4py calls are opaque to dynamo, and XLA traces its own graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

_REDUCE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


def tracing() -> bool:
    """Whether dynamo is tracing the caller (``torch.compile``)."""
    return torch.compiler.is_compiling()


def all_reduce(t: torch.Tensor, op: str, group: ProcessGroup, size: int) -> torch.Tensor:
    out = funcol.all_reduce(t, _REDUCE[op], group)
    return out / size if op == "mean" else out


def all_gather(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.all_gather_tensor(t.contiguous(), dim, group)


def reduce_scatter(t: torch.Tensor, dim: int, op: str, group: ProcessGroup, size: int
                   ) -> torch.Tensor:  # fmt: skip
    out = funcol.reduce_scatter_tensor(t.contiguous(), _REDUCE[op], dim, group)
    return out / size if op == "mean" else out


def broadcast(t: torch.Tensor, src_global: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.broadcast(t.contiguous(), src_global, group)


def equal(sizes: Sequence[int] | None, own: int) -> bool:
    """Whether caller-given ``sizes`` are all ``own`` (an all-gather needing no metadata)."""
    return sizes is not None and all(int(s) == own for s in sizes)

