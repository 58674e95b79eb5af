"""PNG plots of the benchmark records under benchmarks/results/, drawn next to their JSON.

    .venv/bin/python benchmarks/plots.py                      # every record there
    .venv/bin/python benchmarks/plots.py benchmarks/results/model_parallel.json

Every benchmark script draws its plots when it saves (``_common.save`` calls ``plot``); this
command redraws them all from the saved records without measuring anything again. One
function per record kind (the JSON file's stem); a record without a plotter is skipped. What
each plot shows, so that where each strategy wins is visible at a glance:

    model_parallel  speedup of the spatial convolution vs image size and of the channel-
                    parallel convolution vs width, one line per rank count; the spatial step
                    split into convolution and halo exchange
    train           images per second per strategy and rank count, and peak memory per rank
    data_parallel   step time: bare model, parallelkit DataParallel and DDP
    sync_batchnorm  SyncBatchNorm time / local BatchNorm time per shape and rank count
    collectives     bus bandwidth vs message size, parallelkit and the raw backend
    peers           step times side by side, and the float64 error of each framework
    spatial_volume  the 3-D U-Net's and the Conv3d stack's step, dense on 1 rank against 2
                    ranks split over depth (the ratio over each pair of bars), and the 2-rank
                    step split into halo exchange, reductions and compute

matplotlib (the ``bench`` extra) draws with the Agg backend: no display is needed.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
Figure = Any
ERROR_FLOOR = 1e-17  # exact float64 results are drawn at this error on a log axis


def save_fig(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- model_parallel
def model_parallel(record: dict, out: Path) -> list[Path]:
    rows = record["rows"]
    return [
        mp_speedup(rows, out.with_name("model_parallel_speedup.png")),
        mp_split(rows, out.with_name("model_parallel_time_split.png")),
    ]


def mp_speedup(rows: list[dict], path: Path) -> Path:
    """Dense 1-rank time / parallel time, per size, one line per rank count."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, part, variant, xlabel in (
        (axes[0], "spatial", "pk", "image size H = W"),
        (axes[1], "channel", "pk out", "channels C_in = C_out"),
    ):
        dense = {r["size"]: r["ms"]["dense"] for r in rows if r["part"] == part and r["ranks"] == 1}
        by_ranks = defaultdict(list)
        for r in rows:
            if r["part"] == part and r["ranks"] > 1 and variant in r["ms"] and r["size"] in dense:
                by_ranks[r["ranks"]].append((r["size"], dense[r["size"]] / r["ms"][variant]))
        for n, points in sorted(by_ranks.items()):
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, "o-", label=f"{n} ranks")
            ax.axhline(n, color="grey", lw=0.5, ls=":")
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel, ylabel="speedup over dense, 1 rank", title=f"{part} convolution")
        ax.legend()
    return save_fig(fig, path)


def mp_split(rows: list[dict], path: Path) -> Path:
    """The spatial step per rank count and size: convolution and halo exchange, stacked."""
    bars = [r for r in rows if r["part"] == "spatial" and "exchange" in r["ms"]]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['size']}\n{r['ranks']}r" for r in bars]
    conv = [r["ms"]["conv"] for r in bars]
    exchange = [r["ms"]["exchange"] for r in bars]
    rest = [max(0.0, r["ms"]["pk"] - c - e) for r, c, e in zip(bars, conv, exchange, strict=True)]
    x = range(len(bars))
    ax.bar(x, conv, label="convolution")
    ax.bar(x, exchange, bottom=conv, label="halo exchange")
    ax.bar(x, rest, bottom=[c + e for c, e in zip(conv, exchange, strict=True)], label="rest")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set(
        ylabel="ms per forward + backward",
        title="spatial convolution: where the time goes (image size, ranks)",
    )
    ax.legend()
    return save_fig(fig, path)


# ---------------------------------------------------------------------------- train
def train(record: dict, out: Path) -> list[Path]:
    """Images per second and peak memory per rank, per model, strategy and rank count."""
    rows = [r for r in record["rows"] if r.get("ok")]
    models = list(dict.fromkeys(r["model"] for r in rows))
    paths = []
    for key, ylabel, name in (
        ("img_s", "images / s", "throughput"),
        ("peak_memory_mib", "peak memory per rank (MiB)", "memory"),
    ):
        fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models, strict=True):
            mine = [r for r in rows if r["model"] == model and r.get(key) is not None]
            labels = [f"{r['strategy']}\n{r['ranks']}r" for r in mine]
            ax.bar(
                range(len(mine)),
                [r[key] for r in mine],
                color=[strategy_color(r["strategy"]) for r in mine],
            )
            ax.set_xticks(range(len(mine)), labels, fontsize=7)
            ax.set(title=model, ylabel=ylabel)
        paths.append(save_fig(fig, out.with_name(f"train_{name}.png")))
    return paths


STRATEGY_COLORS = {"dense": "grey", "data": "C0", "spatial": "C1", "channel": "C2", "hybrid": "C3"}


def strategy_color(strategy: str) -> str:
    return STRATEGY_COLORS.get(strategy, "C4")


