"""Spatial parallelism on volumes: a 3-D U-Net at 128^3 and a Conv3d stack at 256^3, split over D.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_volume.py   # ~5 min, 2 free cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_volume.py --quick   # smoke, < 1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_volume.py --backend mpi  # mpiexec

Two workloads, each one training step without the optimizer (forward + backward of the loss,
every parameter's gradient), batch 1, float32:

    unet    a 3-D U-Net (``parallelkit.models.UNet(spatial_dims=3)``, plain torch.nn: two
            3x3x3 conv-BatchNorm-ReLU per stage, 2x2x2 max pooling, 2x2x2 stride-2 transposed
            convolutions, skips joined along channels, 1x1x1 logits), widths 8, 16, 32, one
            input channel, 2 classes, on a 128^3 volume; per-voxel cross-entropy, mean over
            the volume
    stack   ``--stack-layers`` Conv3d(C, C, 3, padding=1) with a ReLU between, C = 8, on a
            256^3 volume (a tensor is 512 MiB: C = 8 keeps the dense step within ~4 GiB, and
            C = 4 falls onto a slow path of torch's CPU Conv3d); loss = mean of y^2

Variants, in one pool of 2 gloo ranks (``parallelkit.testing.Ranks``) or, with ``--backend
mpi``, 2 ranks per workload that the script starts under mpiexec (the one next to this Python)
with ``pk.init("mpi")``; one compute thread each, so a rank stands for one device; round by
round in alternating order:

    dense   the plain model on the whole volume, on rank 0 alone; rank 1 waits in a barrier
            (its CPU time meanwhile is reported: it must be ~0, or the dense step would share
            the cores with it; MPI's barrier spins, so under MPI rank 1 polls a non-blocking
            one with 1 ms sleeps)
    pk      ``pk.parallelize(model, comm, "spatial", spatial_input="blocks",
            spatial_output="blocks", spatial_size=(D, H, W))`` on both ranks: D split in two,
            every rank passing only its half of the volume (and of the labels) and computing
            the loss on its half of the output; one scalar all-reduce makes the dense loss
            (``reduce_from_group``, as ``parallelkit train``'s segment task does). No rank holds
            a whole sample: BatchNorm3d becomes SyncBatchNorm, the stride-1 "same" convolutions
            run on the edge path, the parameter gradients' shares are summed in DataParallel's
            bucketed all-reduces
    dense, pk's kernel
            the dense model with every Conv3d through the kernel choice the spatial layers
            make on blocks (``parallelkit.spatial.edges.convolve``), a diagnostic
            (``--no-kernel-diagnostic`` skips it). torch's CPU heuristic runs a 3x3x3
            convolution of a batch of 1 on its slow im2col kernel (``slow_conv3d``) when
            C x D x H <= 20480; a block of half the depth falls under that line where the whole
            volume does not (the U-Net's 64^3 and 32^3 levels, the edge path's slabs), so the
            spatial layers convolve such a block as a batch of two, which torch runs on oneDNN.
            The whole volume meets the line less often, but not never: dense / "dense, pk's
            kernel" says how much of the ratio is the kernel, and "dense, pk's kernel" / pk
            what the split alone gives
    ceiling the plain model, no communication, on both ranks at once, each on its
            torch.tensor_split half of D plus the plane the first 3x3x3 convolution reads
            past it, extended for the U-Net to a multiple of 4 planes (its two poolings' skips
            need it: 64 + 4 of 128 planes, ~6 % more than its share; the stack: 128 + 1 of
            256), and its labels' planes. Not the network's receptive field: pk fetches each
            layer's halo rather than recomputing it, and a ceiling that did more work would
            flatter pk. Its Conv3d go through the spatial layers' kernel choice, as pk's do:
            on torch's own, a half-depth block falls onto ``slow_conv3d`` (below), and in a
            smoke run the ceiling was slower than the whole dense step. Ceiling speedup =
            dense / ceiling: on a shared CPU node less than 2, as the ranks share memory
            bandwidth and clocks; it is the honest limit of the 2-rank speedup. Efficiency =
            (dense / pk) / (dense / ceiling) = ceiling / pk (goals over MPI: U-Net
            128^3 speedup >= 1.7, efficiency >= 0.9)

Every variant runs in the same processes at the same time of the run, so the other processes'
load on this shared machine falls on both alike. Timing: ``--warmup`` untimed rounds, then
``--repeats`` rounds; a step's time is the slowest rank's (rank 0's for dense); the median over
rounds is reported. Ratio = dense step / pk step: the 2-rank speedup over one rank with the
same threads per process (goal >= 1.6). Beside the wall time, each step's CPU time per rank
(``time.process_time``: all of the rank's threads, gloo's too; the busiest rank's): on a
machine whose cores other processes hold, wall time also counts waiting for a core, CPU time
only the work, so its ratio says what the split itself saves.

The split of the pk step: the communicator's methods are wrapped (on the instance, during the
timed pk steps) to add up the time the calling thread spends inside them: halo exchange
(``neighbor_exchange``), reductions (``all_reduce`` / ``all_gather``: SyncBatchNorm's
statistics, the loss; the wait for DataParallel's bucketed ``all_reduce_async``), host metadata
(``all_gather_ints``). The rest is compute (convolutions, norms, copies) and Python. Time
inside a collective includes waiting for the other rank, so imbalance shows as communication.

Halo bytes: in the first warm-up pk step, every tensor handed to ``neighbor_exchange`` for the
other rank is counted, forward and backward apart, and compared with geometry's prediction:
per layer that fetches rows along D (Conv3d, MaxPool3d, ConvTranspose3d), the planes each rank
receives (``geometry.received_rows`` of the layer's window plan, ``transposed_needs`` for the
transposed convolution) x N x C_in x H x W x 4 B; the backward sends as many back, but for
the first layer (the input volume needs no gradient). Results:
benchmarks/results/spatial_volume.md and .json, and spatial_volume.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.models import UNet

from _common import (
    ByteCounter,
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

PARTS = ("halo exchange", "reductions", "host metadata", "compute and the rest")
GOAL = 1.7  # dense step / 2-rank step
GOAL_EFFICIENCY = 0.9  # speedup / ceiling speedup
CEILING_HALO = 1  # planes: what a 3x3x3 convolution, padding 1, reads past a block
RANKS = 2
WORKER_TIMEOUT_S = 3000.0


@dataclass
class Config:
    unet_size: int = 128
    unet_widths: list[int] = field(default_factory=lambda: [8, 16, 32])
    stack_size: int = 256
    stack_channels: int = 8
    stack_layers: int = 2
    warmup: int = 1
    repeats: int = 3
    kernel_diagnostic: bool = True  # also time dense with the spatial layers' Conv3d kernels
    backend: str = "gloo"  # or "mpi": ranks under mpiexec


# ---------------------------------------------------------------------------- the models
def conv_stack(channels: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.ReLU()] if i else []
        mods.append(nn.Conv3d(channels, channels, 3, padding=1))
    return nn.Sequential(*mods)


def workload(name: str, cfg: Config) -> tuple[nn.Module, tuple[int, ...], str]:
    """(model, input shape, loss kind) of a workload."""
    if name == "unet":
        s = cfg.unet_size
        model = UNet(num_classes=2, in_channels=1, widths=cfg.unet_widths, spatial_dims=3)
        return model, (1, 1, s, s, s), "cross-entropy"
    s = cfg.stack_size
    shape = (1, cfg.stack_channels, s, s, s)
    return conv_stack(cfg.stack_channels, cfg.stack_layers), shape, "mean square"


def ceiling_align(name: str, cfg: Config) -> int:
    """The multiple of planes a workload's input depth must be: the U-Net's total pooling."""
    return 2 ** (len(cfg.unet_widths) - 1) if name == "unet" else 1


def loss_sum(y: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """The loss summed over the voxels (the mean is this over the whole volume's count)."""
    if target is None:
        return y.square().sum()
    return F.cross_entropy(y, target, reduction="sum")


# ---------------------------------------------------------------------------- kernels
TORCH_CONV3D = F.conv3d


def pk_conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    """``F.conv3d`` through the spatial layers' kernel choice (string paddings as torch)."""
    from parallelkit.spatial import edges as spatial_edges

    if isinstance(padding, str):
        return TORCH_CONV3D(input, weight, bias, stride, padding, dilation, groups)
    return spatial_edges.convolve(input, weight, bias, stride, padding, dilation, groups)


@contextlib.contextmanager
def pk_kernels() -> Iterator[None]:
    """The dense model's ``F.conv3d`` through the spatial layers' kernel choice while inside."""
    F.conv3d = pk_conv3d
    try:
        yield
    finally:
        F.conv3d = TORCH_CONV3D


# ---------------------------------------------------------------------------- ranks
def rank_job(comm: Any, cfg: Config, name: str) -> dict[str, Any]:
    """Time dense (rank 0) and pk (both ranks) on ``name``; the split and the halo bytes."""
    import parallelkit as pk
    import parallelkit.functional as pkf

    torch.manual_seed(0)  # the same weights and volume on every rank
    base, shape, kind = workload(name, cfg)
    x = torch.randn(shape)
    target = torch.randint(0, 2, (shape[0], *shape[2:])) if kind == "cross-entropy" else None
    count = x[:, 0].numel()  # voxels in the batch: the mean's divisor (mean square: x C)
    count *= 1 if target is not None else shape[1]
    x_blk = x.tensor_split(comm.size, dim=2)[comm.rank].clone()  # this rank's half of D
    t_blk = None if target is None else target.tensor_split(comm.size, dim=1)[comm.rank].clone()
    # The ceiling's share: this rank's half of D with its halo planes, on the plain model.
    planes = ceiling_rows(shape[2], comm.size, comm.rank, CEILING_HALO, ceiling_align(name, cfg))
    x_ceil = x[:, :, planes].clone()
    t_ceil = None if target is None else target[:, planes].clone()
    ceil_model = copy.deepcopy(base)
    ceil_params = list(ceil_model.parameters())

    def ceiling_step() -> tuple[float, float]:
        for p in ceil_params:
            p.grad = None
        start = time.perf_counter()
        loss = loss_sum(ceil_model(x_ceil), t_ceil) / count
        loss.backward()
        return time.perf_counter() - start, loss.item()

    if comm.rank != 0:
        del x, target  # only rank 0 runs the dense model on the whole volume

    model = pk.parallelize(
        copy.deepcopy(base), comm, "spatial", spatial_input="blocks", spatial_output="blocks",
        spatial_size=shape[2:],
    )  # fmt: skip
    pk_params = list(model.parameters())

    def pk_step(between: Callable[[], None] = lambda: None) -> tuple[float, float]:
        for p in pk_params:
            p.grad = None
        start = time.perf_counter()
        y_blk = model(x_blk)
        loss = pkf.reduce_from_group(loss_sum(y_blk, t_blk), comm) / count
        between()
        loss.backward()
        return time.perf_counter() - start, loss.item()

    dense_step = None
    if comm.rank == 0:
        dense_params = list(base.parameters())

        def dense_step() -> tuple[float, float]:
            for p in dense_params:
                p.grad = None
            start = time.perf_counter()
            loss = loss_sum(base(x), target) / count
            loss.backward()
            return time.perf_counter() - start, loss.item()

    def dense_or_wait() -> tuple[float, float]:
        return dense_step() if dense_step is not None else (0.0, 0.0)

    sync = comm_sync(comm)
    times: dict[str, list[float]]
    losses: dict[str, float] = {}
    idle = {"cpu_s": 0.0, "wall_s": 0.0}  # rank 1 while rank 0 runs the dense step
    split_rows: list[dict[str, float]] = []
    bytes_fwd: dict[str, int] = {}
    bytes_bwd: dict[str, int] = {}
    spent: dict[str, float] = defaultdict(float)
    names = ["dense", "pk"] + (["dense, pk's kernel"] if cfg.kernel_diagnostic else [])
    names.append("ceiling")
    times = {v: [] for v in names}
    cpu_times: dict[str, list[float]] = {v: [] for v in names}
    for round_, variant in enumerate(alternating(names, cfg.warmup + cfg.repeats)):
        timed = round_ >= len(names) * cfg.warmup
        sync.barrier()
        cpu0 = time.process_time()
        if variant == "dense, pk's kernel":
            with pk_kernels():
                t, loss = dense_or_wait()
            sync.wait_idle()  # rank 1 waits without taking a core from rank 0
            t = sync.max(t)
        elif variant == "ceiling":  # both ranks at once, no communication, pk's Conv3d kernel
            with pk_kernels():
                t, loss = ceiling_step()
            t = sync.max(t)
        elif variant == "dense":
            cpu, wall = time.process_time(), time.perf_counter()
            t, loss = dense_or_wait()
            sync.wait_idle()
            t = sync.max(t)
            if comm.rank != 0 and timed:
                idle["cpu_s"] += time.process_time() - cpu
                idle["wall_s"] += time.perf_counter() - wall
        elif not bytes_fwd:  # the first pk step (a warm-up one): count the halo bytes
            with ByteCounter(comm) as counter:
                t, loss = pk_step(lambda: bytes_fwd.update(counter.snapshot()))
                total = counter.snapshot()
            bytes_bwd.update({k: total[k] - bytes_fwd[k] for k in total})
            t = sync.max(t)
        else:
            spent.clear()
            with timed_methods(comm, spent):
                t, loss = pk_step()
            row = {part: spent.get(part, 0.0) for part in PARTS[:-1]}
            row[PARTS[-1]] = t - sum(row.values())
            row["step"] = t
            t = sync.max(t)
            if timed:
                split_rows.append(row)
        ran = variant in ("pk", "ceiling") or comm.rank == 0
        cpu = sync.max(time.process_time() - cpu0 if ran else 0.0)  # all of the rank's threads
        losses.setdefault(variant, loss)
        if timed:
            times[variant].append(t)
            cpu_times[variant].append(cpu)
    result: dict[str, Any] = {
        "times": times,
        "cpu_times": cpu_times,
        "cpu_ms": {v: statistics.median(ts) * 1e3 for v, ts in cpu_times.items()},
        "ms": {v: statistics.median(ts) * 1e3 for v, ts in times.items()},
        "loss": losses,
        "bytes_fwd": bytes_fwd,
        "bytes_bwd": bytes_bwd,
        "idle_rank": idle,
    }
    if split_rows:
        result["split_ms"] = {
            k: statistics.median(r[k] for r in split_rows) * 1e3 for k in split_rows[0]
        }
    return result


# ---------------------------------------------------------------------------- geometry
def predicted_halo(name: str, cfg: Config, parts: int = RANKS) -> list[dict[str, Any]]:
    """Per layer that fetches along D: its input shape and the bytes each rank receives
    forward by geometry (the backward sends as many back). Shapes come from one forward of
    the dense model on the meta device (no memory, no compute)."""
    from parallelkit.geometry import Window, received_rows, tensor_split_sizes, transposed_needs
    from parallelkit.spatial.conv import conv_windows

    model, shape, _ = workload(name, cfg)
    model = model.to("meta")
    rows: list[dict[str, Any]] = []

    def record(path: str, m: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        n, c, d, h, w = inputs[0].shape
        sizes = tensor_split_sizes(d, parts)
        if isinstance(m, nn.ConvTranspose3d):
            k, s, p, dil = m.kernel_size[0], m.stride[0], m.padding[0], m.dilation[0]
            out_d = (d - 1) * s - 2 * p + dil * (k - 1) + 1 + m.output_padding[0]
            out_sizes = tensor_split_sizes(out_d, parts)
            firsts = [sum(out_sizes[:r]) for r in range(parts)]
            want = [
                transposed_needs(o, o + size, d, k, s, p, dil)
                for o, size in zip(firsts, out_sizes, strict=True)
            ]
        else:
            if isinstance(m, nn.Conv3d):
                win = conv_windows(m.kernel_size, m.stride, m.padding, m.dilation)[0]
            else:
                k, s, p, dil = (
                    v if isinstance(v, int) else v[0]
                    for v in (m.kernel_size, m.stride, m.padding, m.dilation)
                )
                win = Window(k, s, p, p, dil, m.ceil_mode)
            sizes, _, want = win.plan(d, parts)
        planes = received_rows(sizes, want)
        plane_bytes = n * c * h * w * 4
        rows.append({
            "layer": path, "kind": type(m).__name__, "input": [n, c, d, h, w],
            "planes": planes, "bytes": [r * plane_bytes for r in planes],
            "grad": inputs[0].requires_grad,  # else no halo gradient goes back
        })  # fmt: skip

    hooks = [
        m.register_forward_pre_hook(lambda m, i, path=path: record(path, m, i))
        for path, m in model.named_modules()
        if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d))
    ]
    model(torch.empty(shape, device="meta"))  # autograd on: which inputs need a gradient
    for h in hooks:
        h.remove()
    return rows


