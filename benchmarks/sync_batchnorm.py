"""Forward + backward time of parallelkit's SyncBatchNorm next to a local torch BatchNorm2d.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_batchnorm.py            # full run, ~4 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_batchnorm.py --quick    # smoke test, <1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_batchnorm.py --backend mpi  # mpiexec

Shapes are (N, C, H, W) of ResNet-18's batch norms on 224x224 images, batch 32 per rank:
(32, 64, 56, 56), (32, 128, 28, 28), (32, 256, 14, 14), (32, 512, 7, 7). Every rank holds a
whole (N, C, H, W) slice (the global batch is ranks x N) and times, on the same input and
output gradient, in alternating order:

    local        torch.nn.BatchNorm2d(C) in training mode: statistics of this rank's slice
    sync         parallelkit SyncBatchNorm(C, comm=comm): statistics over all ranks' slices
    collectives  sync's two collectives alone, float32: the forward's all_gather of every
                 rank's packed (n, mean (C), M2 (C)) and the backward's all_reduce of
                 (sum dy (C), sum dy*xhat (C))

and, on more than one rank, two stand-ins that take sync's added time apart:

    no messages  sync's arithmetic on a communicator of as many ranks that sends nothing
                 (the all_gather repeats this rank's statistics, the all_reduce multiplies):
                 what sync computes beyond local, without waiting for any peer
    barriers     the same, with a barrier of the real communicator where each collective
                 is: the waiting for the slower rank, without the messages

so that sync - local = (no messages - local: computing) + (barriers - no messages: waiting)
+ (sync - barriers: the messages).

One call is ``y = bn(x)`` and ``torch.autograd.grad(y, (x, weight, bias), dy)``. On 1 rank
sync runs on a LocalCommunicator, where SyncBatchNorm takes plain ``F.batch_norm``. Each
variant calls until a block lasts about ``--target-s``; t is the median, over ``--repeats``
blocks in alternating order, of the slowest rank's time per call (each block starts after a
barrier; its time is all-reduced with max). The ranks are gloo processes with one thread each,
started by ``parallelkit.testing.Ranks``, or with ``--backend mpi`` MPI ranks under the mpiexec
next to this Python (``pk.init("mpi")``); 4 ranks on a 2-core machine oversubscribe it.

Goal (measured, not tuned for): sync <= 1.3 x local at 2 ranks for (32, 64, 56, 56).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from _common import (
    WARMUP,
    OtherLoad,
    Sync,
    alternating,
    choose_iters,
    comm_sync,
    command_line,
    environment,
    keep_freed_memory,
    library_state,
    mpi_worker,
    run_mpi,
    save,
    time_block_cpu,
)

if TYPE_CHECKING:
    from parallelkit.comm.base import Communicator
    from parallelkit.comm.mpi import MPICommunicator
    from parallelkit.comm.torch_dist import TorchCommunicator

DEFAULT_SHAPES = [(32, 64, 56, 56), (32, 128, 28, 28), (32, 256, 14, 14), (32, 512, 7, 7)]
QUICK_SHAPES = [(32, 64, 56, 56), (32, 512, 7, 7)]
GOAL_SHAPE, GOAL_RANKS, GOAL = (32, 64, 56, 56), 2, 1.3
WORKER_TIMEOUT_S = 1200.0
LOCAL, SYNC, COLL = "local", "sync", "collectives"
NO_MESSAGES, BARRIERS = "no messages", "barriers"

Variants = dict[str, Callable[[], object]]  # variant name -> one forward + backward


@dataclass
class Config:
    """What every rank measures."""

    shapes: list[tuple[int, int, int, int]]  # (N, C, H, W) per rank
    repeats: int  # timed blocks per variant, alternating
    target_s: float  # rough duration of one timed block
    ranks: list[int]  # rank counts of the whole run
    backend: str = "gloo"  # or "mpi": ranks under mpiexec


# ---------------------------------------------------------------------------- timing (ranks)
def measure(variants: Variants, sync: Sync, cfg: Config) -> dict[str, Any]:
    """Warm up, calibrate every variant, then time them in alternating order."""
    for fn in variants.values():
        for _ in range(WARMUP):
            fn()
    iters = {name: choose_iters(fn, sync, cfg.target_s) for name, fn in variants.items()}
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in alternating(names, cfg.repeats):
        wall, cpu_s = time_block_cpu(variants[name], iters[name], sync)
        times[name].append(wall)
        cpu[name].append(cpu_s)
    return {"iters": iters, "times": times, "cpu_times": cpu}


# ---------------------------------------------------------------------------- variants (ranks)
def forward_backward(bn: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    inputs = (x, bn.weight, bn.bias)
    return lambda: torch.autograd.grad(bn(x), inputs, dy)


def collectives(comm: Communicator, c: int) -> Callable[[], object]:
    """SyncBatchNorm's forward all_gather and backward all_reduce, with its sizes and dtype."""
    stats, sums = torch.randn(1, 1 + 2 * c), torch.randn(2 * c)
    sizes = [1] * comm.size

    def both() -> None:
        comm.all_gather(stats, sizes=sizes)
        comm.all_reduce(sums)

    return both


