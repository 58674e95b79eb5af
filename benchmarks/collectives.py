"""Latency and bus bandwidth of parallelkit's collectives next to the raw backend calls.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collectives.py            # full run, ~6 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collectives.py --quick    # smoke test, ~1 min

For every message size S (4 KiB to 64 MiB of float32, powers of 4) and every rank count, the
script times, on the same ranks and in alternating order:

    gloo  pk.init("gloo")                next to torch.distributed on the same process group
    mpi   pk.init("mpi") under mpiexec   next to mpi4py on the same MPI communicator

    op                  raw call                                 parallelkit call
    all_reduce          dist.all_reduce / Allreduce              comm.all_reduce(t, out=buf)
    all_gather          all_gather_single / Allgather            comm.all_gather(t, sizes, out=)
    reduce_scatter      reduce_scatter_single / Reduce_scatter_block
                                                                 comm.reduce_scatter(t, out=buf)
    neighbor_exchange   batch_isend_irecv / Isend+Irecv+Waitall  comm.neighbor_exchange

Both write into buffers allocated once (torch's all_reduce, raw and pk, in place), so the two
columns do the same work. Two more rows per op measure parallelkit's conveniences against the
same raw call: "(new output)" returns a new tensor per call (the default, out of place), and
"all_gather (sizes learned)" omits ``sizes=`` and pays one small all-gather to learn them.

Bandwidths follow nccl-tests. S is the all-reduced tensor, the gathered output, the
reduce-scattered input, and for the exchange each of the two messages a rank sends (to its
previous and next rank on a ring) and receives. algbw = S / t, and 2S / t for the exchange;
busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather and reduce_scatter,
algbw for the exchange. t is the median, over repeated timed blocks, of the slowest rank's time
per call (each block starts after a barrier; its time is all-reduced with max).

The parent process launches the ranks itself: spawned processes for gloo, ``mpiexec`` for MPI.
Rank 0 writes its results to a JSON file that the parent reads, prints and saves as markdown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from _common import (
    WARMUP,
    Sync,
    alternating,
    choose_iters,
    command_line,
    environment,
    mpi_sync,
    mpiexec,
    save,
    time_block,
    torch_sync,
)

if TYPE_CHECKING:
    from parallelkit.comm.mpi import MPICommunicator
    from parallelkit.comm.torch_dist import TorchCommunicator

DEFAULT_SIZES = [4**k * 1024 for k in range(1, 9)]  # 4 KiB .. 64 MiB
QUICK_SIZES = [4 * 1024, 1024**2, 16 * 1024**2]
MEASURED = ("all_reduce", "all_gather", "reduce_scatter", "neighbor_exchange")
WORKER_TIMEOUT_S = 1200.0
RAW, PK, PK_NEW, PK_LEARNED = "raw", "pk", "pk (new output)", "pk (sizes learned)"

Variants = dict[str, Callable[[], object]]  # variant name -> one call of the operation


@dataclass
class Config:
    """What every rank measures."""

    sizes: list[int]  # S in bytes
    repeats: int  # timed blocks per variant, alternating raw and parallelkit
    target_s: float  # rough duration of one timed block
    ranks: list[int]  # rank counts of the whole run (for the report)


# ---------------------------------------------------------------------------- timing (ranks)
def measure(variants: Variants, sync: Sync, cfg: Config) -> dict[str, Any]:
    """Warm up, calibrate on the raw call, then time all variants in alternating order."""
    for fn in variants.values():
        for _ in range(WARMUP):
            fn()
    iters = choose_iters(variants[RAW], sync, cfg.target_s)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in alternating(names, cfg.repeats):
        times[name].append(time_block(variants[name], iters, sync))
    return {"iters": iters, "times": times}


# ---------------------------------------------------------------------------- the operations
def ring(rank: int, size: int) -> tuple[int, int]:
    """Previous and next rank on a periodic ring."""
    return (rank - 1) % size, (rank + 1) % size


def torch_variants(comm: TorchCommunicator, op: str, nbytes: int) -> Variants:
    """Raw torch.distributed and parallelkit calls of ``op`` on S = ``nbytes`` (gloo)."""
    import torch.distributed as dist

    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    )
    group, n = comm.group, comm.size
    numel = nbytes // 4
    if op == "all_reduce":
        x, inplace, pk_inplace = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
        return {
            RAW: lambda: dist.all_reduce(inplace, group=group),
            PK: lambda: comm.all_reduce(pk_inplace, out=pk_inplace),
            PK_NEW: lambda: comm.all_reduce(x),
        }
    if op == "all_gather":
        x, out, pk_out = torch.zeros(numel // n), torch.empty(numel), torch.empty(numel)
        return {
            RAW: lambda: all_gather_single(out, x, group=group),
            PK: lambda: comm.all_gather(x, sizes=[numel // n] * n, out=pk_out),
            PK_NEW: lambda: comm.all_gather(x, sizes=[numel // n] * n),
            PK_LEARNED: lambda: comm.all_gather(x, out=pk_out),
        }
    if op == "reduce_scatter":
        x, out, pk_out = torch.zeros(numel), torch.empty(numel // n), torch.empty(numel // n)
        return {
            RAW: lambda: reduce_scatter_single(out, x, group=group),
            PK: lambda: comm.reduce_scatter(x, out=pk_out),
            PK_NEW: lambda: comm.reduce_scatter(x),
        }
    assert op == "neighbor_exchange", op
    prev, nxt = ring(comm.rank, n)
    to_prev, to_next, from_prev, from_next = (torch.zeros(numel) for _ in range(4))

    def raw() -> None:
        ops = [
            dist.P2POp(dist.isend, to_next, nxt, group),
            dist.P2POp(dist.isend, to_prev, prev, group),
            dist.P2POp(dist.irecv, from_prev, prev, group),
            dist.P2POp(dist.irecv, from_next, nxt, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {RAW: raw, PK: _pk_exchange(comm, to_prev, to_next, from_prev, from_next)}


def mpi_variants(comm: MPICommunicator, op: str, nbytes: int) -> Variants:
    """Raw mpi4py and parallelkit calls of ``op`` on S = ``nbytes`` (NumPy views of tensors)."""
    from mpi4py import MPI

    mc, n = comm.comm, comm.size
    numel = nbytes // 4
    if op == "all_reduce":
        x, out, pk_out = torch.zeros(numel), torch.empty(numel), torch.empty(numel)
        xn, outn = x.numpy(), out.numpy()
        return {
            RAW: lambda: mc.Allreduce(xn, outn, op=MPI.SUM),
            PK: lambda: comm.all_reduce(x, out=pk_out),
            PK_NEW: lambda: comm.all_reduce(x),
        }
    if op == "all_gather":
        x, out, pk_out = torch.zeros(numel // n), torch.empty(numel), torch.empty(numel)
        xn, outn = x.numpy(), out.numpy()
        return {
            RAW: lambda: mc.Allgather(xn, outn),
            PK: lambda: comm.all_gather(x, sizes=[numel // n] * n, out=pk_out),
            PK_NEW: lambda: comm.all_gather(x, sizes=[numel // n] * n),
            PK_LEARNED: lambda: comm.all_gather(x, out=pk_out),
        }
    if op == "reduce_scatter":
        x, out, pk_out = torch.zeros(numel), torch.empty(numel // n), torch.empty(numel // n)
        xn, outn = x.numpy(), out.numpy()
        return {
            RAW: lambda: mc.Reduce_scatter_block(xn, outn, op=MPI.SUM),
            PK: lambda: comm.reduce_scatter(x, out=pk_out),
            PK_NEW: lambda: comm.reduce_scatter(x),
        }
    assert op == "neighbor_exchange", op
    prev, nxt = ring(comm.rank, n)
    bufs = to_prev, to_next, from_prev, from_next = [torch.zeros(numel) for _ in range(4)]
    tp, tn, fp, fn = (b.numpy() for b in bufs)

    def raw() -> None:
        requests = [mc.Isend(tn, nxt), mc.Isend(tp, prev), mc.Irecv(fp, prev), mc.Irecv(fn, nxt)]
        MPI.Request.Waitall(requests)

    return {RAW: raw, PK: _pk_exchange(comm, to_prev, to_next, from_prev, from_next)}


def _pk_exchange(
    comm: TorchCommunicator | MPICommunicator,
    to_prev: torch.Tensor,
    to_next: torch.Tensor,
    from_prev: torch.Tensor,
    from_next: torch.Tensor,
) -> Callable[[], object]:
    """parallelkit's ring exchange, posting the same messages in the same order as the raw one."""
    prev, nxt = ring(comm.rank, comm.size)
    send = [(nxt, to_next), (prev, to_prev)]
    recv = [(prev, from_prev), (nxt, from_next)]
    return lambda: comm.neighbor_exchange(send, recv)