# ---------------------------------------------------------------------------- parent
def run(cfg: Config, names: list[str]) -> list[dict[str, Any]]:
    """Every workload on 2 ranks (gloo: one pool; mpi: mpiexec per workload); rank 0's result
    plus both ranks' bytes."""
    from parallelkit.testing import Ranks

    rows = []
    with contextlib.ExitStack() as stack:
        if cfg.backend == "gloo":
            ranks = stack.enter_context(Ranks(RANKS, "gloo", comm_timeout=WORKER_TIMEOUT_S))
        for name in names:
            load, start = OtherLoad(), time.monotonic()
            if cfg.backend == "mpi":
                script = str(Path(__file__).resolve())
                results = run_mpi(script, RANKS, (cfg, name), WORKER_TIMEOUT_S)
            else:
                results = ranks.run(rank_job, cfg, name, timeout=WORKER_TIMEOUT_S)
            row = {"workload": name, "ranks": RANKS, **results[0]}
            row["seconds"] = time.monotonic() - start
            row["other_load_cores"] = load.cores()
            row["idle_rank"] = results[1]["idle_rank"]  # rank 1 waits during the dense steps
            row["bytes_fwd"] = [r["bytes_fwd"] for r in results]
            row["bytes_bwd"] = [r["bytes_bwd"] for r in results]
            row["layers"] = predicted_halo(name, cfg)
            row["halo"] = halo_check(row)
            row["scaling"] = row_scaling(row)
            ms = row["ms"]
            print(
                f"{name}: dense {ms['dense']:.0f} ms, pk {ms['pk']:.0f} ms, ratio "
                f"{ms['dense'] / ms['pk']:.2f}, ceiling {ms['ceiling']:.0f} ms, efficiency "
                f"{row['scaling']['pk']['efficiency']:.2f} ({row['seconds']:.0f} s, other load "
                f"{row['other_load_cores']:.2f} cores)",
                flush=True,
            )
            rows.append(row)
    return rows


