"""Rank-side test cases for the communicators, shared by the gloo tier and the mpiexec tier.

Each case runs on every rank of a communicator and returns ``(label, got, expected)`` triples:
``got`` from the communicator, ``expected`` from NumPy on every rank's input (which each rank
can rebuild, since inputs are a pure function of rank and seed). The caller asserts with
:func:`assert_triples`: in the parent process for gloo, on each rank under mpiexec.

Inputs are small integers, so sums are exact in every dtype (bfloat16 included) and a
mismatch is a bug, not rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from parallelkit.comm import Communicator
from parallelkit.geometry import tensor_split_sizes

WORLD_SIZES = (1, 2, 3, 4)
Triple = tuple[str, torch.Tensor, torch.Tensor]
NP_OPS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    """This rank's input as (float64 NumPy array, torch tensor of ``dtype``)."""
    rng = np.random.default_rng([seed, rank])
    values = rng.integers(-8, 9, size=shape).astype(np.float64)
    return values, torch.from_numpy(values).to(dtype)


def reference(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def assert_triples(triples: list[Triple]) -> None:
    assert_results([(label, got, expected, {}) for label, got, expected in triples])


def assert_results(results) -> None:
    """(label, got, expected, assert_close tolerances) quadruples: all must match."""
    for label, got, expected, tol in results:
        assert got.dtype == expected.dtype, f"{label}: dtype {got.dtype} != {expected.dtype}"
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, label=label: f"{label}: {m}")


def mismatches(results) -> list[str]:
    """Labels of the quadruples that do not match (for negative controls)."""
    bad = []
    for label, got, expected, tol in results:
        try:
            torch.testing.assert_close(got, expected, **tol)
        except AssertionError:
            bad.append(label)
    return bad


