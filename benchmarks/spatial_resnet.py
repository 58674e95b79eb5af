"""Spatial parallelism on a whole network: ResNet-50, one image split by rows over CPU ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_resnet.py           # ~6 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_resnet.py --quick   # smoke, ~1 min

Every variant is one training step without the optimizer: cross-entropy forward + backward of
``parallelkit.models.resnet50(num_classes=10)`` on a batch of ``--batch`` images of
``--size``^2 pixels, timed on gloo ranks (``parallelkit.testing.Ranks``, one compute thread
each, so a rank stands for one device):

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

Timing: ``--warmup`` steps per variant, then ``--repeats`` rounds in alternating order, one
step each, started after a barrier; a step's time is the slowest rank's; the median over rounds
is reported. Speedup = dense step / variant's step.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from _common import (
    CATEGORIES,
    OtherLoad,
    alternating,
    command_line,
    environment,
    save,
    timed_methods,
    torch_sync,
)


@dataclass
class Config:
    size: int = 512
    batch: int = 2
    warmup: int = 2
    repeats: int = 5


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
    sync = torch_sync(comm.group)
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
    from parallelkit.testing import Ranks

    plan = {1: ["dense", "pk"], 2: ["pk", "pk, overlap", "leaf layers"]}
    results = {}
    for n, variants in plan.items():
        load = OtherLoad()
        with Ranks(n, "gloo", comm_timeout=900) as ranks:
            results[n] = ranks.run(rank_job, cfg, variants, timeout=3000)[0]
        results[n]["other_load_cores"] = load.cores()
    return results


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
        "| ranks | variant | step (ms) | speedup vs dense | each round (ms) |",
        "|--:|---|--:|--:|---|",
    ]
    for n, res in results.items():
        for name, ms in res["ms"].items():
            rounds = ", ".join(f"{t * 1e3:.0f}" for t in res["times"][name])
            lines.append(f"| {n} | {name} | {ms:.0f} | {dense / ms:.2f} | {rounds} |")
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
    lines += [
        "",
        "## Summary",
        "",
        f"- 1 rank: pk.parallelize / dense = {pk1 / dense:.3f} (goal <= 1.03)",
        f"- 2 ranks: pk speedup {dense / results[2]['ms']['pk']:.2f}x (goal >= 1.4x); "
        f"with overlap {dense / results[2]['ms']['pk, overlap']:.2f}x; "
        f"leaf layers without the guard {dense / results[2]['ms']['leaf layers']:.2f}x",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="128^2, batch 1, 2 rounds")
    p.add_argument("--size", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spatial_resnet.md"))
    args = p.parse_args(argv)
    cfg = Config(size=128, batch=1, warmup=1, repeats=2) if args.quick else Config()
    for key in ("size", "batch", "repeats"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    env = environment(command=command_line())
    results = run(cfg)
    markdown = report(cfg, results, env)
    print(markdown)
    out = args.out if not args.quick else Path("/tmp/spatial_resnet_quick.md")
    save(out, markdown, env, cfg, [{"ranks": n, **r} for n, r in results.items()])


if __name__ == "__main__":
    main()
