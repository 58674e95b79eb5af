"""Training-step time of parallelkit's DataParallel next to torch's DistributedDataParallel.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_parallel.py            # full run, ~7 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_parallel.py --quick    # smoke test, ~1 min

The model is a ResNet-18 written here in plain torch.nn (BasicBlock, [2, 2, 2, 2], CIFAR stem:
one 3x3 convolution and no max-pool; the same net on 64x64 images), fed a fixed batch of 32
random images per rank. A step is ``zero_grad`` + forward + cross-entropy + backward + SGD
(momentum) step. Every variant trains its own copy of the same initial weights with its own
optimizer on the same batch, all in the same processes:

    1 rank    dense       the model, unwrapped, on the global batch of the comparison (the
                          per-rank batch x ``--ranks`` images): the reference of the speedups
              bare        the model, unwrapped
              pk          DataParallel(model, LocalCommunicator())
              ddp         DistributedDataParallel(model, process_group=<gloo group of 1 rank>)
    2 ranks   bare        the model, unwrapped, on both ranks at once: no communication, but
                          the same contention for cores, caches and memory as the others; the
                          ceiling (every rank its share of the global batch at the same time)
              ddp         DistributedDataParallel(model, process_group=comm.group)  (25 MiB)
              pk          DataParallel(model, comm)                                 (25 MiB)
              pk cap=C    DataParallel(model, comm, bucket_cap_mb=C): the bucket sweep,
                          C in 0, 1, 5, 100 MiB, on the first image size only

Both wrappers run with their defaults: 25 MiB buckets (the first one 1 MiB), buffers
(BatchNorm statistics) broadcast before every forward, gradients copied into flat buckets and
all-reduced by gloo while backward goes on. After ``--warmup`` untimed steps of every variant
(the first backward rebuilds both wrappers' buckets in arrival order), the variants take turns:
each round times one block of ``--steps`` steps per variant, in forward order on even rounds and
reversed on odd ones, so drift and noise hit all variants alike. A block starts after a barrier
and its time is all-reduced with max; a variant's step time is the median over rounds of the
slowest rank's time per step. The JSON file next to the markdown holds every block.

Speedup = dense step on 1 rank / a variant's step on the ranks (the same global batch); the
ceiling speedup = dense / bare on the ranks: on a shared CPU node less than the rank count, as
the ranks share memory bandwidth and clocks, and the honest limit; efficiency = speedup /
ceiling speedup (= bare / variant).

Goals (measured, not tuned for): pk/ddp step time <= 1.00 at 2 ranks; pk on 1 rank within 3 %
of the bare model; efficiency >= 0.9 at 2 ranks. The parent launches the ranks
with ``parallelkit.testing.Ranks`` (gloo), one thread each, and saves the results under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from _common import (
    OtherLoad,
    alternating,
    command_line,
    environment,
    library_state,
    save,
    scaling,
    time_block_cpu,
    torch_sync,
)

if TYPE_CHECKING:
    from parallelkit.comm.torch_dist import TorchCommunicator

WORKER_TIMEOUT_S = 1800.0
NUM_CLASSES = 10
GOAL_PK_OVER_DDP = 1.00  # at 2 ranks
GOAL_PK_OVER_BARE = 1.03  # on 1 rank
GOAL_EFFICIENCY = 0.9  # speedup / ceiling speedup, at 2 ranks


@dataclass
class Config:
    """What every rank measures."""

    image_sizes: list[int]  # H = W of the inputs
    batch: int  # images per rank
    warmup: int  # untimed steps per variant
    steps: int  # steps per timed block
    repeats: list[int]  # per image size: rounds of timed blocks (one block per variant)
    ranks: int  # rank count of the data-parallel comparison
    sweep: list[float]  # bucket_cap_mb values for parallelkit, besides the default 25


@dataclass
class Variant:
    """One way of running the step: ``wrapper`` is "bare", "pk" or "ddp" (always 25 MiB)."""

    name: str
    wrapper: str
    bucket_cap_mb: float = 25.0
    global_batch: bool = False  # the whole batch of ``Config.ranks`` ranks, not one rank's


# ---------------------------------------------------------------------------- the model
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual (1x1 projection when shapes change)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool); 11.2 M parameters.

    x (N, 3, H, W) -> stages of 64, 128, 256, 512 channels at H, H/2, H/4, H/8 -> (N, classes).
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        blocks, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x))
        return self.head(y.mean(dim=(2, 3)))


# ---------------------------------------------------------------------------- variants (ranks)
def wrap(model: nn.Module, variant: Variant, comm: TorchCommunicator) -> nn.Module:
    """``model`` as the variant runs it; 1-rank parallelkit runs on a LocalCommunicator."""
    if variant.wrapper == "bare":
        return model
    if variant.wrapper == "pk":
        from parallelkit.comm.local import LocalCommunicator
        from parallelkit.parallel.data_parallel import DataParallel

        pk_comm = LocalCommunicator() if comm.size == 1 else comm
        return DataParallel(model, pk_comm, bucket_cap_mb=variant.bucket_cap_mb)
    assert variant.wrapper == "ddp", variant
    from torch.nn.parallel import DistributedDataParallel

    # DDP's defaults: an explicit bucket_cap_mb would also drop its 1 MiB first bucket.
    return DistributedDataParallel(model, process_group=comm.group)


def make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def bucket_mib(model: nn.Module) -> list[float] | None:
    """The sizes of a wrapper's buckets after its rebuild, in launch order (None: bare)."""
    if hasattr(model, "buckets"):  # parallelkit: parameter names per bucket
        numel = {n: p.numel() for n, p in model.module.named_parameters()}
        return [sum(numel[n] for n in b) * 4 / 2**20 for b in model.buckets]
    try:  # DDP: private API, as of torch 2.x
        return [
            b.buffer().numel() * 4 / 2**20 for b in model.reducer._get_zeros_like_grad_buckets()
        ]
    except (AttributeError, RuntimeError):
        return None


