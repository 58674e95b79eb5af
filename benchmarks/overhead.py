"""The fixed cost of a parallel step: what parallelkit adds per step where the work is small.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py                # MPI, ~3 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --backend gloo
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --quick        # smoke, ~1 min

On a GPU or TPU a convolution of a thin network takes microseconds, so what is left of a
parallel step is the library's own cost: Python per operation, the small operations it adds,
one message per collective. This CPU machine hides that cost behind slow convolutions unless
the work is small, so this script times a *thin* network, where the work is small (op-bound),
and the same network wider and larger (compute-bound), on 2 ranks (MPI under mpiexec: a
collective takes 5-10 us, as on fast interconnects; or gloo: about 1 ms here).

Every variant is one SGD step (forward, cross-entropy, backward, ``optimizer.step``), with
every rank running it at the same time; a step's time is the slowest rank's, the median over
alternating rounds:

    plain        the plain model on a batch of ``--batch`` on every rank, no communication
    data         pk.parallelize(model, comm, "data"): DataParallel + SyncBatchNorm, each rank
                 its own batch of ``--batch`` (its ceiling: plain)
    data, local BatchNorm
                 the same with each SyncBatchNorm put back to torch's BatchNorm (statistics of
                 the rank's own batch: not the dense numbers): what DataParallel alone costs
    channel      pk.parallelize(model, comm, "channel"): every convolution split by channels,
                 the same whole batch on every rank (reported against plain)
    spatial      pk.parallelize(model, comm, "spatial"): the batch's images split by rows
    spatial ceiling
                 the plain model on each rank's rows (torch.tensor_split) plus 3 halo rows,
                 every rank at once, no communication: the most a row split can give

The fixed cost is reported per operator of the plain step (what a ``TorchDispatchMode`` sees
in one plain step: on a GPU, about one kernel launch each): (variant - its ceiling) / calls.
``--compile`` adds, on gloo, the number of graphs ``torch._dynamo.explain`` finds in each
variant's forward (torch's DDP on the same model for reference), and in the op-bound case the
step of each strategy under ``torch.compile`` (inductor), timed in the same alternating
rounds as the eager ones, with its first step (the compile) apart.

Results: benchmarks/results/overhead_<backend>.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _common import (
    OtherLoad,
    alternating,
    ceiling_rows,
    comm_sync,
    command_line,
    environment,
    mpi_worker,
    run_mpi,
    save,
)

CEILING_HALO = 3  # rows the stem (7x7, stride 2, padding 3) reads past a block
VARIANTS = ("plain", "data", "data, local BatchNorm", "channel", "spatial", "spatial ceiling")
STRATEGIES = ("data", "channel", "spatial")
WORKER_TIMEOUT_S = 1800.0


@dataclass
class Config:
    sizes: tuple[tuple[str, tuple[int, ...], int], ...] = (
        ("op-bound: widths 4-32, 32x32", (4, 8, 16, 32), 32),
        ("compute-bound: widths 16-128, 128x128", (16, 32, 64, 128), 128),
    )
    batch: int = 2
    warmup: int = 3
    repeats: int = 15
    backend: str = "mpi"
    compile: bool = False


class _Count(TorchDispatchMode):
    """Counts the operators a step runs (forward, backward, optimizer): on a GPU, about one
    kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _model(widths: tuple[int, ...]) -> torch.nn.Module:
    from parallelkit.models import resnet50

    torch.manual_seed(0)
    return resnet50(widths=widths, num_classes=10)


def _step(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor,
          ) -> Callable[[], tuple[float, float]]:
    """One SGD step; returns its wall and CPU seconds on this rank."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), labels).backward()
        opt.step()
        return time.perf_counter() - started, time.process_time() - cpu

    return step


def _local_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each SyncBatchNorm replaced by the torch BatchNorm holding its state."""
    from parallelkit.nn import SyncBatchNorm

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SyncBatchNorm):
                setattr(parent, name, child.to_dense())
    return model


def _operators(step: Callable[[], object]) -> int:
    counter = _Count()
    with counter:
        step()
    return counter.calls


