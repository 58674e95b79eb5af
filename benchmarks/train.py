"""End-to-end training throughput: ``parallelkit train`` per model, strategy and rank count.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train.py           # full run, ~15 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train.py --quick   # smoke test, ~1 min

Every measurement is one run of the real command, ``parallelkit train`` (the console script
next to this Python), as a subprocess with its own fresh run directory, on synthetic data
(``data.name=synthetic``: random images made per index, learnable labels):

    model               overrides                                    global batch
    ResNet-18 32x32     model.name=resnet18 model.stem=cifar         16
                        (3x3 stem, no pooling; 10 classes)
    ResNet-18 224x224   model.name=resnet18 model.stem=imagenet      8
                        (7x7 stride-2 stem + max pool)
    DCGAN 64x64         train.task=gan model.name=dcgan (ngf = ndf   16
                        = 64); a step = a discriminator update and a
                        generator update

The global batch (``train.batch_size``) is fixed per model across strategies and rank counts,
so a speedup is the same work done faster. Rank counts 1, 2 and 4; on 1 rank the command runs
the model as is, in its own process (no launcher): the reference, listed as strategy "dense".
On N > 1 ranks ``parallel.ranks=N`` starts the ranks through torchrun (gloo) with
``parallel.strategy`` = data (the batch split), spatial (every image split by rows) or channel
(convolution channels split); on 4 ranks also hybrid = ``parallel.strategy=hybrid
parallel.rows=2`` (2 data-parallel groups of 2 spatial ranks).

Method. ``train.log_every=1``: every step ends with the loop's loss reduction over the data
ranks and one "train" record in run_dir/metrics.jsonl, whose ``img_s`` is the global batch over
the step's wall time on rank 0 (from the end of the previous record to the end of this step's
reduction: data loading, forward, backward, optimizer, reduction; under spatial and channel
parallelism the reduction is over one rank, but the collectives inside every step keep the
ranks of a group within a step of each other, so the median is the group's pace). The first
``--warmup`` steps (default 3: allocator growth, gloo connections, DataParallel's first
buckets, optimizer state) are discarded; images/s = median of ``img_s`` over the remaining
``--steps - --warmup`` steps (default 5). Start-up, the end-of-run evaluation, checkpoint and
model export fall outside every timed step. As a check, the mean rate from the records'
timestamps over the same steps is saved too, with the median's deviation from it.
``log_every=1`` adds one all-reduce of a few floats and one host synchronisation per step to
the default ``log_every=10``: negligible next to steps of a second. Speedup = images/s / the
1-rank images/s of the same model. Peak memory per rank = the summary record's
``peak_memory_mib``: the largest resident set size (ru_maxrss) over the ranks, so it includes
the interpreter and torch's libraries (the header gives a bare ``import parallelkit`` for
scale). One run per configuration: 2 shared cores make every number noisy; the per-step
min..max column shows the spread within a run, and the last column the cores that other
processes kept busy meanwhile (from /proc/stat). 4 ranks oversubscribe 2 cores: those rows
measure time-sharing, not scaling.

``--quick`` (ResNet-18 32x32, batch 4, 1 and 2 ranks, 3 steps of which 1 warm-up) writes to
the temporary directory unless ``--out`` says otherwise, so it never replaces the saved
results. The full run saves benchmarks/results/train.md and train.json (every step's rate,
each command and the load other processes put on the machine during each run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import OtherLoad, command_line, environment, library_state, save


@dataclass(frozen=True)
class Model:
    """One network and image size, with the overrides that select it."""

    name: str  # as shown in the table
    image: int  # H = W
    note: str  # stem or task, for the table
    batch: int  # global batch of the full run
    overrides: tuple[str, ...]


MODELS = {
    "resnet18-32": Model(
        "ResNet-18", 32, "cifar stem", 16, ("model.name=resnet18", "model.stem=cifar")
    ),
    "resnet18-224": Model(
        "ResNet-18", 224, "imagenet stem", 8, ("model.name=resnet18", "model.stem=imagenet")
    ),
    "dcgan-64": Model("DCGAN", 64, "gan task", 16, ("train.task=gan", "model.name=dcgan")),
}
STRATEGIES = ["data", "spatial", "channel"]
HYBRID_RANKS = 4  # hybrid = 2 data x 2 rows
QUICK_MODELS, QUICK_BATCH = ["resnet18-32"], 4
RUN_TIMEOUT_S = 900.0
GRID_LINE = re.compile(r"grid \(data x (?:depth x )?rows x cols x channel\)\s*\|\s*([\dx ]+?)\s*\|")


@dataclass
class Config:
    """What the benchmark runs."""

    models: list[str]  # keys of MODELS
    batch: dict[str, int]  # global batch per model
    ranks: list[int]
    strategies: list[str]
    hybrid: bool  # also parallel.strategy=hybrid parallel.rows=2 on HYBRID_RANKS ranks
    steps: int  # train.max_steps
    warmup: int  # steps discarded
    runs: list[tuple[str, str, int]] = field(default_factory=list)  # (model, strategy, ranks)


# ---------------------------------------------------------------------------- one run
def train_command(m: Model, batch: int, strategy: str, n: int, cfg: Config, run_dir: str):
    """The ``parallelkit train`` command line of one configuration."""
    script = Path(sys.executable).with_name("parallelkit")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "parallelkit.cli"]
    parallel = [f"parallel.ranks={n}", f"parallel.strategy={'data' if n == 1 else strategy}"]
    if strategy == "hybrid":
        parallel.append("parallel.rows=2")
    return [
        *base,
        "train",
        *m.overrides,
        "data.name=synthetic",
        f"data.image_size={m.image}",
        f"data.train_samples={batch * cfg.steps}",  # one epoch of exactly train.max_steps
        f"data.test_samples={batch}",  # the end-of-run evaluation: one batch
        f"train.batch_size={batch}",
        "train.epochs=1",
        f"train.max_steps={cfg.steps}",
        "train.log_every=1",
        "train.progress=false",
        "train.tensorboard=false",
        *parallel,
        f"train.run_dir={run_dir}",
    ]


def run_process(command: list[str]) -> tuple[int, str, str]:
    """Run ``command`` in its own process group (torchrun and its ranks are killed together on
    a timeout); exit status, stdout, stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {RUN_TIMEOUT_S:.0f} s)"
    return proc.returncode, out, err


