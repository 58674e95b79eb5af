"""Debug mode: check before a collective that every rank is making the same call.

A collective that ranks enter with different shapes, dtypes, roots or operations hangs or
corrupts memory. With ``PARALLELKIT_DEBUG=1`` (or ``pk.init(debug=True)``) the communicator
first all-gathers a small signature of the call and, when the ranks disagree, raises the same
``ValueError`` on every rank, listing what each one called. It costs two small host all-gathers
per call (:meth:`Communicator.all_gather_ints`), so it is off by default.

The communicator calls these checks; they know only the little of it they use (:class:`Host`),
so this file sits below :mod:`parallelkit.comm.base` and imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from parallelkit.comm.dtypes import DTYPES


class Host(Protocol):
    """What a check needs of a communicator: its name and the host all-gather of integers."""

    backend: str

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]: ...


_OPERATIONS = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "neighbor_exchange",
)  # fmt: skip


def check_call(comm: Host, name: str, t: torch.Tensor, masked_dim: int | None, extra: int) -> None:
    """Raise on every rank unless all ranks call ``name`` with the same signature.

    ``masked_dim`` is a dimension allowed to differ (all_gather's); ``extra`` encodes the
    root and the reduction.
    """
    shape = [-1 if d == masked_dim else s for d, s in enumerate(t.shape)]
    local = [_OPERATIONS.index(name), DTYPES.index(t.dtype), extra, t.dim(), *shape]
    rows = _gather_rows(comm, local)
    if any(row != rows[0] for row in rows):
        calls = "\n".join(f"  rank {r}: {_describe(row)}" for r, row in enumerate(rows))
        raise ValueError(
            f"ranks disagree on a collective (debug mode, {comm.backend}); "
            f"each rank called:\n{calls}"
        )


def check_exchange(
    comm: Host, send: Sequence[tuple[int, torch.Tensor]], recv: Sequence[tuple[int, torch.Tensor]]
) -> None:
    """Raise on every rank unless each message sent matches a receive of the same size."""
    check_call(comm, "neighbor_exchange", torch.empty(0), None, 0)
    local = [len(send), len(recv)]
    for peer, t in (*send, *recv):
        local += [peer, DTYPES.index(t.dtype), t.numel()]
    sent: dict[tuple[int, int], list[list[int]]] = {}
    received: dict[tuple[int, int], list[list[int]]] = {}
    for r, row in enumerate(_gather_rows(comm, local)):
        for i in range(row[0] + row[1]):
            peer, dtype, numel = row[2 + 3 * i : 5 + 3 * i]
            if i < row[0]:
                sent.setdefault((r, peer), []).append([dtype, numel])
            else:
                received.setdefault((peer, r), []).append([dtype, numel])
    bad = [
        f"  {src} -> {dst}: sends {sent.get((src, dst), [])}, "
        f"receives {received.get((src, dst), [])} ([dtype index, elements])"
        for src, dst in sorted(set(sent) | set(received))
        if sent.get((src, dst), []) != received.get((src, dst), [])
    ]
    if bad:
        raise ValueError(
            "neighbor_exchange: sends and receives do not match (debug mode):\n" + "\n".join(bad)
        )


def _gather_rows(comm: Host, local: list[int]) -> list[list[int]]:
    """Every rank's list of integers (of any length), on the host path."""
    lengths = [row[0] for row in comm.all_gather_ints([len(local)])]
    width = max(lengths)
    table = comm.all_gather_ints([*local, *[0] * (width - len(local))])
    return [row[:n] for row, n in zip(table, lengths, strict=True)]


def _describe(row: list[int]) -> str:
    shape = tuple("*" if s == -1 else s for s in row[4:])
    return f"{_OPERATIONS[row[0]]}(shape={shape}, dtype={DTYPES[row[1]]}, arg={row[2]})"
