"""Model parallelism on CPU ranks: spatial and channel-parallel convolutions, and ResNet-18.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/model_parallel.py           # full run, ~12 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/model_parallel.py --quick   # smoke, ~1.5 min

Three parts, each a forward + backward (input, weight and bias gradients) per step, timed on
1, 2 and 4 gloo ranks (``parallelkit.testing.Ranks``, one compute thread each):

1. spatial  a 3x3 convolution, padding 1, 64 -> 64 channels, batch 1, on H x H images
            (64 .. 1024), the rows split over the ranks. Variants per rank:
                dense       nn.Conv2d on the whole image (1 rank: the reference)
                pk          SpatialParallelConv2d.from_dense(conv, comm) on this rank's block
                            (pk.spatial.scatter, outside the timed region), called with
                            ``size=(H, W)``, so no size all-gather runs
                exchange    the layer's fetch alone, forward + backward: gather_rows of the
                            halo rows over the ranks, then of the padding columns on the
                            grid's 1-rank row communicator, as the layer runs them
                rows only   the first of the two: the halo exchange proper
                conv        the layer's convolution alone: F.conv2d, no padding, on the
                            fetched block
                conv, pad W F.conv2d on the rows-only block with padding=(0, 1): the same
                            convolution, padding the columns itself
                copy floor  F.pad of the block by one row and column each side: one local copy
                            each way, the least that assembling a padded block costs
                ceiling     the dense nn.Conv2d on this rank's tensor_split block of rows plus
                            the 1 halo row a 3x3 convolution reads on each side that has a
                            neighbour, every rank at once, no communication
            Halo bytes: every tensor handed to the communicator's neighbor_exchange is counted
            (forward and backward separately) and compared with geometry's prediction,
            2 x received_rows x W x C x 4 B x N; the two must be equal.
2. channel  a 3x3 convolution, padding 1, C -> C channels (64, 128, 256; 512 only on request:
            ~4x the 256 cost), batch 64, 32 x 32 images:
                dense       nn.Conv2d (1 rank)
                pk out      ChannelParallelConv2d.from_dense(conv, comm), split="out"
                pk in       the same with split="in" (whole input, whole output both)
                grouped     what nn.Conv2d(C, C, 3, groups=ranks) computes, by rank: its input
                            channel block into its output channel block, no communication.
                            NOT the dense convolution; its relative error is reported.
                ceiling     the rank's share of the dense work: nn.Conv2d(C, C / ranks), the
                            whole input into its tensor_split block of output channels (the
                            dense weight's rows), input gradient too, no communication
3. network  parallelkit.models.resnet18(num_classes=10), cross-entropy forward + backward (no
            optimizer), batch 2: dense on 1 rank, pk.parallelize(model, comm, s) on 2 ranks for
            s = "spatial", "channel" (every rank the whole batch) and "data" (one image each);
            two ceilings, the plain model on every rank at once, no communication: "ceiling,
            rows" on the rank's block of rows plus 3 halo rows per interior side (what the 7x7
            stride-2 stem reads past a block), the ceiling of "spatial"; "ceiling, batch" on the
            rank's share of the batch, the ceiling of "data" and of "channel" (half the work of
            every layer: a whole network of half-width layers is not the dense model).

Timing: every variant runs ``--warmup`` steps (the last one timed, to size the blocks; none
counts), then ``--repeats`` timed blocks in alternating order (forward on even rounds,
reversed on odd ones); a block holds as many steps as fill about ``--target-s`` (at least
one), starts after a barrier, and its time is all-reduced with max. A time is the median over
blocks of the slowest rank's time per step. Speedup = dense time on 1 rank / parallel time;
ceiling speedup = dense time on 1 rank / ceiling time, the honest limit on a shared CPU node
(the ranks share memory bandwidth and clocks, so even work without communication runs less
than P x faster); efficiency = speedup / ceiling speedup. 4 ranks on a 2-core machine
oversubscribe it. Each rank count
runs in one pool of fresh processes; the parent saves markdown and JSON under
benchmarks/results/ (every timed block, and the load that other processes put on the machine
during each measurement, from /proc/stat).

Goals (from the issues, measured, not tuned for): spatial >= 1.7x on 2 ranks at 1024^2,
channel split="out" >= 1.5x on 2 ranks at 256 -> 256; efficiency >= 0.9.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from _common import (
    ByteCounter,
    OtherLoad,
    alternating,
    ceiling_rows,
    command_line,
    environment,
    save,
    scaling,
    time_block,
    torch_sync,
)

if TYPE_CHECKING:
    from parallelkit.comm.torch_dist import TorchCommunicator

FULL_SPATIAL, QUICK_SPATIAL = [64, 128, 256, 512, 1024], [64, 128, 256]  # H = W
FULL_CHANNEL, QUICK_CHANNEL = [64, 128, 256], [64, 128]  # C_in = C_out
FULL_NETWORK, QUICK_NETWORK = [224, 512], [128]  # H = W
SPATIAL_CHANNELS = 64
CHANNEL_BATCH, CHANNEL_HW = 64, 32
NUM_CLASSES = 10
GOAL_SPATIAL = (1024, 2, 1.7)  # image size, ranks, speedup
GOAL_CHANNEL = (256, 2, 1.5)  # channels, ranks, speedup (split="out")
GOAL_EFFICIENCY = 0.9  # speedup / ceiling speedup
NETWORK_HALO = 3  # rows: what ResNet-18's stem (7x7, stride 2, padding 3) reads past a block
CEILING_OF = {  # the ceiling variant each parallel variant is measured against
    "pk": "ceiling",
    "pk out": "ceiling",
    "pk in": "ceiling",
    "spatial": "ceiling, rows",
    "channel": "ceiling, batch",
    "data": "ceiling, batch",
}
MAX_ITERS = 1000
WORKER_TIMEOUT_S = 1200.0

Variants = dict[str, Callable[[], None]]  # variant name -> one forward + backward


@dataclass
class Config:
    """What the ranks measure."""

    spatial_sizes: list[int]  # H = W
    channel_widths: list[int]  # C_in = C_out
    network_sizes: list[int]  # H = W
    network_batch: int
    ranks: list[int]  # rank counts of the spatial and channel parts
    network_ranks: int
    split_in: bool  # also time ChannelParallelConv2d(split="in")
    warmup: int
    repeats: int
    target_s: float


# ---------------------------------------------------------------------------- timing (ranks)
def measure(variants: Variants, comm: TorchCommunicator, cfg: Config) -> dict[str, Any]:
    """Warm up and calibrate each variant, then time them all in alternating order."""
    sync = torch_sync(comm.group)
    iters = {}
    for name, fn in variants.items():
        for _ in range(cfg.warmup - 1):
            fn()
        t = time_block(fn, 1, sync)  # the last warm-up step, timed to calibrate
        iters[name] = max(1, min(MAX_ITERS, round(cfg.target_s / t)))
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in alternating(names, cfg.repeats):
        times[name].append(time_block(variants[name], iters[name], sync))
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"iters": iters, "times": times, "ms": ms}


def fwd_bwd(
    forward: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor | None], grad: torch.Tensor
) -> Callable[[], None]:
    """One step: clear the leaves' gradients, run ``forward``, backward with ``grad``."""
    leaves = [t for t in leaves if t is not None]

    def step() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(grad)

    return step


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf tensor that needs a gradient, holding a copy of ``t``."""
    return t.detach().clone().requires_grad_()


# ---------------------------------------------------------------------------- 1. spatial
def halo_window():
    from parallelkit.geometry import Window

    return Window(3, 1, 1, 1)  # kernel 3, stride 1, padding 1 on both ends


def spatial_rank(comm: TorchCommunicator, cfg: Config, hw: int) -> dict[str, Any]:
    """The spatial variants on this rank for H = W = ``hw``; times, and halo bytes counted."""
    import parallelkit as pk
    import parallelkit.functional as pkf
    from parallelkit.nn import SpatialParallelConv2d

    torch.manual_seed(0)  # the same weights and images on every rank
    c, n = SPATIAL_CHANNELS, comm.size
    conv = nn.Conv2d(c, c, 3, padding=1)
    x, dy = torch.randn(1, c, hw, hw), torch.randn(1, c, hw, hw)
    in_sizes, _, want = halo_window().plan(hw, n)
    layer = SpatialParallelConv2d.from_dense(conv, comm)  # shares conv's parameters
    (along_h, _, _), (cols, _, _) = layer.grid.axes(2)  # W's is 1-rank (columns not split)

    def rows(x_blk: torch.Tensor) -> torch.Tensor:  # the halo rows from the neighbours
        return pkf.gather_rows(x_blk, comm, 2, in_sizes, want)

    def fetch(x_blk: torch.Tensor) -> torch.Tensor:  # what the layer fetches: rows, then columns
        return pkf.gather_rows(rows(x_blk), cols, 3, [hw], [(-1, hw + 1)])

    x_blk, dy_blk = leaf(pk.spatial.scatter(x, comm)), pk.spatial.scatter(dy, comm)  # (1, C, h, W)
    x_rows = leaf(rows(x_blk))  # (1, C, h + halo, W)
    x_halo = leaf(fetch(x_blk))  # (1, C, h + halo, W + 2)
    w, b = leaf(conv.weight), leaf(conv.bias)

    variants: Variants = {}
    if n == 1:
        x_whole = leaf(x)
        variants["dense"] = fwd_bwd(lambda: conv(x_whole), [x_whole, *conv.parameters()], dy)
    variants["pk"] = fwd_bwd(
        lambda: layer(x_blk, size=(hw, hw)), [x_blk, layer.weight, layer.bias], dy_blk
    )
    variants["exchange"] = fwd_bwd(lambda: fetch(x_blk), [x_blk], torch.randn_like(x_halo))
    variants["rows only"] = fwd_bwd(lambda: rows(x_blk), [x_blk], torch.randn_like(x_rows))
    variants["conv"] = fwd_bwd(lambda: F.conv2d(x_halo, w, b), [x_halo, w, b], dy_blk)
    variants["conv, pad W"] = fwd_bwd(
        lambda: F.conv2d(x_rows, w, b, padding=(0, 1)), [x_rows, w, b], dy_blk
    )
    dy_pad = torch.randn(1, c, x_blk.shape[2] + 2, hw + 2)
    variants["copy floor"] = fwd_bwd(lambda: F.pad(x_blk, (1, 1, 1, 1)), [x_blk], dy_pad)
    if n > 1:  # the dense layer on this rank's rows and their halo, no communication
        x_ceil = leaf(x[:, :, ceiling_rows(hw, n, comm.rank, 1)])
        dy_ceil = torch.randn_like(x_ceil)
        variants["ceiling"] = fwd_bwd(lambda: conv(x_ceil), [x_ceil, *conv.parameters()], dy_ceil)

    # One counted step of the layer, forward and backward apart: the halo rows move over comm
    # (the grid's communicator along H), the padding columns on the 1-rank one along W. On one
    # rank the grid hands back the same communicator for both: wrapped and counted once.
    with contextlib.ExitStack() as stack:
        counter = stack.enter_context(ByteCounter(along_h))
        local = stack.enter_context(ByteCounter(cols)) if cols is not along_h else None
        y_blk = layer(x_blk, size=(hw, hw))
        fwd = counter.snapshot()
        y_blk.backward(dy_blk)
        total = counter.snapshot()
    bwd = {k: total[k] - fwd[k] for k in total}
    if local is not None:  # all the local copies of a step, in one number
        bwd["self_copied"] += local.self_copied
    return {**measure(variants, comm, cfg), "bytes_fwd": fwd, "bytes_bwd": bwd}


def predicted_halo(hw: int, n: int) -> list[int]:
    """Bytes each rank receives forward by geometry (the backward returns as many)."""
    from parallelkit.geometry import received_rows

    sizes, _, want = halo_window().plan(hw, n)
    row_bytes = hw * SPATIAL_CHANNELS * 4 * 1  # W x C x float32 x batch
    return [rows * row_bytes for rows in received_rows(sizes, want)]


# ---------------------------------------------------------------------------- 2. channel
def channel_rank(comm: TorchCommunicator, cfg: Config, c: int) -> dict[str, Any]:
    """The channel variants on this rank for C -> C; times, parity and the grouped error."""
    from parallelkit.geometry import tensor_split_sizes
    from parallelkit.nn import ChannelParallelConv2d

    torch.manual_seed(0)
    n, r = comm.size, comm.rank
    conv = nn.Conv2d(c, c, 3, padding=1)
    x = torch.randn(CHANNEL_BATCH, c, CHANNEL_HW, CHANNEL_HW)
    dy = torch.randn_like(x)  # replicated, as every rank computes the same loss
    layers = {"pk out": ChannelParallelConv2d.from_dense(conv, comm, split="out")}
    if cfg.split_in and n > 1:
        layers["pk in"] = ChannelParallelConv2d.from_dense(conv, comm, split="in")
    sizes = tensor_split_sizes(c, n)
    blk = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    w_g, b_g = leaf(conv.weight[blk, blk]), leaf(conv.bias[blk])  # a diagonal block of W
    x_g = leaf(x[:, blk])

    variants: Variants = {}
    if n == 1:
        x_d = leaf(x)
        variants["dense"] = fwd_bwd(lambda: conv(x_d), [x_d, *conv.parameters()], dy)
    for name, layer in layers.items():
        x_l = leaf(x)
        variants[name] = fwd_bwd(
            lambda layer=layer, x_l=x_l: layer(x_l), [x_l, *layer.parameters()], dy
        )
    if n > 1:
        variants["grouped"] = fwd_bwd(
            lambda: F.conv2d(x_g, w_g, b_g, padding=1), [x_g, w_g, b_g], dy[:, blk]
        )
        # The ceiling: this rank's share of the output channels, from the whole input.
        share = nn.Conv2d(c, sizes[r], 3, padding=1)
        with torch.no_grad():
            share.weight.copy_(conv.weight[blk])
            share.bias.copy_(conv.bias[blk])
        x_c = leaf(x)
        variants["ceiling"] = fwd_bwd(lambda: share(x_c), [x_c, *share.parameters()], dy[:, blk])
    result = measure(variants, comm, cfg)

    # Errors against the dense output, each rank checking its own output channels.
    with torch.no_grad():
        y_blk = F.conv2d(x, conv.weight[blk], conv.bias[blk], padding=1)  # dense, (N, c', H, W)
        sums = [(y_blk**2).sum()]
        for layer in layers.values():
            sums.append(((layer(x)[:, blk] - y_blk) ** 2).sum())
        sums.append(((F.conv2d(x[:, blk], w_g, b_g, padding=1) - y_blk) ** 2).sum())
    sums = comm.all_reduce(torch.stack(sums).double())
    rel = (sums[1:] / sums[0]).sqrt().tolist()  # ||y - y_dense|| / ||y_dense||, whole output
    result["rel_err"] = dict(zip([*layers, "grouped"], rel, strict=True))
    return result


# ---------------------------------------------------------------------------- 3. network
def network_rank(
    comm: TorchCommunicator, cfg: Config, hw: int, strategies: list[str]
) -> dict[str, Any]:
    """ResNet-18 steps per strategy on this rank; times and the first step's loss."""
    import parallelkit as pk
    from parallelkit.models import resnet18

    torch.manual_seed(0)
    base = resnet18(num_classes=NUM_CLASSES)
    x = torch.randn(cfg.network_batch, 3, hw, hw)
    labels = torch.randint(0, NUM_CLASSES, (cfg.network_batch,))
    variants: Variants = {}
    losses: dict[str, list[float]] = {}
    for s in strategies:
        model = copy.deepcopy(base)
        xs, ys = x, labels
        if s == "data":  # the batch split over the ranks
            xs, ys = x.tensor_split(comm.size)[comm.rank], labels.tensor_split(comm.size)[comm.rank]
        if s != "dense":
            model = pk.parallelize(model, comm, s)
        losses[s] = []
        variants[s] = network_step(model, xs, ys, losses[s])
    if comm.size > 1:  # the plain model on this rank's share, no communication
        rows = ceiling_rows(hw, comm.size, comm.rank, NETWORK_HALO)
        shares = {
            "ceiling, rows": (x[:, :, rows].contiguous(), labels),
            "ceiling, batch": (
                x.tensor_split(comm.size)[comm.rank],
                labels.tensor_split(comm.size)[comm.rank],
            ),
        }
        for name, (xs, ys) in shares.items():
            variants[name] = network_step(copy.deepcopy(base), xs, ys, [])
    result = measure(variants, comm, cfg)
    # The first step's loss; under "data" the mean of the ranks' losses (equal halves).
    first = {s: v[0] for s, v in losses.items()}
    if "data" in first:
        first["data"] = comm.all_reduce(torch.tensor([first["data"]]), "mean").item()
    result["loss"] = first
    return result