def run_one(key: str, strategy: str, n: int, cfg: Config) -> dict[str, Any]:
    """One ``parallelkit train`` run; its rates, memory and wall time."""
    m, batch = MODELS[key], cfg.batch[key]
    with tempfile.TemporaryDirectory(prefix="pk-bench-train-") as tmp:
        run_dir = str(Path(tmp, "run"))
        command = train_command(m, batch, strategy, n, cfg, run_dir)
        load, start = OtherLoad(), time.monotonic()
        status, out, err = run_process(command)
        wall = time.monotonic() - start
        metrics = Path(run_dir, "metrics.jsonl")
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [json.loads(ln) for ln in lines]
    shown = [c.replace(run_dir, "RUN_DIR") for c in command]
    row: dict[str, Any] = {
        "model": key, "name": m.name, "image": m.image, "note": m.note, "strategy": strategy,
        "ranks": n, "batch": batch, "command": shlex.join(shown), "status": status,
        "wall_s": wall, "other_load_cores": load.cores(),
    }  # fmt: skip
    grid = GRID_LINE.search(out)
    row["grid"] = grid.group(1) if grid else None  # data x (depth x) rows x cols x channel
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    summary = next((r for r in records if r["kind"] == "summary"), None)
    row["img_s_steps"] = [r["img_s"] for r in train]
    timed = [r for r in train if r["step"] > cfg.warmup]
    if status != 0 or summary is None or not timed:
        row["ok"] = False
        row["error"] = "\n".join((err or out).strip().splitlines()[-15:])
        return row
    rates = [r["img_s"] for r in timed]
    before = next((r for r in train if r["step"] == cfg.warmup), None)
    row.update(
        ok=True,
        img_s=statistics.median(rates),
        img_s_min=min(rates),
        img_s_max=max(rates),
        timed_steps=len(rates),
        peak_memory_mib=summary["peak_memory_mib"],
        train_seconds=summary["seconds"],
    )
    if before is not None:  # the mean over the same steps, from the records' timestamps
        span = timed[-1]["time"] - before["time"]
        row["img_s_timestamps"] = len(timed) * batch / span if span > 0 else None
    return row


def bare_rss_mib() -> float:
    """Peak resident set size of a process that only imports parallelkit (and torch)."""
    code = "import resource, parallelkit; print(resource.getrusage(0).ru_maxrss / 1024)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


# ---------------------------------------------------------------------------- all runs
def plan(cfg: Config) -> list[tuple[str, str, int]]:
    """(model, strategy, ranks) of every run, model by model, rank counts rising."""
    runs = []
    for key in cfg.models:
        for n in cfg.ranks:
            names = ["dense"] if n == 1 else list(cfg.strategies)
            if n == HYBRID_RANKS and cfg.hybrid:
                names.append("hybrid")
            runs += [(key, s, n) for s in names]
    return runs