# ---------------------------------------------------------------------------- worker (ranks)
def run_benchmark(
    comm: TorchCommunicator | MPICommunicator,
    sync: Sync,
    make: Callable[..., Variants],
    cfg: Config,
) -> list[dict[str, Any]]:
    """Every op and size on this rank; rows of ``{op, bytes, iters, raw, pk}`` times (s)."""
    rows = []
    for nbytes in cfg.sizes:
        for op in MEASURED:
            result = measure(make(comm, op, nbytes), sync, cfg)
            times = result["times"]
            for key in [k for k in times if k != RAW]:
                rows.append(
                    {
                        "op": op if key == PK else f"{op} {key.removeprefix('pk ')}",
                        "bytes": nbytes,
                        "iters": result["iters"],
                        "raw_s": statistics.median(times[RAW]),
                        "pk_s": statistics.median(times[key]),
                        "raw_all_s": times[RAW],
                        "pk_all_s": times[key],
                    }
                )
    return rows


def gloo_rank(comm: TorchCommunicator, cfg: Config) -> list[dict[str, Any]]:
    """One gloo rank (started by parallelkit.testing.Ranks); returns its rows."""
    return run_benchmark(comm, torch_sync(comm.group), torch_variants, cfg)


def mpi_worker(cfg: Config, json_path: str) -> None:
    """One rank under mpiexec; rank 0 writes the rows to ``json_path``."""
    torch.set_num_threads(1)
    import parallelkit as pk

    comm = pk.init("mpi", timeout=300)
    rows = run_benchmark(comm, mpi_sync(comm.comm), mpi_variants, cfg)
    if comm.rank == 0:
        Path(json_path).write_text(json.dumps(rows))