def unsent(comm: Communicator, barriers: bool) -> Communicator:
    """A communicator of ``comm``'s rank and size that sends nothing: an all_gather repeats this
    rank's tensor, an all_reduce multiplies it by the size (the same arithmetic as the real
    ones, on other numbers). With ``barriers``, each first waits at a barrier of ``comm``."""
    from parallelkit.comm.local import LocalCommunicator

    class Unsent(LocalCommunicator):
        def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
            if barriers:
                comm.barrier()
            return out.copy_(t.expand(len(sizes), *t.shape[1:]))

        def _all_reduce(self, t: torch.Tensor, op: Any, out: torch.Tensor) -> torch.Tensor:
            if barriers:
                comm.barrier()
            return torch.mul(t, self.size, out=out)

    stand_in = Unsent()
    stand_in.rank, stand_in.size = comm.rank, comm.size
    return stand_in


def variants_for(comm: Communicator, shape: tuple[int, int, int, int]) -> Variants:
    from parallelkit.nn.sync_batchnorm import SyncBatchNorm

    c = shape[1]
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(shape, generator=gen).requires_grad_()
    dy = torch.randn(shape, generator=gen)
    variants = {
        LOCAL: forward_backward(nn.BatchNorm2d(c), x, dy),
        SYNC: forward_backward(SyncBatchNorm(c, comm=comm), x, dy),
        COLL: collectives(comm, c),
    }
    if comm.size > 1:
        for name, barriers in ((NO_MESSAGES, False), (BARRIERS, True)):
            bn = SyncBatchNorm(c, comm=unsent(comm, barriers))
            variants[name] = forward_backward(bn, x, dy)
    return variants


# ---------------------------------------------------------------------------- worker (ranks)
def rank_rows(comm: TorchCommunicator | MPICommunicator, cfg: Config) -> list[dict[str, Any]]:
    """Every shape on this rank (started by parallelkit.testing.Ranks or mpiexec); its rows."""
    from parallelkit.comm.local import LocalCommunicator

    pk_comm = LocalCommunicator() if comm.size == 1 else comm
    sync = comm_sync(comm)
    rows = []
    for shape in cfg.shapes:
        result = measure(variants_for(pk_comm, shape), sync, cfg)
        times, cpu = result["times"], result["cpu_times"]
        rows.append(
            {
                "shape": list(shape),
                "iters": result["iters"],
                **{f"{name}_s": statistics.median(ts) for name, ts in times.items()},
                **{f"{name}_cpu_s": statistics.median(ts) for name, ts in cpu.items()},
                "times": times,
                "cpu_times": cpu,
            }
        )
    return rows


# ---------------------------------------------------------------------------- launch (parent)
def run_one(n: int, cfg: Config) -> tuple[list[dict[str, Any]], float]:
    """The rows of one rank count, and the cores other processes used meanwhile."""
    from parallelkit.testing import Ranks

    load = OtherLoad()
    if cfg.backend == "mpi":
        rows = run_mpi(__file__, n, (cfg,), WORKER_TIMEOUT_S)[0]
    else:
        with Ranks(n, "gloo", comm_timeout=300) as ranks:
            rows = ranks.run(rank_rows, cfg, timeout=WORKER_TIMEOUT_S)[0]
    # The ranks have been joined: their CPU time is in this process's cutime and cstime.
    return [{"ranks": n, **row} for row in rows], load.cores()