def run_all(cfg: Config, nproc: int) -> list[dict[str, Any]]:
    rows = []
    for i, (key, strategy, n) in enumerate(cfg.runs, 1):
        row = run_one(key, strategy, n, cfg)
        over = " (oversubscribed)" if n > nproc else ""
        if row["ok"]:
            what = (
                f"{row['img_s']:7.2f} img/s (steps {row['img_s_min']:.2f}.."
                f"{row['img_s_max']:.2f}), peak {row['peak_memory_mib']:.0f} MiB/rank"
            )
        else:
            what = f"FAILED (exit {row['status']}): {row['error'].splitlines()[-1:]}"
        print(
            f"[{i}/{len(cfg.runs)}] {key:12s} {strategy:7s} {n} rank(s){over}: {what}  "
            f"({row['wall_s']:.0f} s, other load {row['other_load_cores']:.2f} cores)",
            flush=True,
        )
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- reporting
def reference(rows: list[dict], key: str) -> dict | None:
    return next((r for r in rows if r["model"] == key and r["ranks"] == 1 and r["ok"]), None)


def strategy_label(row: dict[str, Any]) -> str:
    if row["strategy"] != "hybrid" or not row.get("grid"):
        return row["strategy"]
    data, rows, _, _ = row["grid"].split(" x ")
    return f"hybrid ({data} data x {rows} rows)"