# ---------------------------------------------------------------------------- launchers (parent)
def launch_gloo(n: int, cfg: Config, json_path: str) -> None:
    """Run ``n`` gloo ranks in spawned processes; raise if any fails."""
    from parallelkit.testing import Ranks

    with Ranks(n, "gloo", comm_timeout=300) as ranks:
        rows = ranks.run(gloo_rank, cfg, timeout=WORKER_TIMEOUT_S)[0]
    Path(json_path).write_text(json.dumps(rows))


def launch_mpi(n: int, cfg: Config, json_path: str) -> None:
    """Run ``n`` ranks of this script under mpiexec; raise if it fails."""
    command = [
        mpiexec(),
        "-n",
        str(n),
        sys.executable,
        __file__,
        "--worker",
        "mpi",
        "--json",
        json_path,
        "--sizes",
        ",".join(str(s) for s in cfg.sizes),
        "--repeats",
        str(cfg.repeats),
        "--target-s",
        str(cfg.target_s),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, timeout=WORKER_TIMEOUT_S)


def run_one(backend: str, n: int, cfg: Config) -> list[dict[str, Any]]:
    """The rows of one (backend, ranks) run, measured in fresh worker processes."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = str(Path(tmp, "rows.json"))
        (launch_gloo if backend == "gloo" else launch_mpi)(n, cfg, json_path)
        rows = json.loads(Path(json_path).read_text())
    return [{"backend": backend, "ranks": n, **row} for row in rows]


# ---------------------------------------------------------------------------- reporting (parent)
def bus_factor(op: str, n: int) -> float:
    """busbw / algbw (nccl-tests)."""
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter")):
        return (n - 1) / n
    return 1.0


def busbw_gbs(op: str, nbytes: int, n: int, seconds: float) -> float:
    """Bus bandwidth in GB/s (1e9 bytes) of one call taking ``seconds``."""
    moved = 2 * nbytes if op == "neighbor_exchange" else nbytes
    return moved / seconds * bus_factor(op, n) / 1e9


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """ "4K" -> 4096, "1M" -> 1048576, "512" -> 512 (bytes)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def add_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """A row with bus bandwidths and pk/raw ratios added."""
    op, nbytes, n = row["op"], row["bytes"], row["ranks"]
    raw_bw, pk_bw = (busbw_gbs(op, nbytes, n, row[k]) for k in ("raw_s", "pk_s"))
    return {
        **row,
        "raw_busbw_gbs": raw_bw,
        "pk_busbw_gbs": pk_bw,
        "time_ratio": row["pk_s"] / row["raw_s"],
        "busbw_ratio": pk_bw / raw_bw,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One table of rows (one backend, one rank count)."""
    lines = [
        "| op | size | raw time (us) | pk time (us) | pk/raw time "
        "| raw busbw (GB/s) | pk busbw (GB/s) | pk/raw busbw |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for r in sorted(rows, key=lambda r: (ops.index(r["op"]), r["bytes"])):
        lines.append(
            f"| {r['op']} | {size_label(r['bytes'])} | {r['raw_s'] * 1e6:.1f} "
            f"| {r['pk_s'] * 1e6:.1f} | {r['time_ratio']:.2f} | {r['raw_busbw_gbs']:.3f} "
            f"| {r['pk_busbw_gbs']:.3f} | {r['busbw_ratio']:.2f} |"
        )
    return "\n".join(lines)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per backend, ranks and op: worst pk/raw busbw at >= 1 MiB, pk/raw time at the smallest S."""
    smallest = min(r["bytes"] for r in rows)
    lines = [
        f"| backend | ranks | op | min pk/raw busbw (S >= 1 MiB) "
        f"| pk/raw time ({size_label(smallest)}) |",
        "|---|--:|---|--:|--:|",
    ]
    keys = dict.fromkeys((r["backend"], r["ranks"], r["op"]) for r in rows)
    for backend, n, op in keys:
        mine = [r for r in rows if (r["backend"], r["ranks"], r["op"]) == (backend, n, op)]
        big = [r["busbw_ratio"] for r in mine if r["bytes"] >= 1024**2]
        small = [r["time_ratio"] for r in mine if r["bytes"] == smallest]
        big_text = f"{min(big):.2f}" if big else "-"
        small_text = f"{small[0]:.2f}" if small else "-"
        lines.append(f"| {backend} | {n} | {op} | {big_text} | {small_text} |")
    return "\n".join(lines)


def mpi_version() -> str:
    """mpi4py's and the MPI library's versions, for the header of the results."""
    try:
        import mpi4py

        mpi4py.rc.initialize = mpi4py.rc.finalize = False  # the parent is no MPI process
        from mpi4py import MPI

        mpi = f"mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}"
    except ImportError:
        mpi = "mpi4py not installed"
    return " ".join(mpi.split())


def oversubscribed(cfg: Config, env: dict[str, str]) -> str:
    """A sentence on rank counts that exceed the cores, or nothing."""
    over = [n for n in cfg.ranks if n > int(env["nproc"])]
    if not over:
        return ""
    counts = " and ".join(str(n) for n in over)
    return f"{counts} ranks oversubscribe the {env['nproc']} cores: those numbers are noisy. "


def report(rows: list[dict[str, Any]], env: dict[str, str], cfg: Config) -> str:
    """The whole markdown document."""
    parts = [
        "# Collectives: parallelkit next to the raw backend calls",
        "",
        f"Command: `{command_line()}`",
        "",
        f"- date: {env['date']}",
        f"- python {env['python']}, torch {env['torch']}, {env['mpi']}",
        f"- CPU: {env['cpu']}, nproc {env['nproc']}",
        f"- {cfg.repeats} timed blocks per variant of ~{cfg.target_s:g} s each, raw and "
        "parallelkit alternating; time = median over blocks of the slowest rank's time per call",
        "",
        "S is the all-reduced tensor, the gathered output, the reduce-scattered input, and for "
        "the neighbour exchange each of the two messages a rank sends (to both ring neighbours); "
        "busbw follows nccl-tests (GB/s = 1e9 B/s; the exchange counts the 2S bytes a rank "
        "sends).",
        "",
        "The raw calls and the plain pk rows write into buffers allocated once (`out=`; torch's "
        "all_reduce in place), so they do the same work. '(new output)' rows are pk's default "
        "out-of-place call, which allocates the result on every call (and, for all_reduce on "
        "torch, copies the input into it); a fresh allocation of many MiB is page-faulted in "
        "each time. 'all_gather (sizes learned)' omits `sizes=` and pays one small all-gather "
        "to learn them. All extra rows are timed against the same raw call.",
        "",
        f"Every rank is one process with one compute thread. {oversubscribed(cfg, env)}"
        "gloo adds communication threads per rank, so its numbers are noisy at any rank count; "
        "the JSON file next to this one holds every timed block.",
        "",
        "## Summary",
        "",
        summary_table(rows),
    ]
    for backend, n in dict.fromkeys((r["backend"], r["ranks"]) for r in rows):
        parts += ["", f"## {backend}, {n} ranks", ""]
        parts.append(
            markdown_table([r for r in rows if (r["backend"], r["ranks"]) == (backend, n)])
        )
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", help="comma-separated sizes S, e.g. 4K,1M,64M (default 4K..64M)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--quick", action="store_true", help="4K, 1M, 16M and short blocks")
    p.add_argument("--repeats", type=int, help="timed blocks per variant (default 5, quick 3)")
    p.add_argument("--target-s", type=float, help="seconds per timed block (default 0.12)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/collectives.md"))
    p.add_argument("--worker", choices=["mpi"], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    for s, n in itertools.product(sizes, args.ranks):
        if s % (4 * n):
            raise SystemExit(f"--sizes: {s} B is not a whole number of float32 per rank on {n}")
    repeats = args.repeats or (3 if args.quick else 5)
    target_s = args.target_s or (0.05 if args.quick else 0.12)
    return Config(sizes=sizes, repeats=repeats, target_s=target_s, ranks=args.ranks)


def main() -> None:
    args = parse_args()
    cfg = config(args)
    if args.worker == "mpi":
        mpi_worker(cfg, args.json)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    for backend in args.backends:
        for n in args.ranks:
            start = time.monotonic()
            mine = [add_ratios(r) for r in run_one(backend, n, cfg)]
            print(f"\n## {backend}, {n} ranks ({time.monotonic() - start:.0f} s)\n", flush=True)
            print(markdown_table(mine), flush=True)
            rows += mine
    env = environment(mpi=mpi_version())
    text = report(rows, env, cfg)
    print("\n## Summary\n\n" + summary_table(rows))
    json_path = save(args.out, text, env, cfg, rows)
    print(f"\nwrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