# ---------------------------------------------------------------------------- data_parallel
def data_parallel(record: dict, out: Path) -> list[Path]:
    """Median step time of bare, pk and ddp per (ranks, image size)."""
    rows = record["rows"]
    variants = ["bare", "pk", "ddp"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ms = [statistics.median(r["times"][v]) * 1e3 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], ms, width, label=v)
    ax.set_xticks(
        [j + width for j in range(len(rows))],
        [f"{r['ranks']} rank(s), {r['image_size']}px" for r in rows],
    )
    ax.set(ylabel="ms per training step", title="ResNet-18 step: DataParallel vs DDP")
    ax.legend()
    return [save_fig(fig, out.with_name("data_parallel.png"))]


# ---------------------------------------------------------------------------- sync_batchnorm
def sync_batchnorm(record: dict, out: Path) -> list[Path]:
    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        ax.plot(
            [str(tuple(r["shape"])) for r in mine],
            [r["sync_s"] / r["local_s"] for r in mine],
            "o-",
            label=f"{n} rank(s)",
        )
    ax.axhline(1, color="black", lw=0.8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set(ylabel="SyncBatchNorm / local BatchNorm2d", title="SyncBatchNorm overhead per shape")
    ax.legend()
    return [save_fig(fig, out.with_name("sync_batchnorm.png"))]


# ---------------------------------------------------------------------------- collectives
def collectives(record: dict, out: Path) -> list[Path]:
    """Bus bandwidth vs bytes for the plain ops, parallelkit solid and the raw backend dashed."""
    rows = [r for r in record["rows"] if "(" not in r["op"]]
    keys = sorted({(r["backend"], r["ranks"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, (backend, n) in zip(axes[0], keys, strict=True):
        for i, op in enumerate(sorted({r["op"] for r in rows})):
            mine = sorted(
                (r for r in rows if (r["backend"], r["ranks"], r["op"]) == (backend, n, op)),
                key=lambda r: r["bytes"],
            )
            xs = [r["bytes"] for r in mine]
            ax.plot(xs, [r["pk_busbw_gbs"] for r in mine], "-", color=f"C{i}", label=op)
            ax.plot(xs, [r["raw_busbw_gbs"] for r in mine], "--", color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="bytes", ylabel="bus bandwidth (GB/s)", title=f"{backend}, {n} ranks")
        ax.legend(fontsize=6, title="solid pk, dashed raw", title_fontsize=6)
    return [save_fig(fig, out.with_name("collectives.png"))]


# ---------------------------------------------------------------------------- peers
def peers(record: dict, out: Path) -> list[Path]:
    return [
        peers_times(record["rows"], out.with_name("peers_time.png")),
        peers_exactness(record["exactness"], out.with_name("peers_exactness.png")),
    ]


def peers_times(timed: list[dict], path: Path) -> Path:
    """One panel per workload: every framework's step time at each rank count, per transport
    (a record saved before rows named their transport: by framework alone)."""
    workloads = list(dict.fromkeys(r["workload"] for r in timed))
    ranks = sorted({r["ranks"] for r in timed})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4.2), squeeze=False)
    width = 0.8 / len(ranks)
    for ax, w in zip(axes[0], workloads, strict=True):
        frameworks = list(dict.fromkeys(peers_label(r) for r in timed if r["workload"] == w))
        for i, n in enumerate(ranks):
            ms = [
                next(
                    (
                        r["s"] * 1e3
                        for r in timed
                        if (r["workload"], peers_label(r), r["ranks"]) == (w, f, n)
                    ),
                    0.0,
                )
                for f in frameworks
            ]
            ax.bar([j + i * width for j in range(len(frameworks))], ms, width, label=f"{n} rank(s)")
        ax.set_xticks(
            [j + width / 2 for j in range(len(frameworks))],
            [short(f) for f in frameworks],
            rotation=35,
            ha="right",
            fontsize=7,
        )
        ax.set(title=w, ylabel="ms per step (float32)")
        ax.legend(fontsize=7)
    return save_fig(fig, path)


def peers_exactness(exact: list[dict], path: Path) -> Path:
    """The worst float64 relative error of each framework and case at the most ranks; what
    refused to run is named under the axis."""
    most = max(r["ranks"] for r in exact)
    rows = [r for r in exact if r["ranks"] == most and r["errors"]]
    refused = sorted({peers_label(r) for r in exact if r["ranks"] == most and not r["errors"]})
    worst = [max((e if isinstance(e, float) else 1.0) for e in r["errors"].values()) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.8))
    colors = ["C2" if e <= 1e-9 else "C3" for e in worst]
    ax.barh(range(len(rows)), [max(e, ERROR_FLOOR) for e in worst], color=colors)
    labels = [f"{r['workload']}: {short(peers_label(r))} ({r['case']})" for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1e-9, color="black", lw=0.8, ls=":")
    ax.invert_yaxis()
    xlabel = "worst relative error vs dense (float64); green: exact, red: wrong"
    if refused:
        xlabel += "\nrefused, not drawn: " + ", ".join(refused)
    ax.set(xlabel=xlabel, title=f"exactness at {most} ranks")
    return save_fig(fig, path)


def peers_label(row: dict) -> str:
    """A peers row's framework with its transport ("parallelkit SyncBatchNorm, MPICH")."""
    transport = row.get("transport")
    return f"{row['framework']}, {transport}" if transport else row["framework"]


def short(framework: str) -> str:
    """A framework's name cut to fit under a bar."""
    return (
        framework.replace("MultiNodeBatchNormalization", "MultiNodeBN")
        .replace(" parallel_convolution example", " example")
        .replace("SpatialParallelConv2d", "Spatial")
        .replace("ChannelParallelConv2d", "Channel")
    )


# ---------------------------------------------------------------------------- spatial_volume
VOLUME_PARTS = ("compute and the rest", "halo exchange", "reductions", "host metadata")


def spatial_volume(record: dict, out: Path) -> list[Path]:
    """Step time per workload and variant, and the 2-rank step's split, side by side."""
    rows = record["rows"]
    fig, (times, split) = plt.subplots(1, 2, figsize=(11, 4))
    variants = list(dict.fromkeys(v for r in rows for v in r["ms"]))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [j + i * width for j, r in enumerate(rows) if v in r["ms"]]
        ms = [r["ms"][v] for r in rows if v in r["ms"]]
        bars = times.bar(xs, ms, width, label=v, color=f"C{i}")
        if v != "dense":
            times.bar_label(bars, [volume_ratios(r, v) for r in rows if v in r["ms"]], fontsize=6)
    labels = [r["workload"] for r in rows]
    times.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(rows))], labels)
    times.set(ylabel="ms per forward + backward", title="step: dense 1 rank vs 2 ranks over D")
    times.legend(
        fontsize=7, title="dense / variant over the bars:\nwall time, CPU time", title_fontsize=7
    )
    bottom = [0.0] * len(rows)
    for part in VOLUME_PARTS:
        ms = [r.get("split_ms", {}).get(part, 0.0) for r in rows]
        split.bar(range(len(rows)), ms, bottom=bottom, label=part)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    split.set_xticks(range(len(rows)), labels)
    split.set(ylabel="ms (rank 0)", title="2-rank step: where the time goes")
    split.legend(fontsize=7)
    return [save_fig(fig, out.with_name("spatial_volume.png"))]