def rank_run(
    comm: TorchCommunicator, cfg: Config, image_size: int, repeats: int, variants: list[Variant]
) -> dict[str, Any]:
    """One (image size, rank count) measurement on this rank; times in seconds per step."""
    torch.manual_seed(0)
    base = ResNet18()
    gen = torch.Generator().manual_seed(1000 + comm.rank)  # every rank its own batch
    x = torch.randn(cfg.batch, 3, image_size, image_size, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (cfg.batch,), generator=gen)
    whole = cfg.batch * cfg.ranks  # the global batch, for the 1-rank dense reference
    x_all = torch.randn(whole, 3, image_size, image_size, generator=gen)
    y_all = torch.randint(0, NUM_CLASSES, (whole,), generator=gen)
    models = {v.name: wrap(copy.deepcopy(base), v, comm) for v in variants}
    steps = {
        v.name: make_step(models[v.name], *((x_all, y_all) if v.global_batch else (x, y)))
        for v in variants
    }
    sync = torch_sync(comm.group)
    for step in steps.values():
        for _ in range(cfg.warmup):
            step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in alternating(names, repeats):
        wall, cpu_s = time_block_cpu(steps[name], cfg.steps, sync)
        times[name].append(wall)
        cpu[name].append(cpu_s)
    return {
        "times": times,
        "cpu_times": cpu,
        "buckets_mib": {name: bucket_mib(m) for name, m in models.items()},
        "params": sum(p.numel() for p in base.parameters()),
    }


# ---------------------------------------------------------------------------- launch (parent)
def variants_for(n: int, cfg: Config, sweep: bool) -> list[Variant]:
    if n == 1:
        return [
            Variant("dense", "bare", global_batch=True),
            Variant("bare", "bare"),
            Variant("pk", "pk"),
            Variant("ddp", "ddp"),
        ]
    caps = [c for c in cfg.sweep if c != 25.0] if sweep else []
    return [
        Variant("bare", "bare"),
        Variant("ddp", "ddp"),
        Variant("pk", "pk"),
        *(Variant(f"pk cap={c:g}", "pk", c) for c in caps),
    ]