def rank_job(comm: Any, cfg: Config, widths: tuple[int, ...], size: int) -> dict[str, Any]:
    """Every variant's step on this rank (all ranks at once); the slowest rank's times."""
    import parallelkit as pk

    torch.set_num_threads(1)
    base = _model(widths)
    x = torch.randn(cfg.batch, 3, size, size)
    labels = torch.randint(0, 10, (cfg.batch,))
    rows = ceiling_rows(size, comm.size, comm.rank, CEILING_HALO)
    steps = {
        "plain": _step(copy.deepcopy(base), x, labels),
        "data": _step(pk.parallelize(copy.deepcopy(base), comm, "data"), x, labels),
        "data, local BatchNorm": _step(
            _local_norms(pk.parallelize(copy.deepcopy(base), comm, "data")), x, labels),
        "channel": _step(pk.parallelize(copy.deepcopy(base), comm, "channel"), x, labels),
        "spatial": _step(pk.parallelize(copy.deepcopy(base), comm, "spatial"), x, labels),
        "spatial ceiling": _step(copy.deepcopy(base), x[:, :, rows].contiguous(), labels),
    }
    sync = comm_sync(comm)
    compile_s = {}
    if cfg.compile and size == cfg.sizes[0][2]:  # the op-bound case, where compiling pays
        for name in STRATEGIES:
            steps[f"{name} compiled"] = _step(
                torch.compile(pk.parallelize(copy.deepcopy(base), comm, name)), x, labels)
            sync.barrier()
            compile_s[name] = sync.max(steps[f"{name} compiled"]()[0])
    names = list(steps)
    for name in names:
        for _ in range(cfg.warmup):
            steps[name]()
    operators = {name: _operators(steps[name]) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in alternating(names, cfg.repeats):
        sync.barrier()
        wall, used = steps[name]()
        times[name].append(sync.max(wall))
        cpu[name].append(sync.max(used))
    result: dict[str, Any] = {"calls": operators["plain"], "operators": operators,
                              "compile_s": compile_s}  # fmt: skip
    result["ms"] = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    result["cpu_ms"] = {name: statistics.median(ts) * 1e3 for name, ts in cpu.items()}
    if cfg.compile:
        result["graphs"] = _graphs(comm, base, x)
    return result


def _graphs(comm: Any, base: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Graphs and breaks ``torch._dynamo.explain`` finds in each variant's forward."""
    import torch._dynamo

    import parallelkit as pk

    out: dict[str, Any] = {}
    models = {name: pk.parallelize(copy.deepcopy(base), comm, name)
              for name in ("data", "channel", "spatial")}  # fmt: skip
    if getattr(comm, "backend", "") == "gloo":
        import torch.distributed as dist

        models["torch DDP"] = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), process_group=dist.group.WORLD)
    for name, model in models.items():
        torch._dynamo.reset()
        try:
            e = torch._dynamo.explain(model)(x)
            out[name] = {"graphs": e.graph_count, "breaks": e.graph_break_count,
                         "reasons": sorted({str(b.reason).splitlines()[0][:120]
                                            for b in e.break_reasons})[:8]}  # fmt: skip
        except Exception as exc:  # reported in the table, not hidden
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