# ---------------------------------------------------------------------------- reporting (parent)
def shape_label(shape: list[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def add_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """A row with sync/local and what sync adds beyond the collectives alone."""
    return {
        **row,
        "sync_over_local": row["sync_s"] / row["local_s"],
        "sync_over_local_cpu": row["sync_cpu_s"] / row["local_cpu_s"],
        "added_s": row["sync_s"] - row["local_s"],
        "added_beyond_collectives_s": row["sync_s"] - row["local_s"] - row["collectives_s"],
        **breakdown(row),
    }


def breakdown(row: dict[str, Any]) -> dict[str, float]:
    """sync - local as computing, waiting for the slower rank, and the messages (s)."""
    if "no messages_s" not in row:
        return {}
    return {
        "computing_s": row["no messages_s"] - row["local_s"],
        "waiting_s": row["barriers_s"] - row["no messages_s"],
        "messages_s": row["sync_s"] - row["barriers_s"],
    }


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | shape (N, C, H, W) per rank | local (ms) | no messages (ms) | barriers (ms) "
        "| sync (ms) | sync - local (ms) | = computing | + waiting | + messages |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        if "computing_s" in r:
            ms = {k: r[k] * 1e3 for k in ("local_s", "no messages_s", "barriers_s", "sync_s")}
            lines.append(
                f"| {r['ranks']} | {shape_label(r['shape'])} | {ms['local_s']:.2f} "
                f"| {ms['no messages_s']:.2f} | {ms['barriers_s']:.2f} | {ms['sync_s']:.2f} "
                f"| {r['added_s'] * 1e3:+.2f} | {r['computing_s'] * 1e3:+.2f} "
                f"| {r['waiting_s'] * 1e3:+.2f} | {r['messages_s'] * 1e3:+.2f} |"
            )
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | shape (N, C, H, W) per rank | local (ms) | sync (ms) | sync/local "
        "| sync/local per block, min..max | collectives (ms) | sync - local - collectives (ms) "
        "| CPU: local (ms) | CPU: sync (ms) | CPU: sync/local |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        per_block = [s / loc for s, loc in zip(r["times"][SYNC], r["times"][LOCAL], strict=True)]
        lines.append(
            f"| {r['ranks']} | {shape_label(r['shape'])} | {r['local_s'] * 1e3:.2f} "
            f"| {r['sync_s'] * 1e3:.2f} | {r['sync_over_local']:.2f} "
            f"| {min(per_block):.2f}..{max(per_block):.2f} | {r['collectives_s'] * 1e3:.3f} "
            f"| {r['added_beyond_collectives_s'] * 1e3:.2f} | {r['local_cpu_s'] * 1e3:.2f} "
            f"| {r['sync_cpu_s'] * 1e3:.2f} | {r['sync_over_local_cpu']:.2f} |"
        )
    return "\n".join(lines)


def goal_line(rows: list[dict[str, Any]]) -> str:
    hit = [r for r in rows if r["ranks"] == GOAL_RANKS and tuple(r["shape"]) == GOAL_SHAPE]
    if not hit:
        return f"Goal sync/local <= {GOAL} at {GOAL_RANKS} ranks for {GOAL_SHAPE}: not measured."
    ratio = hit[0]["sync_over_local"]
    verdict = "met" if ratio <= GOAL else "MISSED"
    return (
        f"Goal sync/local <= {GOAL} at {GOAL_RANKS} ranks for {shape_label(list(GOAL_SHAPE))}: "
        f"{ratio:.2f}, {verdict}."
    )


def report(rows, others: dict[int, float], env: dict[str, str], cfg: Config) -> str:
    """The whole markdown document."""
    over = [n for n in cfg.ranks if n > int(env["nproc"])]
    over_text = ""
    if over:
        counts = " and ".join(str(n) for n in over)
        over_text = (
            f"**{counts} ranks oversubscribe the {env['nproc']} cores**: every rank gets a "
            "fraction of a core and waits for descheduled peers in the collectives, so those "
            "rows are noisy and slower than the per-rank work alone would be. "
        )
    load = ", ".join(f"{others[n]:.2f} during {n} rank(s)" for n in cfg.ranks)
    parts = [
        "# SyncBatchNorm: parallelkit next to a local torch BatchNorm2d",
        "",
        f"Command: `{command_line()}`",
        "",
        f"- date: {env['date']}",
        f"- python {env['python']}, torch {env['torch']}, {transport(cfg.backend)}; "
        f"parallelkit {env['parallelkit']}",
        f"- CPU: {env['cpu']}, nproc {env['nproc']}",
        f"- malloc: {env['malloc']}",
        f"- {cfg.repeats} timed blocks per variant of ~{cfg.target_s:g} s each, variants "
        "alternating; time = median over blocks of the slowest rank's time per call",
        f"- cores used by processes outside this benchmark meanwhile: {load}",
        "",
        "A call is forward + backward (input, weight and bias gradients) in training mode. "
        "Every rank holds the whole shape given, so the statistics of sync cover ranks x N "
        "images. 'collectives' times sync's two collectives alone (all_gather of 1 + 2C and "
        "all_reduce of 2C float32); 'sync - local - collectives' is what sync costs beyond "
        "local BatchNorm and its communication. CPU columns are the process time of the busiest "
        "rank per call, all its threads: what a rank consumed, not what it waited (for peers, or "
        "for cores that others held). On 1 rank sync runs on a LocalCommunicator and "
        "is plain F.batch_norm. Each rank is one process with one compute thread; gloo adds "
        f"its own threads. {over_text}The JSON file next to this one holds every timed block.",
        "",
        goal_line(rows),
        "",
        markdown_table(rows),
        "",
        "## Where sync's added time goes",
        "",
        "'no messages' runs sync on a stand-in communicator of as many ranks that sends "
        "nothing (the same arithmetic on other numbers); 'barriers' adds a barrier of the real "
        "communicator where each of the two collectives is. So sync - local = computing (no "
        "messages - local: the statistics' packing and merge, the running statistics, the "
        "input gradient's extra pass) + waiting (barriers - no messages: for the slower rank, "
        "twice a step) + messages (sync - barriers). Each term is a difference of medians, "
        "so small ones are within the noise.",
        "",
        breakdown_table(rows),
    ]
    return "\n".join(parts) + "\n"


def transport(backend: str) -> str:
    return 'MPI ranks under mpiexec, pk.init("mpi")' if backend == "mpi" else "gloo"


# ---------------------------------------------------------------------------- command line
def parse_shape(text: str) -> tuple[int, int, int, int]:
    """ "32,64,56,56" -> (32, 64, 56, 56)."""
    dims = tuple(int(v) for v in text.strip("()").split(","))
    if len(dims) != 4:
        raise argparse.ArgumentTypeError(f"a shape is N,C,H,W, got {text!r}")
    return dims  # type: ignore[return-value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shape, nargs="+", help="N,C,H,W per rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--quick", action="store_true", help="two shapes and short blocks")
    p.add_argument("--repeats", type=int, help="timed blocks per variant (default 9, quick 3)")
    p.add_argument("--target-s", type=float, help="seconds per timed block (default 0.3)")
    p.add_argument("--backend", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--glibc-defaults", action="store_true", help="leave malloc's settings alone")
    p.add_argument("--out", type=Path, help="default benchmarks/results/sync_batchnorm[_mpi].md")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # one rank under mpiexec
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    shapes = args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    repeats = args.repeats or (3 if args.quick else 9)
    target_s = args.target_s or (0.05 if args.quick else 0.3)
    return Config(shapes, repeats, target_s, args.ranks, args.backend)


def main() -> None:
    args = parse_args()
    if args.worker:  # one rank under mpiexec (run_mpi)
        mpi_worker(rank_rows, *args.worker, timeout=WORKER_TIMEOUT_S)
        return
    cfg = config(args)
    suffix = "_mpi" if cfg.backend == "mpi" else ""
    out = args.out or Path(f"benchmarks/results/sync_batchnorm{suffix}.md")
    os.environ["OMP_NUM_THREADS"] = "1"
    # At the start: the code and the date of what is measured.
    env = environment(parallelkit=library_state())
    env["malloc"] = keep_freed_memory(args.glibc_defaults)
    rows, others = [], {}
    for n in cfg.ranks:
        start = time.monotonic()
        mine, others[n] = run_one(n, cfg)
        mine = [add_ratios(r) for r in mine]
        seconds = time.monotonic() - start
        print(f"\n## {n} rank(s) ({seconds:.0f} s; others used {others[n]:.2f} cores)\n")
        print(markdown_table(mine), flush=True)
        if n > 1:
            print("\n" + breakdown_table(mine), flush=True)
        rows += mine
    print("\n" + goal_line(rows))
    text = report(rows, others, env, cfg)
    json_path = save(out, text, env, cfg, rows, other_load_cores=others)
    print(f"\nwrote {out} and {json_path}")


if __name__ == "__main__":
    main()