def run_all(cfg: Config) -> list[dict[str, Any]]:
    """Every (rank count, image size) run, in fresh pools of gloo ranks; rows for the report."""
    from parallelkit.testing import Ranks

    rows = []
    for n in (1, cfg.ranks):
        with Ranks(n, "gloo", comm_timeout=600) as ranks:
            for i, hw in enumerate(cfg.image_sizes):
                start = time.monotonic()
                variants = variants_for(n, cfg, sweep=i == 0)
                repeats = cfg.repeats[i]
                load = OtherLoad()
                result = ranks.run(rank_run, cfg, hw, repeats, variants, timeout=WORKER_TIMEOUT_S)
                row = {"ranks": n, "image_size": hw, "repeats": repeats, **result[0]}
                # Cores that processes outside this benchmark kept busy meanwhile.
                row["other_load_cores"] = load.cores()
                row["caps"] = {v.name: v.bucket_cap_mb for v in variants if v.wrapper != "bare"}
                row["seconds"] = time.monotonic() - start
                print(f"\n## {run_title(row)}, {row['seconds']:.0f} s\n")
                print(run_table(row), flush=True)
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------- reporting (parent)
def median(row: dict[str, Any], name: str) -> float:
    return statistics.median(row["times"][name])


def paired(row: dict[str, Any], name: str, ref: str) -> list[float]:
    """Per-round ratios name/ref (blocks of the same round ran back to back)."""
    return [a / b for a, b in zip(row["times"][name], row["times"][ref], strict=True)]


def buckets_text(sizes: list[float] | None) -> str:
    if sizes is None:
        return "-"
    if not sizes:  # a LocalCommunicator: nothing to reduce
        return "0"
    if len(sizes) > 4:
        return f"{len(sizes)}, largest {max(sizes):.1f}"
    return f"{len(sizes)}: " + " + ".join(f"{m:.1f}" for m in sizes)


def run_title(row: dict[str, Any]) -> str:
    hw, load = row["image_size"], row["other_load_cores"]
    return f"{row['ranks']} rank(s), {hw}x{hw} (other processes used {load:.2f} cores meanwhile)"


