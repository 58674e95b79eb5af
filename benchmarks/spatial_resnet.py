"""Spatial parallelism on a whole network: ResNet-50, one image split by rows over CPU ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_resnet.py           # ~6 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_resnet.py --quick   # smoke, ~1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_resnet.py --backend mpi  # under mpiexec

Every variant is one training step without the optimizer: cross-entropy forward + backward of
``parallelkit.models.resnet50(num_classes=10)`` on a batch of ``--batch`` images of
``--size``^2 pixels, timed on gloo ranks (``parallelkit.testing.Ranks``) or, with
``--backend mpi``, on ranks that the script starts under mpiexec (the one next to this Python)
with ``pk.init("mpi")``; one compute thread each, so a rank stands for one device:

    1 rank   dense         the plain model: the reference step
             pk            pk.parallelize(model, comm, "spatial") on one rank (the guard and
                           the region step aside: one rank holds the whole image)
    2 ranks  pk            pk.parallelize(model, comm, "spatial"): the spatial guard, gradient
                           shares summed in DataParallel's bucketed all-reduces, the whole size
                           travelling with the blocks, stride-1 convolutions on the edge path
             pk, overlap   the same with SpatialParallelConv2d.overlap = True: each edge-path
                           convolution fetches its halo rows on a helper thread while it
                           convolves its block
             leaf layers   the swapped layers alone, as before the guard: pk.spatial.scatter,
                           the converted model with no region (every parameter's gradient
                           summed by its own blocking all-reduce, a size all-gather per layer)
             ceiling       the plain model, no parallelkit and no communication, on every rank
                           at once: on its torch.tensor_split block of rows plus CEILING_HALO
                           = 3 rows on each side that has a neighbour (the rows the 7x7
                           stride-2 stem reads beyond the block), so every later layer runs on
                           about its share of rows, the work pk does per layer (pk fetches
                           each layer's halo instead of recomputing it; the network's whole
                           receptive field, 400+ rows, would be most of the image)

Timing: ``--warmup`` steps per variant, then ``--repeats`` rounds in alternating order, one
step each, started after a barrier; a step's time is the slowest rank's; the median over rounds
is reported. Speedup = dense step / variant's step. The ceiling is the honest limit of the
2-rank speedup: on a shared CPU node the ranks share memory bandwidth and clocks, so even work
that needs no communication runs less than 2x faster. Ceiling speedup = dense step / ceiling
step; efficiency = speedup / ceiling speedup (goals over MPI: efficiency >= 0.9 and
speedup >= 1.7x).

The split of the 2-rank pk step: the communicator's methods are wrapped (on the instances) to
add up the time the calling thread spends inside them over ``--repeats`` extra steps: halo
exchange (``neighbor_exchange``), reductions (``all_reduce``/``all_gather``: SyncBatchNorm
statistics, the global pool, the scatter's backward; and the wait for DataParallel's bucketed
``all_reduce_async``), host metadata (``all_gather_ints``). The rest is compute and Python.
Time spent in a collective includes waiting for the other rank to arrive, so imbalance shows as
communication. Results: benchmarks/results/spatial_resnet.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from _common import (
    CATEGORIES,
    OtherLoad,
    alternating,
    ceiling_rows,
    comm_sync,
    command_line,
    environment,
    mpi_worker,
    run_mpi,
    save,
    scaling,
    timed_methods,
)

CEILING_HALO = 3  # rows: what ResNet-50's stem (7x7, stride 2, padding 3) reads past a block
GOAL_SPEEDUP, GOAL_EFFICIENCY = 1.7, 0.9  # 2 ranks
WORKER_TIMEOUT_S = 3000.0


@dataclass
class Config:
    size: int = 512
    batch: int = 2
    warmup: int = 2
    repeats: int = 5
    backend: str = "gloo"  # or "mpi": ranks under mpiexec
    plan: dict[int, list[str]] = field(
        default_factory=lambda: {
            1: ["dense", "pk"],
            2: ["pk", "pk, overlap", "leaf layers", "ceiling"],
        }
    )


def rank_job(comm: Any, cfg: Config, variants: list[str]) -> dict[str, Any]:
    """Time ``variants`` on this rank; with ``pk`` on several ranks, also split its time."""
    import parallelkit as pk
    from parallelkit.models import resnet50

    torch.manual_seed(0)
    base = resnet50(num_classes=10)
    x = torch.randn(cfg.batch, 3, cfg.size, cfg.size)
    labels = torch.randint(0, 10, (cfg.batch,))
    steps: dict[str, Callable[[], float]] = {}
    for name in variants:
        if name == "dense":
            model = copy.deepcopy(base)
            steps[name] = _step(model, lambda m=model: m(x), labels)
        elif name in ("pk", "pk, overlap"):
            model = pk.parallelize(copy.deepcopy(base), comm, "spatial")
            steps[name] = _step(model, lambda m=model: m(x), labels, overlap=name != "pk")
        elif name == "leaf layers":  # the converted model with no region around it
            model = pk.parallelize(copy.deepcopy(base), comm, "spatial").module.module
            steps[name] = _step(model, lambda m=model: m(pk.spatial.scatter(x, comm)), labels)
        elif name == "ceiling":  # the dense model on this rank's rows, no communication
            rows = ceiling_rows(cfg.size, comm.size, comm.rank, CEILING_HALO)
            model, x_share = copy.deepcopy(base), x[:, :, rows].contiguous()
            steps[name] = _step(model, lambda m=model, x_share=x_share: m(x_share), labels)
    sync = comm_sync(comm)
    for name in variants:
        for _ in range(cfg.warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name in alternating(variants, cfg.repeats):
        sync.barrier()
        times[name].append(sync.max(steps[name]()))
    result: dict[str, Any] = {"times": times}
    result["ms"] = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    if "pk" in variants and comm.size > 1:
        result["split_ms"] = _split(comm, steps["pk"], cfg.repeats, sync)
    return result


def _step(model, forward, labels, overlap: bool = False) -> Callable[[], float]:  # type: ignore[no-untyped-def]
    from parallelkit.nn import SpatialParallelConv2d

    params = list(model.parameters())

    def step() -> float:
        SpatialParallelConv2d.overlap = overlap
        for p in params:
            p.grad = None
        start = time.perf_counter()
        F.cross_entropy(forward(), labels).backward()
        elapsed = time.perf_counter() - start
        SpatialParallelConv2d.overlap = False
        return elapsed

    return step


def _split(comm: Any, step: Callable[[], float], repeats: int, sync: Any) -> dict[str, float]:
    """Median per step of the time spent inside each kind of collective, and the rest."""
    spent: dict[str, float] = defaultdict(float)
    rows: list[dict[str, float]] = []
    with timed_methods(comm, spent):
        for _ in range(repeats):
            spent.clear()
            sync.barrier()
            total = step()
            row = {kind: spent.get(kind, 0.0) for kind in sorted(set(CATEGORIES.values()))}
            row["compute and the rest"] = total - sum(row.values())
            row["step"] = total
            rows.append(row)
    return {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}


# ---------------------------------------------------------------------------- parent
def run(cfg: Config) -> dict[int, dict[str, Any]]:
    """Each rank count's variants in fresh ranks (gloo: spawned, mpi: under mpiexec)."""
    from parallelkit.testing import Ranks

    results = {}
    for n, variants in cfg.plan.items():
        load = OtherLoad()
        if cfg.backend == "mpi":
            script = str(Path(__file__).resolve())
            results[n] = run_mpi(script, n, (cfg, variants), WORKER_TIMEOUT_S)[0]
        else:
            with Ranks(n, "gloo", comm_timeout=900) as ranks:
                results[n] = ranks.run(rank_job, cfg, variants, timeout=WORKER_TIMEOUT_S)[0]
        results[n]["other_load_cores"] = load.cores()
    add_scaling(results)
    return results