def network_step(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor, losses: list[float]
) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        if not losses:
            losses.append(loss.item())

    return step


# ---------------------------------------------------------------------------- launch (parent)
def run_job(ranks: Any, fn: Callable[..., dict], *args: Any) -> dict[str, Any]:
    """``fn`` on every rank; rank 0's result, the wall time, and the other processes' load."""
    load, start = OtherLoad(), time.monotonic()
    results = ranks.run(fn, *args, timeout=WORKER_TIMEOUT_S)
    out = {**results[0], "seconds": time.monotonic() - start}
    out["other_load_cores"] = load.cores()
    if "bytes_fwd" in out:  # per rank, not only rank 0's
        out["bytes_fwd"] = [res["bytes_fwd"] for res in results]
        out["bytes_bwd"] = [res["bytes_bwd"] for res in results]
    return out


def run_all(cfg: Config) -> list[dict[str, Any]]:
    """Every part on every rank count, each rank count in one fresh pool of gloo ranks."""
    from parallelkit.testing import Ranks

    rows = []
    for n in sorted(set(cfg.ranks) | {1, cfg.network_ranks}):
        with Ranks(n, "gloo", comm_timeout=600) as ranks:
            jobs: list[tuple[str, int, Callable[..., dict], tuple]] = []
            if n in cfg.ranks:
                jobs += [("spatial", hw, spatial_rank, (cfg, hw)) for hw in cfg.spatial_sizes]
                jobs += [("channel", c, channel_rank, (cfg, c)) for c in cfg.channel_widths]
            if n in (1, cfg.network_ranks):
                strategies = ["dense"] if n == 1 else ["spatial", "channel", "data"]
                jobs += [
                    ("network", hw, network_rank, (cfg, hw, strategies)) for hw in cfg.network_sizes
                ]
            for part, size, fn, args in jobs:
                row = {"part": part, "size": size, "ranks": n, **run_job(ranks, fn, *args)}
                ms = ", ".join(f"{k} {v:.1f}" for k, v in row["ms"].items())
                print(
                    f"{part:8s} {size:5d} on {n} rank(s): {ms} ms  ({row['seconds']:.0f} s, "
                    f"other load {row['other_load_cores']:.2f} cores)",
                    flush=True,
                )
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------- reporting (parent)
def find(rows: list[dict], part: str, size: int, ranks: int) -> dict[str, Any] | None:
    return next(
        (r for r in rows if (r["part"], r["size"], r["ranks"]) == (part, size, ranks)), None
    )