def run_table(row: dict[str, Any]) -> str:
    """One table per run; per-round ratios against bare on 1 rank, against ddp on more."""
    ref = "bare" if row["ranks"] == 1 else "ddp"
    lines = [
        "| variant | bucket cap (MiB) | buckets (MiB, launch order) | step (ms) | min..max (ms) "
        f"| /bare | /ddp | /{ref} per round, min..max | CPU (ms) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, ts in row["times"].items():
        cap = row["caps"].get(name)
        pr = paired(row, name, ref)
        lines.append(
            f"| {name} | {'-' if cap is None else f'{cap:g}'} "
            f"| {buckets_text(row['buckets_mib'].get(name))} | {median(row, name) * 1e3:.0f} "
            f"| {min(ts) * 1e3:.0f}..{max(ts) * 1e3:.0f} "
            f"| {median(row, name) / median(row, 'bare'):.3f} "
            f"| {median(row, name) / median(row, 'ddp'):.3f} | {min(pr):.3f}..{max(pr):.3f} "
            f"| {statistics.median(row['cpu_times'][name]) * 1e3:.0f} |"
        )
    return "\n".join(lines)


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals and the weak-scaling step-time ratios, one entry per image size and measure."""
    out = []
    for hw in dict.fromkeys(r["image_size"] for r in rows):
        one = next(r for r in rows if r["image_size"] == hw and r["ranks"] == 1)
        many = [r for r in rows if r["image_size"] == hw and r["ranks"] > 1]
        out.append(_ratio(hw, "pk / bare, 1 rank", one, "pk", one, "bare", GOAL_PK_OVER_BARE))
        out.append(_ratio(hw, "ddp / bare, 1 rank", one, "ddp", one, "bare", None))
        for m in many:
            n = m["ranks"]
            out.append(_ratio(hw, f"pk / ddp, {n} ranks", m, "pk", m, "ddp", GOAL_PK_OVER_DDP))
            out.append(_ratio(hw, f"pk / bare, {n} ranks", m, "pk", m, "bare", None))
            out.append(_ratio(hw, f"ddp / bare, {n} ranks", m, "ddp", m, "bare", None))
            label = f"bare {n} ranks / bare 1 rank"
            out.append(_ratio(hw, label, m, "bare", one, "bare", None))
    return out


def _ratio(hw, label, row_a, a, row_b, b, goal) -> dict[str, Any]:
    ratio = median(row_a, a) / median(row_b, b)
    return {
        "image_size": hw,
        "measure": label,
        "a_ms": median(row_a, a) * 1e3,
        "b_ms": median(row_b, b) * 1e3,
        "ratio": ratio,
        "goal": goal,
        "met": None if goal is None else ratio <= goal,
    }


def scaling_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per image size, rank count > 1 and wrapper: speedup over the 1-rank dense step on the
    global batch, the ceiling's (bare on the ranks) and the efficiency."""
    out = []
    for r in rows:
        one = next(o for o in rows if o["image_size"] == r["image_size"] and o["ranks"] == 1)
        if r["ranks"] == 1 or "dense" not in one["times"]:
            continue
        dense, ceiling = median(one, "dense") * 1e3, median(r, "bare") * 1e3
        for name in ("ddp", "pk"):
            ms = median(r, name) * 1e3
            got = scaling(dense, ceiling, ms)
            out.append({"image_size": r["image_size"], "ranks": r["ranks"], "variant": name,
                        "dense_ms": dense, "ceiling_ms": ceiling, "ms": ms, **got})  # fmt: skip
    return out


def scaling_table(scaled: list[dict[str, Any]]) -> str:
    lines = [
        "| image | ranks | dense 1 rank, global batch (ms) | ceiling = bare (ms) "
        "| ceiling speedup | variant | step (ms) | speedup | efficiency |",
        "|---|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for s in scaled:
        goal = "met" if s["efficiency"] >= GOAL_EFFICIENCY else "MISSED"
        lines.append(
            f"| {s['image_size']}x{s['image_size']} | {s['ranks']} | {s['dense_ms']:.0f} "
            f"| {s['ceiling_ms']:.0f} | {s['ceiling_speedup']:.2f} | {s['variant']} "
            f"| {s['ms']:.0f} | {s['speedup']:.2f} | {s['efficiency']:.2f} "
            f"(goal >= {GOAL_EFFICIENCY}: {goal}) |"
        )
    return "\n".join(lines)


def summary_table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| image | measure | numerator (ms) | denominator (ms) | ratio | goal |",
        "|---|---|--:|--:|--:|---|",
    ]
    for s in summary:
        goal = (
            "-" if s["goal"] is None else f"<= {s['goal']:.2f}: {'met' if s['met'] else 'MISSED'}"
        )
        lines.append(
            f"| {s['image_size']}x{s['image_size']} | {s['measure']} | {s['a_ms']:.0f} "
            f"| {s['b_ms']:.0f} | {s['ratio']:.3f} | {goal} |"
        )
    return "\n".join(lines)


def report(
    rows: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    env,
    cfg: Config,
    scaled: list[dict[str, Any]] = (),
) -> str:
    """The whole markdown document."""
    params = rows[0]["params"]
    pairs = zip(cfg.image_sizes, cfg.repeats, strict=True)
    rounds = ", ".join(f"{n} at {hw}x{hw}" for hw, n in pairs)
    over = ""
    if cfg.ranks > int(env["nproc"]):
        over = f"{cfg.ranks} ranks oversubscribe the {env['nproc']} cores: noisy numbers. "
    parts = [
        "# Data parallelism: parallelkit DataParallel next to torch DistributedDataParallel",
        "",
        f"Command: `{command_line()}`",
        "",
        f"- date: {env['date']}",
        f"- python {env['python']}, torch {env['torch']}, gloo; parallelkit {env['parallelkit']}",
        f"- CPU: {env['cpu']}, nproc {env['nproc']}",
        f"- model: ResNet-18, CIFAR stem, {params / 1e6:.2f} M parameters "
        f"({params * 4 / 2**20:.1f} MiB of float32 gradients); batch {cfg.batch} per rank; "
        "SGD with momentum",
        f"- {cfg.warmup} untimed steps per variant, then rounds of one timed block of "
        f"{cfg.steps} step(s) per variant, order alternating ({rounds}); step time = median "
        "over rounds of the slowest rank's time per step",
        "",
        "A step is zero_grad + forward + loss + backward + optimizer step. Each variant is its "
        "own copy of the same initial weights in the same processes, on the same batch. "
        "1-rank pk runs on a LocalCommunicator (DataParallel then registers no hooks); 1-rank "
        "ddp runs on a gloo group of one rank. On more ranks, 'bare' trains the unwrapped model "
        "on every rank at once: the step time the ranks would have without communication, on "
        "cores they share. 'per round' ratios divide blocks of the same round, which ran back "
        "to back: their spread shows the noise. CPU is the process time of the busiest rank per "
        "step, all its threads (gloo's too): what a rank consumed, not what it waited. "
        f"Every rank is one process with one compute thread; gloo adds its own threads. {over}",
        "",
        "## Summary",
        "",
        summary_table(summary),
        "",
        "## Scaling against the ceiling",
        "",
        f"dense = the bare model on 1 rank with the global batch ({cfg.ranks} x {cfg.batch} "
        f"images); ceiling = 'bare' on {cfg.ranks} ranks, every rank its share of that batch at "
        "the same time, no communication: what the ranks can reach on this machine, below the "
        "rank count where they share memory bandwidth and clocks. speedup = dense / variant; "
        "ceiling speedup = dense / ceiling; efficiency = speedup / ceiling speedup.",
        "",
        scaling_table(list(scaled)),
    ]
    for row in rows:
        parts += ["", f"## {run_title(row)}", "", run_table(row)]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32x32, sweep 0 only, 1+2 steps")
    p.add_argument("--image-sizes", type=int, nargs="+", help="default 32 64 (quick: 32)")
    p.add_argument("--batch", type=int, default=32, help="images per rank (default 32)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the comparison (default 2)")
    p.add_argument("--sweep", type=float, nargs="*", help="bucket_cap_mb values (0 1 5 100)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant (default 2, quick 1)")
    p.add_argument("--steps", type=int, default=1, help="steps per timed block (default 1)")
    p.add_argument(
        "--repeats",
        type=int,
        nargs="+",
        help="rounds of timed blocks, one for all image sizes or one per size (default 7 3)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/data_parallel.md"))
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    if args.ranks < 2:
        raise SystemExit("--ranks: the comparison needs at least 2 ranks (1 rank always runs)")
    quick = args.quick
    image_sizes = args.image_sizes or ([32] if quick else [32, 64])
    repeats = args.repeats or ([2] if quick else [7 if hw <= 32 else 3 for hw in image_sizes])
    if len(repeats) == 1:
        repeats = repeats * len(image_sizes)
    if len(repeats) != len(image_sizes):
        raise SystemExit("--repeats: give one count, or one per image size")
    return Config(
        image_sizes=image_sizes,
        batch=args.batch,
        warmup=args.warmup if args.warmup is not None else (1 if quick else 2),
        steps=args.steps,
        repeats=repeats,
        ranks=args.ranks,
        sweep=args.sweep if args.sweep is not None else ([0.0] if quick else [0, 1, 5, 100]),
    )


def main() -> None:
    args = parse_args()
    cfg = config(args)
    os.environ["OMP_NUM_THREADS"] = "1"
    # At the start: the code and the date of what is measured.
    env = environment(parallelkit=library_state())
    start = time.monotonic()
    rows = run_all(cfg)
    summary, scaled = summary_rows(rows), scaling_rows(rows)
    print("\n## Summary\n\n" + summary_table(summary))
    print("\n## Scaling against the ceiling\n\n" + scaling_table(scaled))
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    text = report(rows, summary, env, cfg, scaled)
    json_path = save(args.out, text, env, cfg, rows, summary=summary, scaling=scaled)
    print(f"\nwrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