# ----------------------------------------------------------------------------- collectives
def all_reduce(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    shape = (3, 5)
    xs = [rank_input(r, shape, dtype)[0] for r in range(comm.size)]
    _, mine = rank_input(comm.rank, shape, dtype)
    out = []
    for op in ("sum", "max", "min", "mean"):
        if op == "mean" and not dtype.is_floating_point:
            continue
        expected = reference(NP_OPS[op](np.stack(xs), axis=0), dtype)
        out.append((f"all_reduce {op}", comm.all_reduce(mine, op), expected))
        out.append((f"all_reduce_async {op}", comm.all_reduce_async(mine, op).wait(), expected))
    # Input untouched (out of place), and a non-contiguous input works.
    out.append(("all_reduce leaves its input", mine, rank_input(comm.rank, shape, dtype)[1]))
    got = comm.all_reduce(mine.t(), "sum")
    out.append(("all_reduce of a transpose", got, reference(np.sum(xs, axis=0).T, dtype)))
    return out


def all_gather(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    out = []
    # Even sizes along each dim, then rank-dependent sizes (rank 1 holds none) along dim 0 and 1.
    for dim in (0, 1, -1):
        xs = [rank_input(r, (2, 3, 4), dtype)[0] for r in range(comm.size)]
        got = comm.all_gather(rank_input(comm.rank, (2, 3, 4), dtype)[1], dim=dim)
        out.append((f"all_gather dim={dim}", got, reference(np.concatenate(xs, dim), dtype)))
    uneven = [(r + 2) % 4 if r != 1 else 0 for r in range(comm.size)]
    for dim in (0, 1):
        shapes = [(n, 3) if dim == 0 else (3, n) for n in uneven]
        xs = [rank_input(r, shapes[r], dtype, seed=1)[0] for r in range(comm.size)]
        mine = rank_input(comm.rank, shapes[comm.rank], dtype, seed=1)[1]
        expected = reference(np.concatenate(xs, dim), dtype)
        out.append((f"all_gather uneven dim={dim}", comm.all_gather(mine, dim), expected))
        given = comm.all_gather(mine, dim, sizes=uneven)
        out.append((f"all_gather uneven dim={dim} sizes given", given, expected))
    return out


def reduce_scatter(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    out = []
    ops = ("sum", "max", "min", "mean") if dtype.is_floating_point else ("sum", "max", "min")
    n = comm.size
    # tensor_split layout along dim 0 (10 rows: uneven for 3 and 4 ranks) and dim 1, then
    # explicit sizes with an empty block.
    layouts = [(0, (10, 3), None), (1, (2, 7, 2), None), (0, (n * 2 + 1, 2), [0, *[2] * (n - 1)])]
    for dim, shape, sizes in layouts:
        if sizes is not None:
            sizes[-1] += shape[0] - sum(sizes)
        xs = np.stack([rank_input(r, shape, dtype, seed=2)[0] for r in range(n)])
        mine = rank_input(comm.rank, shape, dtype, seed=2)[1]
        blocks = sizes or tensor_split_sizes(shape[dim], n)
        start = sum(blocks[: comm.rank])
        for op in ops:
            full = NP_OPS[op](xs, axis=0)
            expected = reference(np.take(full, range(start, start + blocks[comm.rank]), dim), dtype)
            got = comm.reduce_scatter(mine, dim=dim, op=op, sizes=sizes)
            out.append((f"reduce_scatter {op} dim={dim} sizes={blocks}", got, expected))
    return out


def broadcast(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    out = []
    for src in range(comm.size):
        expected = rank_input(src, (4, 3), dtype, seed=3)[1]
        got = comm.broadcast(rank_input(comm.rank, (4, 3), dtype, seed=3)[1], src=src)
        out.append((f"broadcast src={src}", got, expected))
    return out


def reduce(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    out = []
    xs = np.stack([rank_input(r, (5,), dtype, seed=4)[0] for r in range(comm.size)])
    mine = rank_input(comm.rank, (5,), dtype, seed=4)[1]
    for dst in range(comm.size):
        for op in ("sum", "max"):
            expected = reference(NP_OPS[op](xs, axis=0), dtype)
            if comm.rank != dst:
                expected = torch.zeros_like(expected)
            out.append((f"reduce {op} dst={dst}", comm.reduce(mine, dst, op), expected))
    return out


def many_async(comm: Communicator) -> list[Triple]:
    """Several all-reduces in flight at once, waited on in reverse order."""
    inputs = [torch.full((1000 * (i + 1),), float(comm.rank + i)) for i in range(4)]
    handles = [comm.all_reduce_async(t) for t in inputs]
    total = sum(range(comm.size))
    out = []
    for i in reversed(range(4)):
        expected = torch.full((1000 * (i + 1),), float(total + comm.size * i))
        out.append((f"async all_reduce #{i}", handles[i].wait(), expected))
    comm.barrier()
    return out


def grid_split(comm: Communicator) -> list[Triple]:
    """Rows and columns of a 2 x (size/2) grid (or 1 x 1), then a reversed key order."""
    rows = 2 if comm.size % 2 == 0 else 1
    cols = comm.size // rows
    i, j = divmod(comm.rank, cols)
    row_comm = comm.split(color=i, key=j)
    col_comm = comm.split(color=j, key=i)
    rev = comm.split(color=0, key=-comm.rank)
    me = torch.tensor([comm.rank])
    return [
        (
            "row group rank/size",
            torch.tensor([row_comm.rank, row_comm.size]),
            torch.tensor([j, cols]),
        ),
        (
            "col group rank/size",
            torch.tensor([col_comm.rank, col_comm.size]),
            torch.tensor([i, rows]),
        ),
        ("row all_gather", row_comm.all_gather(me), torch.arange(i * cols, (i + 1) * cols)),
        ("col all_gather", col_comm.all_gather(me), torch.arange(j, comm.size, cols)),
        ("reversed keys", rev.all_gather(me), torch.arange(comm.size - 1, -1, -1)),
        (
            "row broadcast from its last",
            row_comm.broadcast(me, src=cols - 1),
            torch.tensor([i * cols + cols - 1]),
        ),
        (
            "nested split",
            row_comm.split(0, key=0).all_reduce(me),
            torch.tensor([sum(range(i * cols, (i + 1) * cols))]),
        ),
    ]


def neighbor_exchange(comm: Communicator, periodic: bool) -> list[Triple]:
    """Each rank sends (2, 3) to the previous and (1, 3) to the next rank of a chain."""
    r, n = comm.rank, comm.size

    def block(rank: int, tag: int, rows: int) -> torch.Tensor:
        return torch.full((rows, 3), 100.0 * rank + tag)

    prev = (r - 1) % n if periodic or r > 0 else None
    nxt = (r + 1) % n if periodic or r < n - 1 else None
    send, recv, expected = [], [], []
    if prev is not None:
        send.append((prev, block(r, 1, 2)))
    if nxt is not None:
        send.append((nxt, block(r, 2, 1)))
    # Receive order mirrors the send order (from next: its "to prev" message first).
    if nxt is not None:
        recv.append((nxt, torch.empty(2, 3)))
        expected.append(block(nxt, 1, 2))
    if prev is not None:
        recv.append((prev, torch.empty(1, 3)))
        expected.append(block(prev, 2, 1))
    got = comm.neighbor_exchange(send, recv)
    label = f"neighbor_exchange periodic={periodic}"
    return [(f"{label} #{k}", g, e) for k, (g, e) in enumerate(zip(got, expected, strict=True))]


def out_arguments(comm: Communicator, dtype: torch.dtype) -> list[Triple]:
    """Results written into given buffers, and in place (out=input) for all_reduce/broadcast."""
    n, r = comm.size, comm.rank
    xs = np.stack([rank_input(k, (6, 4), dtype, seed=5)[0] for k in range(n)])
    total = reference(xs.sum(0), dtype)
    out = []

    def mine() -> torch.Tensor:
        return rank_input(r, (6, 4), dtype, seed=5)[1]

    def into(label: str, result: torch.Tensor, buf: torch.Tensor, expected: torch.Tensor) -> None:
        out.append((f"{label} returns the buffer", torch.tensor(result is buf), torch.tensor(True)))
        out.append((label, result, expected))

    buf = torch.empty(6, 4, dtype=dtype)
    into("all_reduce out=", comm.all_reduce(mine(), out=buf), buf, total)
    t = mine()
    into("all_reduce in place", comm.all_reduce(t, out=t), t, total)
    t = mine()
    into("all_reduce_async in place", comm.all_reduce_async(t, "max", out=t).wait(), t,
         reference(xs.max(0), dtype))  # fmt: skip
    buf = torch.empty(6, 4 * n, dtype=dtype)
    into("all_gather dim=1 out=", comm.all_gather(mine(), 1, out=buf), buf,
         reference(np.concatenate(list(xs), 1), dtype))  # fmt: skip
    sizes = tensor_split_sizes(6, n)
    start = sum(sizes[:r])
    buf = torch.empty(sizes[r], 4, dtype=dtype)
    into("reduce_scatter out=", comm.reduce_scatter(mine(), out=buf), buf,
         reference(xs.sum(0)[start : start + sizes[r]], dtype))  # fmt: skip
    t = mine()
    into("broadcast in place", comm.broadcast(t, src=n - 1, out=t), t,
         rank_input(n - 1, (6, 4), dtype, seed=5)[1])  # fmt: skip
    t = mine()
    into("reduce in place", comm.reduce(t, dst=0, out=t), t,
         total if r == 0 else torch.zeros_like(total))  # fmt: skip
    return out


def bad_out(comm: Communicator) -> dict[str, str]:
    t = torch.ones(4, 3)
    return _value_errors({
        "shape": lambda: comm.all_reduce(t, out=torch.empty(3, 4)),
        "dtype": lambda: comm.all_reduce(t, out=torch.empty(4, 3, dtype=torch.float64)),
        "non-contiguous": lambda: comm.broadcast(t, out=torch.empty(3, 4).t()),
        "gather shape": lambda: comm.all_gather(t, out=torch.empty(4, 3)) if comm.size > 1
        else comm.all_gather(t, out=torch.empty(5, 3)),
    })  # fmt: skip


COLLECTIVES = [all_reduce, all_gather, reduce_scatter, broadcast, reduce, out_arguments]
"""The cases that take a dtype: every collective over every supported dtype."""


# ----------------------------------------------------------------------------- bad input
def bad_inputs(comm: Communicator) -> dict[str, str]:
    """The message of each ValueError; every rank must raise the same ones."""
    t = torch.ones(4, 2)
    calls = {
        "bool dtype": lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool)),
        "uint8 dtype": lambda: comm.all_gather(torch.ones(2, dtype=torch.uint8)),
        "complex dtype": lambda: comm.broadcast(torch.ones(2, dtype=torch.complex64)),
        "unknown op": lambda: comm.all_reduce(t, op="prod"),
        "mean of ints": lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="mean"),
        "src out of range": lambda: comm.broadcast(t, src=comm.size),
        "negative src": lambda: comm.broadcast(t, src=-1),
        "dst out of range": lambda: comm.reduce(t, dst=comm.size + 3),
        "dim out of range": lambda: comm.all_gather(t, dim=2),
        "reduce_scatter dim": lambda: comm.reduce_scatter(t, dim=-3),
        "0-d all_gather": lambda: comm.all_gather(torch.tensor(1.0)),
        "sizes not adding up": lambda: comm.reduce_scatter(t, sizes=[5] * comm.size),
        "wrong own size": lambda: comm.all_gather(t, sizes=[9] * comm.size),
        "peer out of range": lambda: comm.neighbor_exchange([(comm.size, t)], []),
        "not a tensor": lambda: comm.all_reduce([1.0, 2.0]),
        "negative color": lambda: comm.split(-1),
    }
    messages = _value_errors(calls)
    comm.barrier()  # nothing was left half-entered: the group still works
    return messages


def debug_mismatches(comm: Communicator) -> dict[str, str]:
    """In debug mode, disagreeing calls raise the same ValueError on every rank."""
    was, comm.debug = comm.debug, True
    r = comm.rank
    try:
        calls = {
            "shape": lambda: comm.all_reduce(torch.ones(3 + (r == 0))),
            "dtype": lambda: comm.all_reduce(
                torch.ones(3, dtype=torch.float64 if r else torch.float32)
            ),
            "op": lambda: comm.all_reduce(torch.ones(3), op="max" if r == 0 else "sum"),
            "collective": lambda: (
                comm.broadcast(torch.ones(3)) if r == 0 else comm.all_reduce(torch.ones(3))
            ),
            "src": lambda: comm.broadcast(torch.ones(3), src=r),
            "all_gather other dim": lambda: comm.all_gather(torch.ones(2, 3 + (r == 0))),
            "exchange size": lambda: comm.neighbor_exchange(
                [((r + 1) % comm.size, torch.ones(2 + (r == 0)))],
                [((r - 1) % comm.size, torch.empty(2))],
            ),
        }
        messages = _value_errors(calls)
        # Agreeing calls pass, uneven all_gather sizes included (negative control).
        comm.all_gather(torch.ones(r + 1, 2))
        comm.neighbor_exchange(
            [((r + 1) % comm.size, torch.ones(2))], [((r - 1) % comm.size, torch.empty(2))]
        )
        return messages
    finally:
        comm.debug = was


def _value_errors(calls: dict) -> dict[str, str]:
    """Run each call, which must raise ValueError; return the messages by name."""
    messages = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            messages[name] = str(e)
        else:
            raise AssertionError(f"{name}: no ValueError raised")
    return messages