def keys(rows: list[dict], part: str) -> list[tuple[int, int]]:
    return sorted({(r["size"], r["ranks"]) for r in rows if r["part"] == part})


def add_scaling(rows: list[dict]) -> None:
    """Each multi-rank row's ``scaling``: per parallel variant that has a ceiling in the row
    (``CEILING_OF``), speedup, ceiling speedup and efficiency against the 1-rank dense time."""
    for row in rows:
        dense = find(rows, row["part"], row["size"], 1)
        if row["ranks"] == 1 or dense is None:
            continue
        ms, ref = row["ms"], dense["ms"]["dense"]
        row["scaling"] = {
            v: scaling(ref, ms[CEILING_OF[v]], t) for v, t in ms.items() if CEILING_OF.get(v) in ms
        }


def scaling_cells(row: dict, variant: str) -> str:
    """``ceiling (ms) | ceiling speedup | efficiency`` of a variant, or dashes."""
    got = row.get("scaling", {}).get(variant)
    if got is None:
        return "- | - | -"
    ceiling = row["ms"][CEILING_OF[variant]]
    return f"{ceiling:.1f} | {got['ceiling_speedup']:.2f} | {got['efficiency']:.2f}"


def halo_check(row: dict[str, Any]) -> dict[str, Any]:
    """Measured halo bytes next to geometry's prediction, per rank and in all."""
    pred = predicted_halo(row["size"], row["ranks"])
    fwd, bwd = row["bytes_fwd"], row["bytes_bwd"]
    measured = [f["sent"] + b["sent"] for f, b in zip(fwd, bwd, strict=True)]
    agree = (
        sum(measured) == 2 * sum(pred)
        and [f["received"] for f in fwd] == pred  # forward: the halo rows each rank fetches
        and [b["sent"] for b in bwd] == pred  # backward: their gradients, sent back
        and measured == [2 * p for p in pred]  # a symmetric halo: each rank gives what it gets
    )
    self_copied = sum(f["self_copied"] + b["self_copied"] for f, b in zip(fwd, bwd, strict=True))
    return {
        "measured": measured,
        "predicted": [2 * p for p in pred],
        "measured_total": sum(measured),
        "predicted_total": 2 * sum(pred),
        "self_copied_total": self_copied,
        "agree": agree,
    }