def row_scaling(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per 2-rank variant: speedup, ceiling speedup and efficiency, in wall time."""
    ms = row["ms"]
    return {v: scaling(ms["dense"], ms["ceiling"], ms[v]) for v in ("pk", "ceiling")}


def halo_check(row: dict[str, Any]) -> dict[str, Any]:
    """Counted halo bytes per rank next to geometry's prediction."""
    layers = row["layers"]
    predicted = [sum(layer["bytes"][r] for layer in layers) for r in range(RANKS)]
    back = [sum(layer["bytes"][r] for layer in layers if layer["grad"]) for r in range(RANKS)]
    fwd, bwd = row["bytes_fwd"], row["bytes_bwd"]
    return {
        "predicted": predicted,
        "predicted_bwd": back,
        "received_fwd": [f["received"] for f in fwd],
        "sent_fwd": [f["sent"] for f in fwd],
        "sent_bwd": [b["sent"] for b in bwd],
        "received_bwd": [b["received"] for b in bwd],
        "self_copied": [f["self_copied"] + b["self_copied"] for f, b in zip(fwd, bwd, strict=True)],
        "agree": [f["received"] for f in fwd] == predicted and [b["sent"] for b in bwd] == back,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def title(name: str, cfg: Config) -> str:
    if name == "unet":
        widths = ", ".join(map(str, cfg.unet_widths))
        return f"3-D U-Net (widths {widths}), {cfg.unet_size}^3, batch 1"
    c = cfg.stack_channels
    return f"Conv3d stack ({cfg.stack_layers} x {c} -> {c}, 3x3x3), {cfg.stack_size}^3, batch 1"


def report(cfg: Config, rows: list[dict[str, Any]], env: dict[str, str], seconds: float) -> str:
    """The whole markdown document."""
    lines = [
        "# Spatial parallelism on volumes: 2 ranks split over depth against the dense step",
        "",
        f"Command: `{env['command']}` ({seconds:.0f} s)",
        "",
        *(f"- {k}: {v}" for k, v in env.items() if k != "command"),
        f"- {ranks_text(cfg.backend)}, one compute thread each; dense = the "
        "plain model on rank 0 alone while rank 1 waits, pk = pk.parallelize(model, comm, "
        '"spatial") on both ranks, D split in two, blocks in and out (no rank holds a whole '
        "sample); ceiling = the plain model on both ranks at once, each on its half of D with "
        "its halo planes, Conv3d on the spatial layers' kernel choice, no communication: "
        "efficiency = speedup / ceiling's speedup (its first loss is rank 0's share's)",
        f"- {cfg.warmup} warm-up round(s), then {cfg.repeats} rounds of one step of each variant "
        "in alternating order, all in the same processes; a step = forward + backward, "
        "the slowest rank's time; median over rounds",
        "- other processes' load during each workload (cores, from /proc/stat): "
        + ", ".join(f"{r['workload']} {r['other_load_cores']:.2f}" for r in rows),
        "",
        "## Summary",
        "",
    ]
    for r in rows:
        ms, idle = r["ms"], r["idle_rank"]
        ratio = ms["dense"] / ms["pk"]
        lines.append(
            f"- {title(r['workload'], cfg)}: dense {ms['dense']:.0f} ms, 2 ranks "
            f"{ms['pk']:.0f} ms, ratio {ratio:.2f} (goal >= {GOAL}): "
            f"{'met' if ratio >= GOAL else 'MISSED'}"
        )
        if "scaling" in r:
            pk, ceiling = r["scaling"]["pk"], r["scaling"]["ceiling"]["speedup"]
            lines.append(
                f"  - ceiling {ms['ceiling']:.0f} ms, ceiling speedup {ceiling:.2f}; efficiency "
                f"{pk['efficiency']:.2f} (goal >= {GOAL_EFFICIENCY}): "
                f"{'met' if pk['efficiency'] >= GOAL_EFFICIENCY else 'MISSED'}"
            )
        if "dense, pk's kernel" in ms:
            same = ms["dense, pk's kernel"]
            lines.append(
                f"  - the dense model on the spatial layers' Conv3d kernel choice (diagnostic): "
                f"{same:.0f} ms; the kernel's share, dense / that: {ms['dense'] / same:.2f}; the "
                f"split's, that / 2 ranks: {same / ms['pk']:.2f}"
            )
        cpu = r["cpu_ms"]
        lines.append(
            f"  - CPU time per rank (the busiest rank's, all its threads; immune to other "
            f"processes holding cores): dense {cpu['dense']:.0f} ms, 2 ranks {cpu['pk']:.0f} ms, "
            f"ratio {cpu['dense'] / cpu['pk']:.2f}"
        )
        busy = idle["cpu_s"] / idle["wall_s"] if idle["wall_s"] else 0.0
        lines.append(f"  - rank 1's CPU use while it waited for the dense steps: {busy:.1%}")
    agree = all(r["halo"]["agree"] for r in rows)
    lines.append(
        f"- halo bytes, counted == predicted by geometry on every rank: {'yes' if agree else 'NO'}"
    )
    lines += ["", "## Step times", "", step_table(rows, cfg), ""]
    lines += ["## Split of the 2-rank step", "", SPLIT_NOTE, "", split_table(rows, cfg), ""]
    lines += ["## Halo bytes per rank", "", HALO_NOTE, "", halo_table(rows, cfg), ""]
    for r in rows:
        lines += [f"### {title(r['workload'], cfg)}: layers that fetch along D", ""]
        lines += [layer_table(r), ""]
    return "\n".join(lines)


SPLIT_NOTE = (
    "Median over the timed pk rounds of rank 0's time inside each kind of collective "
    "(the communicator's methods wrapped on the instance); waiting for the other rank counts "
    "there, so imbalance shows as communication. halo exchange: neighbor_exchange (the edge "
    "path's halo planes, the transposed convolutions' and poolings' fetches); reductions: "
    "all_reduce and all_gather (SyncBatchNorm statistics, the loss) and the wait for "
    "DataParallel's bucketed gradient all-reduces; host metadata: all_gather_ints; compute "
    "and the rest: convolutions, norms, copies, Python."
)
HALO_NOTE = (
    "Counted: the bytes of every tensor a rank hands to `comm.neighbor_exchange` for the other "
    "rank in one step (the first warm-up pk step), forward and backward apart. Predicted: per "
    "layer that fetches along D, `geometry.received_rows` of its window plan over 2 blocks "
    "(`transposed_needs` for ConvTranspose3d) x N x C_in x H x W x 4 B; the backward sends the "
    "received planes' gradients back, for every such layer but the first (the input volume "
    "needs no gradient). Checked: each rank's forward receives and backward sends equal the "
    "prediction, to the byte. Own rows copied locally are not traffic."
)


def ranks_text(backend: str) -> str:
    if backend == "mpi":
        return 'MPI ranks under mpiexec, pk.init("mpi")'
    return "gloo ranks from parallelkit.testing.Ranks"


def step_table(rows: list[dict[str, Any]], cfg: Config) -> str:
    """Every variant's step; efficiency = (dense / variant) / (dense / ceiling)."""
    lines = [
        "| workload | variant | ranks | step (ms) | dense / variant | efficiency (vs ceiling) "
        "| each round (ms) | CPU time per rank (ms) | dense / variant, CPU | first loss |",
        "|---|---|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for r in rows:
        dense, dense_cpu = r["ms"]["dense"], r["cpu_ms"]["dense"]
        for v, ms in r["ms"].items():
            each = ", ".join(f"{t * 1e3:.0f}" for t in r["times"][v])
            n, cpu = RANKS if v in ("pk", "ceiling") else 1, r["cpu_ms"][v]
            eff = r.get("scaling", {}).get(v) if n > 1 else None
            eff_text = f"{eff['efficiency']:.2f}" if eff else "-"
            lines.append(
                f"| {title(r['workload'], cfg)} | {v} | {n} | {ms:.0f} | {dense / ms:.2f} "
                f"| {eff_text} "
                f"| {each} | {cpu:.0f} | {dense_cpu / cpu:.2f} | {r['loss'][v]:.6f} |"
            )
    return "\n".join(lines)


def split_table(rows: list[dict[str, Any]], cfg: Config) -> str:
    lines = [
        "| workload | " + " | ".join(f"{p} (ms)" for p in PARTS) + " | step (ms) |",
        "|---|" + "--:|" * (len(PARTS) + 1),
    ]
    for r in rows:
        split = r.get("split_ms", {})
        if not split:
            continue
        cells = " | ".join(f"{split[p]:.0f} ({split[p] / split['step']:.0%})" for p in PARTS)
        lines.append(f"| {title(r['workload'], cfg)} | {cells} | {split['step']:.0f} |")
    return "\n".join(lines)


def halo_table(rows: list[dict[str, Any]], cfg: Config) -> str:
    lines = [
        "| workload | rank | forward: predicted (B) | received (B) | sent (B) "
        "| backward: predicted (B) | sent (B) | received (B) | agree | own rows copied (B) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for r in rows:
        h = r["halo"]
        for k in range(RANKS):
            lines.append(
                f"| {title(r['workload'], cfg)} | {k} | {h['predicted'][k]} "
                f"| {h['received_fwd'][k]} | {h['sent_fwd'][k]} | {h['predicted_bwd'][k]} "
                f"| {h['sent_bwd'][k]} | {h['received_bwd'][k]} "
                f"| {'yes' if h['agree'] else 'NO'} | {h['self_copied'][k]} |"
            )
    return "\n".join(lines)


def layer_table(row: dict[str, Any]) -> str:
    lines = [
        "| layer | kind | input N C D H W | planes received per rank "
        "| predicted bytes per rank | gradient sent back |",
        "|---|---|---|---|---|---|",
    ]
    for layer in row["layers"]:
        lines.append(
            f"| {layer['layer']} | {layer['kind']} | {' x '.join(map(str, layer['input']))} "
            f"| {layer['planes']} | {layer['bytes']} | {'yes' if layer['grad'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="U-Net 32^3, stack 64^3, 1 round")
    p.add_argument("--workloads", nargs="+", choices=["unet", "stack"], default=["unet", "stack"])
    p.add_argument("--unet-size", type=int)
    p.add_argument("--stack-size", type=int)
    p.add_argument("--stack-channels", type=int)
    p.add_argument("--stack-layers", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--no-kernel-diagnostic",
        action="store_true",
        help="skip timing the dense model on the spatial layers' Conv3d kernels",
    )
    p.add_argument(
        "--backend",
        choices=["gloo", "mpi"],
        default="gloo",
        help="gloo: spawned ranks; mpi: ranks under mpiexec, pk.init('mpi')",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spatial_volume.md"))
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # one rank under mpiexec (run_mpi)
        mpi_worker(rank_job, *args.worker, timeout=WORKER_TIMEOUT_S)
        return
    cfg = Config(unet_size=32, stack_size=64, repeats=1) if args.quick else Config()
    keys = ("unet_size", "stack_size", "stack_channels", "stack_layers", "warmup", "repeats")
    for key in (*keys, "backend"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    cfg.kernel_diagnostic = not args.no_kernel_diagnostic
    cfg.warmup = max(1, cfg.warmup)  # the first pk step counts the halo bytes, untimed
    env = environment(command=command_line(), backend=cfg.backend)
    start = time.monotonic()
    rows = run(cfg, args.workloads)
    markdown = report(cfg, rows, env, time.monotonic() - start)
    print(markdown)
    quick = Path(f"/tmp/spatial_volume_quick_{cfg.backend}/spatial_volume.md")
    out = args.out if not args.quick else quick
    save(out, markdown, env, cfg, rows)
    bad = [r["workload"] for r in rows if not r["halo"]["agree"]]
    assert not bad, f"halo bytes: counted != predicted for {bad}"


if __name__ == "__main__":
    main()