def volume_ratios(row: dict, variant: str) -> str:
    """dense / variant in wall time, and in CPU time per rank where the record has it."""
    text = f"{row['ms']['dense'] / row['ms'][variant]:.2f}x"
    cpu = row.get("cpu_ms")
    return text + (f"\n{cpu['dense'] / cpu[variant]:.2f}x" if cpu else "")


def inference(record: dict, out: Path) -> list[Path]:
    """Per method: the share of voxels whose class differs from the dense prediction, and the
    peak memory per rank against the ideal (the dense run's / P)."""
    rows = record["rows"]
    fig, (wrong, memory) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.32 * len(rows)),
                                        sharey=True)
    labels = [r["method"].replace("MONAI sliding window", "MONAI SW") for r in rows]
    ys = range(len(rows))
    colors = ["C2" if r["method"].startswith("parallelkit") else "C0"
              if r["method"].startswith("dense") else "C1" for r in rows]
    bars = wrong.barh(ys, [100 * r["class_differs"] for r in rows], color=colors)
    wrong.bar_label(bars, [f"{100 * r['class_differs']:.3f}%, |dlogit| {r['max_logit_diff']:.1e}"
                           for r in rows], fontsize=6)
    wrong.set_yticks(list(ys), labels, fontsize=7)
    wrong.invert_yaxis()
    wrong.set(xlabel="voxels whose class differs from the dense prediction (%)",
              title="against the whole-volume prediction")
    bars = memory.barh(ys, [r["peak_mib"] for r in rows], color=colors)
    memory.bar_label(bars, [f"{r['peak_vs_ideal']:.2f}x ideal" for r in rows], fontsize=6)
    memory.set(xlabel="peak memory per rank above the runtime (MiB)",
               title="memory per rank (ideal: dense / P)")
    return [save_fig(fig, out.with_name("inference.png"))]


# ---------------------------------------------------------------------------- driver
PLOTTERS: dict[str, Callable[[dict, Path], list[Path]]] = {
    "model_parallel": model_parallel,
    "train": train,
    "data_parallel": data_parallel,
    "sync_batchnorm": sync_batchnorm,
    "collectives": collectives,
    "peers": peers,
    "spatial_volume": spatial_volume,
    "inference": inference,
}


def plot(json_path: Path) -> list[Path]:
    """The PNGs of one record, next to it (none if its kind has no plotter)."""
    json_path = Path(json_path)
    plotter = PLOTTERS.get(json_path.stem)
    if plotter is None:
        return []
    return plotter(json.loads(json_path.read_text()), json_path)


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted(RESULTS.glob("*.json"))
    for path in paths:
        for png in plot(path):
            print(f"wrote {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