def spatial_tables(rows: list[dict], oversub: set[int]) -> list[str]:
    """Speedup, halo bytes, and exchange vs convolution; one table each."""
    speed = [
        "| image | ranks | dense 1 rank (ms) | pk (ms) | speedup | ceiling (ms) "
        "| ceiling speedup | efficiency |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    halo = [
        "| image | ranks | measured, all ranks (B) | predicted, all ranks (B) "
        "| measured per rank (B) | predicted per rank (B) | agree | own rows copied locally (B) |",
        "|---|--:|--:|--:|---|---|---|--:|",
    ]
    split = [
        "| image | ranks | pk layer (ms) | exchange (ms) | of which rows (ms) | conv (ms) "
        "| pk - exchange - conv (ms) | exchange / pk | copy floor (ms) | conv, pad W (ms) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for hw, n in keys(rows, "spatial"):
        row, dense = find(rows, "spatial", hw, n), find(rows, "spatial", hw, 1)
        ms, star = row["ms"], " (oversubscribed)" if n in oversub else ""
        image = f"{hw}x{hw}"
        if dense is not None:
            s = dense["ms"]["dense"] / ms["pk"]
            speed.append(
                f"| {image} | {n}{star} | {dense['ms']['dense']:.1f} | {ms['pk']:.1f} "
                f"| {s:.2f} | {scaling_cells(row, 'pk')} |"
            )
        h = row["halo"]
        halo.append(
            f"| {image} | {n} | {h['measured_total']} | {h['predicted_total']} "
            f"| {h['measured']} | {h['predicted']} | {'yes' if h['agree'] else 'NO'} "
            f"| {h['self_copied_total']} |"
        )
        rest = ms["pk"] - ms["exchange"] - ms["conv"]
        split.append(
            f"| {image} | {n}{star} | {ms['pk']:.1f} | {ms['exchange']:.2f} "
            f"| {ms['rows only']:.2f} | {ms['conv']:.1f} | {rest:.2f} "
            f"| {ms['exchange'] / ms['pk']:.1%} | {ms['copy floor']:.2f} "
            f"| {ms['conv, pad W']:.1f} |"
        )
    return ["\n".join(t) for t in (speed, halo, split)]


def channel_table(rows: list[dict], oversub: set[int]) -> str:
    lines = [
        "| channels | ranks | dense 1 rank (ms) | pk out (ms) | speedup | ceiling (ms) "
        "| ceiling speedup | efficiency | pk in (ms) | speedup | efficiency | pk rel. error "
        "| grouped (ms) | grouped 'speedup' | grouped rel. error |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c, n in keys(rows, "channel"):
        row, dense = find(rows, "channel", c, n), find(rows, "channel", c, 1)
        ms, err = row["ms"], row["rel_err"]
        ref = dense["ms"]["dense"] if dense else float("nan")
        pk_in = "- | - | -"
        if "pk in" in ms:
            eff = row.get("scaling", {}).get("pk in")
            pk_in = f"{ms['pk in']:.1f} | {ref / ms['pk in']:.2f} | "
            pk_in += f"{eff['efficiency']:.2f}" if eff else "-"
        pk_err = max(v for k, v in err.items() if k != "grouped")
        grouped = (
            f"{ms['grouped']:.1f} | {ref / ms['grouped']:.2f} | {err['grouped']:.3f}"
            if "grouped" in ms
            else "- | - | -"
        )
        star = " (oversubscribed)" if n in oversub else ""
        lines.append(
            f"| {c} -> {c} | {n}{star} | {ref:.1f} | {ms['pk out']:.1f} "
            f"| {ref / ms['pk out']:.2f} | {scaling_cells(row, 'pk out')} | {pk_in} "
            f"| {pk_err:.1e} | {grouped} |"
        )
    return "\n".join(lines)


def network_table(rows: list[dict], batch: int) -> str:
    lines = [
        "| image | strategy | ranks | batch per rank | step (ms) | speedup vs dense "
        "| against | efficiency | first loss | loss - dense loss |",
        "|---|---|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for hw, n in keys(rows, "network"):
        row, dense = find(rows, "network", hw, n), find(rows, "network", hw, 1)
        ref_ms, ref_loss = dense["ms"]["dense"], dense["loss"]["dense"]
        for s, t in row["ms"].items():
            per_rank = batch // n if s in ("data", "ceiling, batch") else batch
            eff = row.get("scaling", {}).get(s)
            vs = f"{CEILING_OF[s]} | {eff['efficiency']:.2f}" if eff else "- | -"
            loss = row["loss"].get(s)  # the ceilings compute no dense loss
            losses = "- | -" if loss is None else f"{loss:.5f} | {loss - ref_loss:+.1e}"
            lines.append(
                f"| {hw}x{hw} | {s} | {n} | {per_rank} | {t:.0f} | {ref_ms / t:.2f} "
                f"| {vs} | {losses} |"
            )
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[dict[str, Any]]:
    out = []
    for part, (size, n, goal), variant, ref in (
        ("spatial", GOAL_SPATIAL, "pk", "dense"),
        ("channel", GOAL_CHANNEL, "pk out", "dense"),
    ):
        row, dense = find(rows, part, size, n), find(rows, part, size, 1)
        if row is None or dense is None:
            continue
        speedup = dense["ms"][ref] / row["ms"][variant]
        eff = row.get("scaling", {}).get(variant, {}).get("efficiency")
        out.append(
            {"part": part, "size": size, "ranks": n, "speedup": speedup, "goal": goal,
             "met": speedup >= goal, "efficiency": eff, "efficiency_goal": GOAL_EFFICIENCY,
             "efficiency_met": None if eff is None else eff >= GOAL_EFFICIENCY}
        )  # fmt: skip
    return out


def headlines(rows: list[dict]) -> list[str]:
    """Summary lines: the largest image's time split, the 1-rank overhead, ResNet-18."""
    out = []
    sizes = [hw for hw, _ in keys(rows, "spatial")]
    if sizes:
        hw = max(sizes)
        for _, n in [k for k in keys(rows, "spatial") if k[0] == hw]:
            ms = find(rows, "spatial", hw, n)["ms"]
            out.append(
                f"- spatial {hw}x{hw}, {n} {'rank' if n == 1 else 'ranks'}: pk {ms['pk']:.0f} ms"
                f" = exchange {ms['exchange']:.0f} ms (halo rows alone {ms['rows only']:.0f}, "
                f"copy floor {ms['copy floor']:.0f}) + conv {ms['conv']:.0f} ms, rest "
                f"{ms['pk'] - ms['exchange'] - ms['conv']:+.0f} ms"
            )
        one = find(rows, "spatial", hw, 1)
        if one is not None:
            ratio = one["ms"]["pk"] / one["ms"]["dense"]
            out.append(f"- spatial {hw}x{hw}, 1 rank: pk / dense nn.Conv2d = {ratio:.2f}")
    for hw, n in keys(rows, "network"):
        if n == 1:
            continue
        ref, ms = find(rows, "network", hw, 1)["ms"]["dense"], find(rows, "network", hw, n)["ms"]
        speedups = ", ".join(f"{s} {ref / t:.2f}x" for s, t in ms.items() if s in CEILING_OF)
        effs = find(rows, "network", hw, n).get("scaling", {})
        speedups += "; efficiency " + ", ".join(
            f"{s} {e['efficiency']:.2f}" for s, e in effs.items()
        )
        out.append(f"- ResNet-18 {hw}x{hw}, {n} ranks, speedup vs dense: {speedups}")
    return out


def report(rows: list[dict], env: dict[str, str], cfg: Config, seconds: float) -> str:
    """The whole markdown document."""
    oversub = {n for n in cfg.ranks if n > int(env["nproc"])}
    over = (
        f"{' and '.join(map(str, sorted(oversub)))} ranks oversubscribe the {env['nproc']} cores "
        "(more compute threads than cores, plus gloo's threads): those rows measure "
        "time-sharing, not scaling. "
        if oversub
        else ""
    )
    goal_lines = [
        f"- {g['part']}, {g['size']}{'x' + str(g['size']) if g['part'] == 'spatial' else ' ch'}, "
        f"{g['ranks']} ranks: speedup {g['speedup']:.2f} (goal >= {g['goal']}): "
        f"{'met' if g['met'] else 'MISSED'}"
        + (
            ""
            if g["efficiency"] is None
            else f"; efficiency {g['efficiency']:.2f} (goal >= {g['efficiency_goal']}): "
            f"{'met' if g['efficiency_met'] else 'MISSED'}"
        )
        for g in goals(rows)
    ]
    spatial_rows = [r for r in rows if r["part"] == "spatial"]
    agree = all(r["halo"]["agree"] for r in spatial_rows)
    goal_lines += headlines(rows)
    load = max((r["other_load_cores"] for r in rows), default=0.0)
    speed, halo, split = spatial_tables(rows, oversub)
    widths = ", ".join(str(c) for c in cfg.channel_widths)
    parts = [
        "# Model parallelism: spatial and channel-parallel convolutions, ResNet-18",
        "",
        f"Command: `{command_line()}` ({seconds:.0f} s)",
        "",
        f"- date: {env['date']}",
        f"- python {env['python']}, torch {env['torch']}, gloo ranks from "
        "parallelkit.testing.Ranks, one compute thread each",
        f"- CPU: {env['cpu']}, nproc {env['nproc']}",
        f"- {cfg.warmup} warm-up step(s), then {cfg.repeats} timed blocks of ~{cfg.target_s:g} s "
        "(at least one step) per variant, variants alternating; time = median over blocks of "
        "the slowest rank's time per step (forward + backward)",
        f"- {over}Processes outside this benchmark used at most {load:.2f} cores during any "
        "one measurement (from /proc/stat).",
        "",
        "## Summary",
        "",
        *goal_lines,
        f"- halo bytes, measured == predicted by geometry in every spatial run: "
        f"{'yes' if agree else 'NO'}",
        "",
        "## 1. Spatial: 3x3 conv, 64 -> 64 channels, batch 1, rows split over the ranks",
        "",
        "pk = `SpatialParallelConv2d.from_dense(conv, comm)` on this rank's block, called with "
        "`size=(H, W)` (no size all-gather); speedup = dense nn.Conv2d on 1 rank / pk. "
        "ceiling = the dense nn.Conv2d on every rank at once, each on its block of rows plus "
        "the 1 halo row per interior side, no communication; ceiling speedup = dense / "
        "ceiling (below the rank count where the ranks share memory bandwidth and clocks); "
        "efficiency = speedup / ceiling speedup.",
        "",
        speed,
        "",
        "### Halo bytes, forward + backward",
        "",
        "Measured: the bytes of every tensor a rank hands to `comm.neighbor_exchange` for "
        "another rank, in one forward and one backward of the layer. Predicted: `2 x "
        "geometry.received_rows(*Window(3, 1, 1, 1).plan(H, ranks)[::2]) x W x C x 4 B x N` "
        "(the backward returns the received rows' gradients). Also checked: each rank's "
        "forward receives and backward sends equal its predicted rows. The last column is "
        "not network traffic: a rank's own rows, which gather_rows routes through "
        "neighbor_exchange as a message to itself and which are copied locally.",
        "",
        halo,
        "",
        "### Halo exchange alone vs convolution alone",
        "",
        "All forward + backward, on the same block. exchange = the layer's fetch as it runs "
        "it: `functional.gather_rows` of the halo rows over the ranks, then `gather_rows` of "
        "the padding columns on the grid's 1-rank row communicator; of which rows = the first "
        "call alone (the halo exchange proper). conv = `F.conv2d`, no padding, on the fetched "
        "block. Overlapping the exchange with the interior convolution could save at most "
        "min(exchange, conv) per step, less the local copies that no overlap hides. "
        "pk - exchange - conv is the all-reduce of the weight and bias gradients "
        "(copy_to_group's backward) and Python overhead. copy floor = `F.pad` of the block by "
        "one row and column each side: one local copy each way, the least that assembling a "
        "padded block costs. conv, pad W = `F.conv2d(rows block, padding=(0, 1))`: the "
        "convolution padding W itself, with no column copy.",
        "",
        split,
        "",
        f"## 2. Channel: 3x3 conv, C -> C, batch {CHANNEL_BATCH}, "
        f"{CHANNEL_HW}x{CHANNEL_HW} (C = {widths})",
        "",
        "pk out / pk in = `ChannelParallelConv2d.from_dense(conv, comm, split=...)`, whole "
        "input and whole output on every rank; speedup against dense nn.Conv2d on 1 rank. "
        "ceiling = every rank at once computing its share of the output channels from the "
        "whole input (`nn.Conv2d(C, C / ranks)`, the dense weight's rows), no communication; "
        "efficiency = speedup / (dense / ceiling). "
        "rel. error = ||y - y_dense|| / ||y_dense|| over the whole output. grouped = each rank "
        "convolving its own input-channel block into its own output-channel block (what "
        "`nn.Conv2d(C, C, 3, groups=ranks)` computes with W's diagonal blocks), no "
        "communication: it is NOT the dense convolution, as its O(1) error shows, so its "
        "'speedup' is not one. 512 -> 512 is left out of the default run: each step costs "
        "about 4x the 256 -> 256 one (~12 s dense), ~7 more minutes in all "
        "(`--channel-widths 512` runs it).",
        "",
        channel_table(rows, oversub),
        "",
        "## 3. ResNet-18 (num_classes=10), cross-entropy forward + backward",
        "",
        f"Global batch {cfg.network_batch}; dense on 1 rank; `pk.parallelize(model, comm, s)` "
        f"on {cfg.network_ranks} ranks (spatial and channel: the whole batch on every rank; "
        "data: the batch split). first loss: the loss of the first step (data: the mean over "
        "ranks), a check that every strategy computes the dense model. Ceilings: the plain "
        "model on every rank at once, no communication, on its block of rows plus "
        f"{NETWORK_HALO} halo rows per interior side ('ceiling, rows') or its share of the batch "
        "('ceiling, batch'); efficiency = speedup / (dense / the ceiling in 'against').",
        "",
        network_table(rows, cfg.network_batch),
    ]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (~1.5 min)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--spatial-sizes", type=int, nargs="+")
    p.add_argument("--channel-widths", type=int, nargs="+")
    p.add_argument("--network-sizes", type=int, nargs="+")
    p.add_argument("--no-split-in", action="store_true", help="skip split='in'")
    p.add_argument("--warmup", type=int, help="warm-up steps per variant (default 1)")
    p.add_argument("--repeats", type=int, help="timed blocks per variant (default 5, quick 3)")
    p.add_argument("--target-s", type=float, help="seconds per timed block (default 0.5)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/model_parallel.md"))
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    quick = args.quick
    return Config(
        spatial_sizes=args.spatial_sizes or (QUICK_SPATIAL if quick else FULL_SPATIAL),
        channel_widths=args.channel_widths or (QUICK_CHANNEL if quick else FULL_CHANNEL),
        network_sizes=args.network_sizes or (QUICK_NETWORK if quick else FULL_NETWORK),
        network_batch=2,
        ranks=sorted(set(args.ranks)),
        network_ranks=2,
        split_in=not args.no_split_in,
        warmup=max(1, args.warmup or 1),
        repeats=args.repeats or (3 if quick else 5),
        target_s=args.target_s or (0.1 if quick else 0.5),
    )  # fmt: skip


def main() -> None:
    args = parse_args()
    cfg = config(args)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    start = time.monotonic()
    rows = run_all(cfg)
    for row in rows:
        if row["part"] == "spatial":
            row["halo"] = halo_check(row)
    add_scaling(rows)
    env = environment()
    text = report(rows, env, cfg, time.monotonic() - start)
    print("\n" + text)
    json_path = save(args.out, text, env, cfg, rows, goals=goals(rows))
    print(f"wrote {args.out} and {json_path}")
    bad = [
        (r["size"], r["ranks"]) for r in rows if r["part"] == "spatial" and not r["halo"]["agree"]
    ]
    assert not bad, f"halo bytes: measured != predicted for (H, ranks) in {bad}"


if __name__ == "__main__":
    main()