class _Pointwise(torch.nn.Module):
    """A 1x1 convolution, then ``ops`` pointwise operations (``relu(x) + x``, each two) on its
    output: under spatial parallelism a block, each operation one call of the guard's rule."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.conv, self.ops = torch.nn.Conv2d(2, 2, 1), ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for _ in range(self.ops // 2):
            x = torch.relu(x) + x
        return x.mean((2, 3))


def guard_job(comm: Any, cfg: Config) -> dict[str, float]:
    """Microseconds per pointwise operation on a small block: plain, and under the spatial
    guard (its rule, the record of blocks); the best of ``cfg.repeats`` forwards, no grad."""
    import parallelkit as pk

    torch.set_num_threads(1)
    ops, x = 200, torch.randn(1, 2, 8, 8)
    models = {"plain": _Pointwise(ops), "spatial": pk.parallelize(_Pointwise(ops), comm,
                                                                  "spatial")}  # fmt: skip
    sync, best = comm_sync(comm), {}
    with torch.no_grad():
        for name in alternating(list(models), cfg.repeats * 4):
            sync.barrier()
            start = time.perf_counter()
            models[name](x)
            took = sync.max(time.perf_counter() - start) / ops * 1e6
            best[name] = min(best.get(name, took), took)
    return best


def _job(comm: Any, what: str, *args: Any) -> Any:
    return guard_job(comm, *args) if what == "guard" else rank_job(comm, *args)


# ---------------------------------------------------------------------------- parent
def run(cfg: Config) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from parallelkit.testing import Ranks

    def on_ranks(*args: Any) -> Any:
        if cfg.backend == "mpi":
            return run_mpi(str(Path(__file__).resolve()), 2, args, WORKER_TIMEOUT_S)[0]
        with Ranks(2, "gloo", comm_timeout=900) as ranks:
            return ranks.run(_job, *args, timeout=WORKER_TIMEOUT_S)[0]

    rows = []
    for label, widths, size in cfg.sizes:
        load = OtherLoad()
        res = on_ranks("step", cfg, widths, size)
        rows.append({"case": label, **res, "other_load_cores": load.cores()})
    return rows, on_ranks("guard", cfg)


def report(cfg: Config, rows: list[dict[str, Any]], guard: dict[str, float],
           env: dict[str, str]) -> str:  # fmt: skip
    lines = [
        f"# Fixed cost of a parallel step: 2 ranks, {cfg.backend}", "",
        f"Command: `{env['command']}`", "",
        f"Machine: {env['cpu']}, {env['nproc']} cores; python {env['python']}, torch "
        f"{env['torch']}; {env['date']}.", "",
        "One SGD step of parallelkit's ResNet-50 (bottleneck 3-4-6-3) at the widths named, "
        f"batch {cfg.batch}; median of {cfg.repeats} alternating rounds, the slowest rank's "
        "time. Ceiling: data's is plain (each rank its own batch); spatial's is the plain "
        "model on each rank's rows plus 3 halo rows. `per call` is (step - ceiling) divided by "
        "the plain step's operators. CPU ms: this rank's process time in the step (on gloo a "
        "wait sleeps, so it is the work and the Python, robust to other load; MPI's waits "
        "spin). Operators: what a `TorchDispatchMode` sees in one step on rank 0 "
        "(deterministic: the small operations each strategy adds).", "",
    ]  # fmt: skip
    for r in rows:
        ms, calls = r["ms"], r["calls"]
        ceiling = {"plain": ms["plain"], "data": ms["plain"],
                   "data, local BatchNorm": ms["plain"], "channel": ms["plain"],
                   "spatial": ms["spatial ceiling"], "spatial ceiling": ms["spatial ceiling"]}
        lines += [f"## {r['case']}", "",
                  f"{calls} operators in the plain step; other processes' load "
                  f"{r['other_load_cores']:.2f} cores.", "",
                  "| variant | ms / step | x plain | x its ceiling | added us per call "
                  "| CPU ms / step | operators / step |",
                  "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
        for name in VARIANTS:
            added = (ms[name] - ceiling[name]) * 1e3 / calls
            lines.append(f"| {name} | {ms[name]:.2f} | {ms[name] / ms['plain']:.2f} | "
                         f"{ms[name] / ceiling[name]:.2f} | {added:.1f} | "
                         f"{r['cpu_ms'][name]:.2f} | {r['operators'][name]} |")  # fmt: skip
        if r.get("compile_s"):
            lines += ["", "| compiled step (inductor) | ms / step | x plain | x eager | first "
                      "step, s (the compile) |", "|---|--:|--:|--:|--:|"]  # fmt: skip
            for name, first in r["compile_s"].items():
                t = ms[f"{name} compiled"]
                lines.append(f"| {name} | {t:.2f} | {t / ms['plain']:.2f} | "
                             f"{t / ms[name]:.2f} | {first:.0f} |")  # fmt: skip
        if "graphs" in r:
            lines += ["", "| compiled forward | graphs | breaks | first reasons |",
                      "|---|--:|--:|---|"]
            for name, g in r["graphs"].items():
                if "error" in g:
                    lines.append(f"| {name} | - | - | {g['error']} |")
                else:
                    why = "; ".join(g["reasons"][:3]).replace("|", "/")
                    lines.append(f"| {name} | {g['graphs']} | {g['breaks']} | {why} |")
        lines.append("")
    lines += ["## The guard's cost per operation", "",
              "A 1x1 convolution's output, then 200 pointwise operations on it (`relu(x) + x`),"
              " forward, no grad, 2 ranks, an 8x8 image: under spatial parallelism each is a "
              "block and goes through the guard's rule. Best of "
              f"{cfg.repeats * 4} alternating rounds.", "",
              "| | us per operation |", "|---|--:|",
              f"| plain | {guard['plain']:.1f} |",
              f"| spatial (the guard) | {guard['spatial']:.1f} |", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["mpi", "gloo"], default="mpi")
    p.add_argument("--quick", action="store_true", help="the op-bound case, 3 rounds")
    p.add_argument("--repeats", type=int)
    p.add_argument("--compile", action="store_true",
                   help="graph counts and compiled steps (gloo)")
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        mpi_worker(_job, *args.worker, timeout=WORKER_TIMEOUT_S)
        return
    cfg = Config(backend=args.backend, compile=args.compile)
    if args.quick:
        cfg.sizes, cfg.repeats, cfg.warmup = cfg.sizes[:1], 3, 1
    if args.repeats:
        cfg.repeats = args.repeats
    env = environment(command=command_line(), backend=cfg.backend)
    rows, guard = run(cfg)
    markdown = report(cfg, rows, guard, env)
    print(markdown)
    default = Path(f"benchmarks/results/overhead_{cfg.backend}.md")
    out = args.out or (Path(f"/tmp/overhead_quick_{cfg.backend}.md") if args.quick else default)
    save(out, markdown, env, cfg, rows, guard_us_per_op=guard)


if __name__ == "__main__":
    main()