def add_scaling(results: dict[int, dict[str, Any]]) -> None:
    """Each multi-rank result's ``scaling``: speedup, ceiling speedup and efficiency per
    variant (the ceiling's own efficiency is 1), against the 1-rank dense step."""
    dense = results[1]["ms"]["dense"]
    for n, res in results.items():
        if n > 1 and "ceiling" in res["ms"]:
            res["scaling"] = {
                name: scaling(dense, res["ms"]["ceiling"], ms) for name, ms in res["ms"].items()
            }


def report(cfg: Config, results: dict[int, dict[str, Any]], env: dict[str, str]) -> str:
    dense = results[1]["ms"]["dense"]
    lines = [
        f"# Spatial ResNet-50, {cfg.size}x{cfg.size}, batch {cfg.batch}",
        "",
        f"Command: `{env['command']}`",
        "",
        *(f"- {k}: {v}" for k, v in env.items() if k != "command"),
        f"- {cfg.warmup} warm-up steps, then {cfg.repeats} rounds of one step per variant in "
        "alternating order; a step = the slowest rank's forward + backward; median over rounds",
        "- other processes' load during each rank count's run (cores, from /proc/stat): "
        + ", ".join(f"{n} rank(s) {r['other_load_cores']:.2f}" for n, r in results.items()),
        "",
        "Ceiling: every rank runs the plain model on its own rows (its tensor_split block + "
        f"{CEILING_HALO} halo rows per interior side), no communication, at the same time as "
        "the others: the speedup the ranks could reach on this machine. efficiency = speedup "
        "vs dense / ceiling's speedup.",
        "",
        "| ranks | variant | step (ms) | speedup vs dense | efficiency (vs ceiling) "
        "| each round (ms) |",
        "|--:|---|--:|--:|--:|---|",
    ]
    for n, res in results.items():
        for name, ms in res["ms"].items():
            rounds = ", ".join(f"{t * 1e3:.0f}" for t in res["times"][name])
            eff = res.get("scaling", {}).get(name)
            eff_text = f"{eff['efficiency']:.2f}" if eff else "-"
            lines.append(f"| {n} | {name} | {ms:.0f} | {dense / ms:.2f} | {eff_text} | {rounds} |")
    split = results[2].get("split_ms")
    if split:
        lines += [
            "",
            "Split of the 2-rank pk step (median over rounds, rank 0's time inside each kind "
            "of collective; waiting for the other rank counts there):",
            "",
            "| part | ms | share |",
            "|---|--:|--:|",
            *(
                f"| {k} | {v:.0f} | {v / split['step']:.0%} |"
                for k, v in split.items()
                if k != "step"
            ),
            f"| step | {split['step']:.0f} | 100% |",
        ]
    pk1 = results[1]["ms"]["pk"]
    lines += ["", "## Summary", "", f"- 1 rank: pk.parallelize / dense = {pk1 / dense:.3f} "
              "(goal <= 1.03)"]  # fmt: skip
    two = results[2].get("scaling")
    if two:
        pk, ceiling = two["pk"], two["ceiling"]["speedup"]
        lines += [
            f"- 2 ranks ({cfg.backend}): pk speedup {pk['speedup']:.2f}x (goal >= "
            f"{GOAL_SPEEDUP}x: {met(pk['speedup'] >= GOAL_SPEEDUP)}), ceiling {ceiling:.2f}x, "
            f"efficiency {pk['efficiency']:.2f} (goal >= {GOAL_EFFICIENCY}: "
            f"{met(pk['efficiency'] >= GOAL_EFFICIENCY)})",
            f"- with overlap: speedup {two['pk, overlap']['speedup']:.2f}x, efficiency "
            f"{two['pk, overlap']['efficiency']:.2f}; leaf layers without the guard: "
            f"{two['leaf layers']['speedup']:.2f}x, {two['leaf layers']['efficiency']:.2f}",
        ]
    return "\n".join(lines) + "\n"


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="128^2, batch 1, 2 rounds")
    p.add_argument("--size", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--backend",
        choices=["gloo", "mpi"],
        default="gloo",
        help="gloo: spawned ranks; mpi: ranks under mpiexec, pk.init('mpi')",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spatial_resnet.md"))
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # one rank under mpiexec (run_mpi)
        mpi_worker(rank_job, *args.worker, timeout=WORKER_TIMEOUT_S)
        return
    cfg = Config(size=128, batch=1, warmup=1, repeats=2) if args.quick else Config()
    for key in ("size", "batch", "repeats", "backend"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    env = environment(command=command_line(), backend=cfg.backend)
    results = run(cfg)
    markdown = report(cfg, results, env)
    print(markdown)
    out = args.out if not args.quick else Path(f"/tmp/spatial_resnet_quick_{cfg.backend}.md")
    save(out, markdown, env, cfg, [{"ranks": n, **r} for n, r in results.items()])


if __name__ == "__main__":
    main()
