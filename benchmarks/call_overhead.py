"""Where parallelkit's few microseconds per MPI collective go: its Python, with MPI stubbed out.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/call_overhead.py      # ~1 min, one process

`collectives.py` measures parallelkit on MPI next to the raw mpi4py call on real ranks; at
4 KiB the difference is a few microseconds. This script takes that difference apart in one
process: an :class:`~parallelkit.comm.mpi.MPICommunicator` of 2 ranks over a stand-in ``Comm``
whose MPI calls return at once, so every microsecond timed is parallelkit's own Python
(argument checks, output buffers, buffer descriptions for mpi4py, the watchdog's bookkeeping).
The same stand-in called with NumPy arrays, as the raw rows of `collectives.py` call mpi4py,
is the floor. The pieces are timed alone too, so that the sum can be compared with the call.

Each time is the best of 7 repeats of 20,000 calls (the best, not the median: this measures
work done, and any other process on the machine only adds to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import torch
from mpi4py import MPI

from parallelkit.comm.mpi import MPICommunicator, _buf

from _common import command_line, environment, save

NUMEL = 1024  # 4 KiB of float32: the size at which collectives.py compares with raw MPI


class StubComm:
    """An mpi4py ``Comm`` of 2 ranks, seen from rank 0, whose calls move nothing."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def Allreduce(self, *args: object) -> None:
        pass

    def Allgather(self, *args: object) -> None:
        pass

    def Reduce_scatter_block(self, *args: object) -> None:
        pass

    def Isend(self, *args: object) -> MPI.Request:
        return MPI.REQUEST_NULL

    Irecv = Isend


@dataclasses.dataclass
class Config:
    number: int = 20_000
    repeats: int = 7


def best_us(fn: Callable[[], object], cfg: Config) -> float:
    return min(timeit.repeat(fn, number=cfg.number, repeat=cfg.repeats)) / cfg.number * 1e6


def calls() -> dict[str, Callable[[], object]]:
    """The calls of collectives.py's raw and pk rows, on the stand-in."""
    stub = StubComm()
    comm = MPICommunicator(stub, timeout=60)  # type: ignore[arg-type]
    x, out = torch.zeros(NUMEL), torch.empty(NUMEL)
    half, gathered, scattered = torch.zeros(NUMEL // 2), torch.empty(NUMEL), torch.empty(NUMEL // 2)
    to_prev, to_next, from_prev, from_next = (torch.zeros(NUMEL) for _ in range(4))
    xn, outn = x.numpy(), out.numpy()
    send, recv = [(1, to_next), (1, to_prev)], [(1, from_prev), (1, from_next)]
    return {
        "mpi4py call with NumPy arrays (the raw rows)": lambda: stub.Allreduce(xn, outn, MPI.SUM),
        "all_reduce(t, out=)": lambda: comm.all_reduce(x, out=out),
        "all_gather(t, sizes, out=)": lambda: comm.all_gather(
            half, sizes=[NUMEL // 2] * 2, out=gathered
        ),
        "reduce_scatter(t, out=)": lambda: comm.reduce_scatter(x, out=scattered),
        "neighbor_exchange (2 sends, 2 receives)": lambda: comm.neighbor_exchange(send, recv),
    }


def pieces() -> dict[str, Callable[[], object]]:
    """The parts every call is made of, alone (each includes a lambda call, ~0.03 us)."""
    x, out = torch.zeros(NUMEL), torch.empty(NUMEL)
    active: dict[int, tuple[float, object, str]] = {}
    tokens = itertools.count()

    def watched() -> None:  # what MPICommunicator._watched adds around the MPI call
        token = next(tokens)
        active[token] = (time.monotonic() + 60.0, None, "x")
        del active[token]

    return {
        "empty lambda": lambda: None,
        "one tensor attribute (t.dtype)": lambda: x.dtype,
        "t.data_ptr()": lambda: x.data_ptr(),
        "MPI.buffer.fromaddress": lambda: MPI.buffer.fromaddress(x.data_ptr(), 4096),
        "_buf(t): one buffer description": lambda: _buf(x),
        "t.numpy() (the alternative to _buf)": lambda: x.numpy(),
        "watchdog bookkeeping": watched,
        "out checks (shape, dtype, device, contiguous)": lambda: (
            out.shape != x.shape,
            out.dtype != x.dtype,
            out.device != x.device,
            out.is_contiguous(),
        ),
        "torch.empty(1024) (a new output)": lambda: torch.empty(NUMEL),
    }


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| what | us per call |", "|---|--:|"]
    lines += [f"| {r['what']} | {r['us']:.2f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/call_overhead.md"))
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = Config()
    call_rows = [{"kind": "call", "what": k, "us": best_us(f, cfg)} for k, f in calls().items()]
    piece_rows = [{"kind": "piece", "what": k, "us": best_us(f, cfg)} for k, f in pieces().items()]
    env = environment(mpi4py=MPI.Get_library_version().splitlines()[0])
    text = "\n".join(
        [
            "# parallelkit's Python per MPI collective (MPI calls stubbed out)",
            "",
            f"Command: `{command_line()}`",
            "",
            *[f"- {k}: {v}" for k, v in env.items()],
            f"- best of {cfg.repeats} repeats of {cfg.number} calls; 4 KiB float32 tensors",
            "",
            "## Calls",
            "",
            table(call_rows),
            "",
            "## Pieces",
            "",
            table(piece_rows),
            "",
        ]
    )
    print(text)
    save(args.out, text, env, cfg, call_rows + piece_rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