def table(rows: list[dict], nproc: int) -> str:
    lines = [
        "| model | image | strategy | ranks | global batch | images/s (median) "
        "| speedup vs 1 rank | peak memory per rank (MiB) | per-step images/s (min..max) "
        "| other load (cores) |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        ref = reference(rows, row["model"])
        ranks = f"{row['ranks']}{' (oversubscribed)' if row['ranks'] > nproc else ''}"
        head = (
            f"| {row['name']} | {row['image']}x{row['image']} ({row['note']}) "
            f"| {strategy_label(row)} | {ranks} | {row['batch']} "
        )
        load = f"| {row['other_load_cores']:.2f} |"
        if not row["ok"]:
            lines.append(head + f"| failed (exit {row['status']}) | - | - | - {load}")
            continue
        speedup = f"{row['img_s'] / ref['img_s']:.2f}" if ref else "-"
        lines.append(
            head + f"| {row['img_s']:.2f} | {speedup} | {row['peak_memory_mib']:.0f} "
            f"| {row['img_s_min']:.2f}..{row['img_s_max']:.2f} {load}"
        )
    return "\n".join(lines)


def headlines(rows: list[dict], cfg: Config) -> list[str]:
    """Per model and rank count, the fastest strategy; the median-vs-mean check; failures."""
    out = []
    for key in cfg.models:
        ref = reference(rows, key)
        for n in sorted({r["ranks"] for r in rows if r["model"] == key and r["ranks"] > 1}):
            done = [r for r in rows if r["model"] == key and r["ranks"] == n and r["ok"]]
            if not done or ref is None:
                continue
            best = max(done, key=lambda r: r["img_s"])
            others = ", ".join(
                f"{strategy_label(r)} {r['img_s'] / ref['img_s']:.2f}x" for r in done
            )
            m = MODELS[key]
            out.append(
                f"- {m.name} {m.image}x{m.image}, {n} ranks: fastest {strategy_label(best)} "
                f"({best['img_s']:.2f} images/s); speedups {others}"
            )
    gaps = [
        abs(r["img_s"] / r["img_s_timestamps"] - 1)
        for r in rows
        if r["ok"] and r.get("img_s_timestamps")
    ]
    if gaps:
        out.append(
            f"- median of the timed steps vs their mean from the records' timestamps: at most "
            f"{max(gaps):.1%} apart (median {statistics.median(gaps):.1%})"
        )
    failed = [r for r in rows if not r["ok"]]
    out.append(f"- failed runs: {len(failed)}" + (" (see Failures)" if failed else ""))
    return out


def report(rows: list[dict], env: dict[str, str], cfg: Config, seconds: float) -> str:
    """The whole markdown document."""
    nproc = int(env["nproc"])
    oversub = sorted({n for n in cfg.ranks if n > nproc})
    over = (
        f"{' and '.join(map(str, oversub))} ranks oversubscribe the {nproc} cores (more "
        "compute threads than cores, plus gloo's threads): those rows measure time-sharing, "
        "not scaling. "
        if oversub
        else ""
    )
    load = max((r["other_load_cores"] for r in rows), default=0.0)
    batches = ", ".join(
        f"{MODELS[k].name} {MODELS[k].image}x{MODELS[k].image}: {cfg.batch[k]}" for k in cfg.models
    )
    parts = [
        "# End-to-end training: images/s of `parallelkit train` per strategy and rank count",
        "",
        f"Command: `{command_line()}` ({seconds:.0f} s)",
        "",
        f"- date: {env['date']}",
        f"- python {env['python']}, torch {env['torch']}, parallelkit {env['parallelkit']}; "
        "ranks: torchrun + gloo, one compute thread each (OMP_NUM_THREADS=1)",
        f"- CPU: {env['cpu']}, nproc {env['nproc']}; a bare `import parallelkit` process "
        f"peaks at {env['bare_rss_mib']} MiB resident",
        f"- data.name=synthetic; global batch fixed per model across strategies and rank "
        f"counts ({batches}); {cfg.steps} steps per run (train.max_steps), train.log_every=1",
        f"- images/s = median over steps {cfg.warmup + 1}..{cfg.steps} of the per-step "
        f"`img_s` records (global batch / the step's wall time on rank 0); steps 1..{cfg.warmup} "
        "are warm-up, discarded. Speedup = images/s / the same model's 1-rank images/s. Peak "
        "memory per rank = the summary record's `peak_memory_mib` (max over ranks of "
        "ru_maxrss, the whole process).",
        f"- {over}Processes outside this benchmark used at most {load:.2f} cores on average "
        "during any one run (from /proc/stat; the last column gives each run's). One run per "
        "configuration.",
        "",
        "Strategies: dense = 1 rank, no launcher, the model as is (the reference); data = the "
        "batch split over the ranks; spatial = every image split by rows; channel = "
        "convolution channels split; hybrid = `parallel.strategy=hybrid parallel.rows=2`. Each "
        "run is `parallelkit train` with the overrides in train.json (`command` of each row).",
        "",
        "## Summary",
        "",
        *headlines(rows, cfg),
        "",
        "## Results",
        "",
        table(rows, nproc),
    ]
    failed = [r for r in rows if not r["ok"]]
    if failed:
        parts += ["", "## Failures", ""]
        for r in failed:
            parts += [
                f"`{r['command']}` (exit {r['status']}):",
                "",
                "```",
                r["error"],
                "```",
                "",
            ]
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="ResNet-18 32x32 on 1, 2 ranks (~1 min)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all")
    p.add_argument("--ranks", type=int, nargs="+", help="default 1 2 4 (quick: 1 2)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, help="default: all three")
    p.add_argument("--no-hybrid", action="store_true", help="skip the 4-rank hybrid runs")
    p.add_argument("--batch", type=int, help="one global batch for every model")
    p.add_argument("--steps", type=int, help="steps per run (default 8, quick 3)")
    p.add_argument("--warmup", type=int, help="steps discarded (default 3, quick 1)")
    p.add_argument("--out", type=Path, help="default benchmarks/results/train.md (quick: tmp)")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    quick = args.quick
    models = args.models or (QUICK_MODELS if quick else list(MODELS))
    batch = {k: args.batch or (QUICK_BATCH if quick else MODELS[k].batch) for k in models}
    ranks = sorted(set(args.ranks or ([1, 2] if quick else [1, 2, 4])))
    steps = args.steps or (3 if quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    if not 0 <= warmup < steps:
        raise SystemExit(f"--warmup {warmup} must leave timed steps out of --steps {steps}")
    if bad := {k: b for k, b in batch.items() if any(b % n for n in ranks)}:
        raise SystemExit(f"global batch must split over every rank count {ranks}: {bad}")
    cfg = Config(
        models=models,
        batch=batch,
        ranks=ranks,
        strategies=args.strategies or STRATEGIES,
        hybrid=not (quick or args.no_hybrid),
        steps=steps,
        warmup=warmup,
    )
    cfg.runs = plan(cfg)
    return cfg


def main() -> None:
    args = parse_args()
    cfg = config(args)
    os.environ["OMP_NUM_THREADS"] = "1"
    out = args.out or (
        Path(tempfile.gettempdir(), "parallelkit-benchmarks", "train.md")
        if args.quick
        else Path("benchmarks/results/train.md")
    )
    env = environment(parallelkit=library_state(), bare_rss_mib=f"{bare_rss_mib():.0f}")
    print(f"{len(cfg.runs)} runs of parallelkit train, {cfg.steps} steps each", flush=True)
    start = time.monotonic()
    rows = run_all(cfg, int(env["nproc"]))
    seconds = time.monotonic() - start
    text = report(rows, env, cfg, seconds)
    print("\n" + text)
    json_path = save(out, text, env, cfg, rows, seconds=seconds)
    print(f"wrote {out} and {json_path}")


if __name__ == "__main__":
    main()
