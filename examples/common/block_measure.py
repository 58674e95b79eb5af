"""Memory per rank of a segmentation training step that reads its data by blocks, and the
largest sample that trains within a per-rank memory budget, on 1 rank and on P ranks that each
hold one block of every sample. Shared by ``examples/segmentation_large_images/measure.py``
(a 2-D U-Net, images split by rows) and ``examples/segmentation_volumes/measure.py`` (a 3-D
U-Net, volumes split over depth): each of them names its :class:`Setup` and calls :func:`main`.

One step is what ``parallelkit train train.task=segment data.name=zarr:DIR`` does on a batch of
one sample: this rank's block of the image and of the mask read from a zarr store
(:mod:`shapes_store` writes one per side, :class:`parallelkit.data.blockset.BlockDataset` reads
it: only the chunks the block touches are decoded, normalized by the statistics the writer
kept), the network, per-pixel cross-entropy on this rank's block of the logits (the logits are
never gathered), backward, an SGD step. One rank runs the plain torch model on the whole sample
(the reference, without parallelkit); P ranks run ``pk.parallelize(model, grid, grid,
spatial_input="blocks", spatial_output="blocks")``: no rank ever holds a whole sample.

Every measurement starts fresh processes (:class:`parallelkit.testing.Ranks`: gloo ranks, one
thread each, a deadline; a rank that fails brings the others down), so a rank's peak resident
set size is that of one step. What is measured on each rank:

    saved       every storage autograd keeps for backward (counted once, parameters left out),
                through ``torch.autograd.graph.saved_tensors_hooks``: the activation memory,
                exact and repeatable; also per layer (the leaf module that saved it first)
    largest     what the operations of the step create (:class:`Largest`, a torch dispatch
                mode): the largest tensor, and the largest spatial extent of an (N, C,
                *spatial) tensor as a fraction of a whole sample (about 1/P plus halos when
                no rank holds a whole sample or a whole activation)
    peak RSS    ``ru_maxrss`` after the step: the torch runtime and gloo, the weights, the data,
                the activations, the gradients in flight, what the allocator keeps
    runtime     VmRSS when the step starts, after a warm-up (:func:`warm_up`): the baseline
                that "above the runtime" subtracts, rank by rank. What a step loads whatever
                the sample's size is loaded before it: zarr, torch._dynamo (torch.optim
                imports it when it builds its first optimizer: 70 MiB), the kernels' code
                and oneDNN's kernels (the warm-up), the same on every rank; the cold runtime
                (before the warm-up) is recorded too

The allocator: each rank runs with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``, ``--mmap-threshold-kib``; 0 leaves glibc's default), for every rank
count alike. By default glibc raises the threshold to the largest block freed (up to 32 MiB) and
carves smaller blocks from heaps that keep what is freed in their middle; a rank's tensors are
1/P the size of one rank's, so more of them land there, and its resident set grows during
backward while its tensors shrink (one step at 1024x1024, peak above the runtime: 259-306 MiB
on the 4 ranks with glibc's default, 198-199 with the threshold fixed; one rank, whose large
tensors are mapped alone either way, 823 and 734). With the threshold fixed, every tensor above
it is mapped alone and unmapped when freed, so the resident set follows the live tensors.

The budget: every rank sets its soft RLIMIT_DATA (``resource.setrlimit``) before it reads its
data and builds its model (the runtime, already loaded, counts against it too), and lifts it
after the step, so that a rank that ran out can still report. RLIMIT_DATA caps the private
writable memory a process maps (heap and anonymous mappings, thread stacks); an allocation
beyond it fails (torch: "can't allocate memory" or std::bad_alloc, Python: MemoryError), that
rank raises, and the others, waiting in a collective, are killed. The largest side that trains
is found by bisection over multiples of ``--multiple``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch._dynamo  # torch.optim's first optimizer imports it (70 MiB): runtime
import torch.nn.functional as F
import zarr  # noqa: F401  (the readers' library)
from shapes_store import write_store
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit import models
from parallelkit.data.blockset import BlockDataset
from parallelkit.geometry import BlockLayout
from parallelkit.testing import RankError, Ranks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import command_line, environment, library_state  # noqa: E402

MIB = 2**20
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
"""glibc's malloc reads it at start: allocations above it are mapped alone and unmapped when
freed, and the threshold stays fixed (by default it rises to the largest block freed, up to
32 MiB, and blocks below it are carved from heaps that keep freed memory)."""
LAYERS_SHOWN = 10
# How a failed allocation shows in a rank's traceback (torch's CPU allocator, C++, Python, and
# oneDNN when it cannot allocate a convolution's workspace); any other failure is raised.
OUT_OF_MEMORY = (
    "can't allocate memory", "not enough memory", "Cannot allocate memory", "bad_alloc",
    "MemoryError", "could not create a primitive",
)  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What an example measures: ``dims`` 2 (images split by rows) or 3 (volumes split over
    depth), its network and data, and the defaults of its command line."""

    name: str  # the example's folder under examples/
    dims: int
    model: str  # "unet" (the library's 2-D U-Net) or "monai:UNet" (3-D)
    classes: int
    channels: int
    sides: tuple[int, ...]  # memory: default sides
    ranks: tuple[int, ...]  # memory: default rank counts
    budget_ranks: tuple[int, ...]
    budget_mib: float
    lo: int  # budget: a side that fits
    hi: int  # budget: the largest side tried
    multiple: int  # budget: sides are multiples of this
    width: int = 8

    @property
    def noun(self) -> str:
        return "image" if self.dims == 2 else "cube"


def build_model(setup: Setup, width: int) -> torch.nn.Module:
    """The dense network: 4 stages of ``width * 2**i`` channels, 3 halvings."""
    widths = [width * 2**i for i in range(4)]
    if setup.model == "unet":
        return models.create("unet", num_classes=setup.classes, in_channels=setup.channels,
                             widths=widths)  # fmt: skip
    return models.create(
        setup.model, num_classes=setup.classes, in_channels=setup.channels, channels=widths,
        strides=[2, 2, 2], num_res_units=0, norm="batch",
    )  # fmt: skip


# ---------------------------------------------------------------------------- on every rank
class Largest(TorchDispatchMode):
    """What the operations create while it is active: the largest tensor (bytes, and the
    operation), and the largest spatial extent of a sample (``prod(shape[2:])`` of a tensor of
    ``dims + 2`` dimensions: N, C, *spatial), which shows whether anything holds a whole one."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.dims, self.nbytes, self.op, self.extent, self.extent_op = dims, 0, "", 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.op = t.untyped_storage().nbytes(), str(func)
            if t.dim() == self.dims + 2 and math.prod(t.shape[2:]) > self.extent:
                self.extent, self.extent_op = math.prod(t.shape[2:]), str(func)
        return out


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` entry in KiB (VmRSS, VmData, ...)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def step(comm: pk.Communicator, setup: Setup, store: str, side: int, width: int,
         budget_mib: float | None = None, predict: bool = False) -> dict:
    """One training step (``predict``: one whole-sample prediction) on this rank within
    ``budget_mib`` (the soft RLIMIT_DATA, lifted again afterwards, so that a rank that ran out
    can still report it); what it measured."""
    cold_kib = status_kib("VmRSS")
    if predict:
        predictor = warm_predictor(comm, setup, width, store)
    else:
        warm_up(comm, setup, width)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if budget_mib is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (int(budget_mib * MIB), hard))
    try:
        measured = (measured_prediction(predictor, store, setup) if predict
                    else measured_step(comm, setup, store, side, width))
        return {**measured, "cold_rss_mib": cold_kib / 1024}
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def warm_predictor(comm: pk.Communicator, setup: Setup, width: int, store: str):
    """The trained-network stand-in (random weights: memory does not depend on them) as a
    :class:`parallelkit.inference.Predictor` over this rank's grid, warmed up on a tiny
    sample (kernels and libraries loaded before the baseline)."""
    from parallelkit.data.readers import SampleReader

    torch.manual_seed(0)
    grid = _grid(comm, setup) if comm.size > 1 else pk.Grid(comm)
    stats = json.loads((Path(store) / "channel_stats.json").read_text())
    predictor = pk.Predictor(build_model(setup, width), grid, (stats["mean"], stats["std"]))
    tiny = Path(store).parent / f"tiny-{setup.name}.npy"
    if comm.rank == 0 and not tiny.exists():
        np.save(tiny, np.zeros((setup.channels,) + (16 * 8,) * setup.dims, np.uint8))
    comm.barrier()
    predictor(SampleReader(tiny, dims=setup.dims))
    return predictor


def measured_prediction(predictor, store: str, setup: Setup) -> dict:
    """One whole-sample prediction of sample 0 of ``store`` (eval mode, no gradients): this
    rank reads its block, runs it, keeps its block of the logits."""
    from parallelkit.data.readers import SampleReader

    runtime_kib = status_kib("VmRSS")
    sample = SampleReader(sorted((Path(store) / "train" / "images").iterdir())[0],
                          dims=setup.dims)
    predictor.padded(sample.size, sample.channels)
    with Largest(setup.dims) as seen:
        result = predictor(sample)
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "runtime_rss_mib": runtime_kib / 1024,
        "largest_tensor_mib": seen.nbytes / MIB,
        "largest_extent": seen.extent / math.prod(sample.size),
        "voxels": result.voxels,
    }


def warm_up(comm: pk.Communicator, setup: Setup, width: int) -> None:
    """The runtime that a step loads whatever the sample's size, loaded before the baseline:
    one step of the same code path on a tiny random sample, 16 rows (slices) a rank of 16 x 16.
    It pages in the kernels' code and builds oneDNN's kernels, the same on every rank."""
    p, size = comm.size, (16 * comm.size,) + (16,) * (setup.dims - 1)
    torch.manual_seed(comm.rank)
    model = build_model(setup, width)
    if p > 1:
        grid = _grid(comm, setup)
        model = pk.parallelize(model, grid, grid, spatial_input="blocks",
                               spatial_output="blocks", spatial_size=size)
    x = torch.randn(1, setup.channels, 16, *size[1:])  # this rank's block
    mask = torch.randint(setup.classes, (1, 16, *size[1:]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    part = F.cross_entropy(model(x), mask, reduction="sum")
    pkf.reduce_from_group(part, comm).backward()
    opt.step()


def _grid(comm: pk.Communicator, setup: Setup) -> pk.Grid:
    """Images split by rows, volumes over depth."""
    return pk.Grid(comm, rows=comm.size) if setup.dims == 2 else pk.Grid(comm, depth=comm.size)


def read_block(setup: Setup, store: str, p: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's block of sample 0 of ``store``: ``(1, C, *block)`` and ``(1, *block)``, the
    first spatial dimension split over ``p`` ranks (the whole sample on one rank)."""
    lead = (1,) * (setup.dims - 1)
    block = BlockLayout((p, *lead), (rank,) + (0,) * (setup.dims - 1)) if p > 1 else None
    data = BlockDataset(store, "train", block=block, dims=setup.dims, augment=False,
                        num_classes=setup.classes)  # fmt: skip
    image, mask = data[0]
    return image[None], mask[None]


def measured_step(comm: pk.Communicator, setup: Setup, store: str, side: int, width: int) -> dict:
    data_kib = status_kib("VmData")
    runtime_kib = status_kib("VmRSS")
    p = comm.size
    x, mask = read_block(setup, store, p, comm.rank)
    torch.manual_seed(0)
    model = build_model(setup, width)
    if p > 1:
        grid = _grid(comm, setup)
        model = pk.parallelize(model, grid, grid, spatial_input="blocks",
                               spatial_output="blocks", spatial_size=(side,) * setup.dims)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    # Saved storages, each attributed to the leaf module running when it was first saved.
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    saved: dict[int, tuple[int, str]] = {}
    running = ["forward code"]  # a stack of leaf module names

    def enter(name: str):
        return lambda module, args: running.append(name)  # returns None: input unchanged

    def leave(module: torch.nn.Module, args: object, out: object) -> None:
        running.pop()

    for name, module in model.named_modules():
        if not any(module.children()):
            name = name.removeprefix("module.").removeprefix("module.")  # DataParallel, region
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), running[-1]))
        return t

    with Largest(setup.dims) as seen:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x)  # this rank's block: (1, classes, *block)
            running.append("loss")
            part = F.cross_entropy(logits, mask, reduction="sum")  # over this rank's block
            loss = pkf.reduce_from_group(part, comm) / side**setup.dims  # the sample's mean
        loss.backward()
        opt.step()
    layers: dict[str, int] = {}
    for nbytes, name in saved.values():
        layers[name] = layers.get(name, 0) + nbytes
    return {
        "saved_mib": sum(n for n, _ in saved.values()) / MIB,
        "layers_mib": {k: v / MIB for k, v in sorted(layers.items())},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "runtime_rss_mib": runtime_kib / 1024,
        "runtime_data_mib": data_kib / 1024,
        "input_mib": x.untyped_storage().nbytes() / MIB,
        "largest_tensor_mib": seen.nbytes / MIB,
        "largest_tensor_op": seen.op,
        # the largest (N, C, *spatial) tensor's spatial extent, as a fraction of a whole sample
        "largest_extent": seen.extent / side**setup.dims,
        "largest_extent_op": seen.extent_op,
        "loss": loss.item(),
        "mmap_threshold": os.environ.get(MMAP_THRESHOLD, "glibc's default"),
    }


# ---------------------------------------------------------------------------- the parent
def store_for(args: argparse.Namespace, side: int) -> str:
    """The zarr store of one generated sample at ``side`` (written once, then reused)."""
    setup = args.setup
    root = args.store_dir / f"{setup.name}-{side}"
    if not (root / "channel_stats.json").is_file():
        print(f"  writing {root} ...", flush=True)
        write_store(root, setup.dims, side, train=1, test=0, classes=setup.classes,
                    channels=setup.channels)  # fmt: skip
    return str(root)


def run_step(args: argparse.Namespace, ranks: int, side: int, budget_mib=None) -> list[dict]:
    """:func:`step` on ``ranks`` fresh local processes (glibc's mmap threshold fixed at
    ``--mmap-threshold-kib`` through their environment); every rank's result."""
    store, timeout = store_for(args, side), args.timeout
    saved = os.environ.get(MMAP_THRESHOLD)
    if args.mmap_threshold_kib:
        os.environ[MMAP_THRESHOLD] = str(int(args.mmap_threshold_kib * 1024))
    else:
        os.environ.pop(MMAP_THRESHOLD, None)
    try:
        with Ranks(ranks, backend="gloo" if ranks > 1 else "local", comm_timeout=timeout) as pool:
            return pool.run(step, args.setup, store, side, args.width, budget_mib,
                            args.predict, timeout=timeout)  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop(MMAP_THRESHOLD, None)
        else:
            os.environ[MMAP_THRESHOLD] = saved


def fits(args: argparse.Namespace, ranks: int, side: int) -> tuple[bool, str]:
    """Whether a step at ``side`` trains on ``ranks`` ranks within the budget, and how it
    ended. A rank that runs out of memory fails the step; any other error is raised."""
    try:
        rows = run_step(args, ranks, side, args.budget_mib)
    except RankError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if oom := [ln for ln in lines if any(s in ln for s in OUT_OF_MEMORY)]:
            return False, oom[0]
        if "died" in lines[0]:  # killed without a word (by the kernel's OOM killer?)
            return False, lines[0]
        raise
    what = "predicts" if args.predict else "trains"
    return True, f"{what}, peak RSS {max(r['peak_rss_mib'] for r in rows):.0f} MiB"


def trial(ranks: int, side: int, args: argparse.Namespace) -> dict:
    """One step at ``side`` on ``ranks`` ranks within the budget: how it ended."""
    store_for(args, side)  # written outside the trial's time
    started = time.perf_counter()
    ok, how = fits(args, ranks, side)
    print(f"  {ranks} rank(s), {side}: {how}", flush=True)
    seconds = round(time.perf_counter() - started, 1)
    return {"ranks": ranks, "side": side, "fits": ok, "how": how, "seconds": seconds}


def largest_side(ranks: int, args: argparse.Namespace) -> tuple[int | None, list[dict]]:
    """Bisection over multiples of ``args.multiple`` in [lo, hi]: the largest side that
    fits (a side that fits: every smaller one fits too); the trials."""
    trials, best, m = [], None, args.multiple
    lo, hi = args.lo // m, args.hi // m
    while lo <= hi:
        mid = (lo + hi) // 2
        trials.append(trial(ranks, m * mid, args))
        if trials[-1]["fits"]:
            best, lo = m * mid, mid + 1
        else:
            hi = mid - 1
    return best, trials


def header(args: argparse.Namespace) -> dict:
    env = environment(parallelkit=pk.__version__, library=library_state())
    load = os.getloadavg()
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "setup")}
    return {"command": command_line(), "env": env, "load_at_end": [round(v, 2) for v in load],
            "setup": asdict(args.setup), "settings": settings}  # fmt: skip


def env_line(record: dict) -> str:
    e = record["env"]
    return (
        f"`{record['command']}`\n\n{e['date']}; {e['cpu']} x {e['nproc']}; Python {e['python']}, "
        f"torch {e['torch']}, parallelkit {e['parallelkit']} ({e['library']}); load average at "
        f"the end {record['load_at_end'][0]}; ranks' glibc mmap threshold "
        f"{record['settings']['mmap_threshold_kib'] or 'default'} KiB\n"
    )


def above(r: dict) -> float:
    """A rank's peak RSS above its runtime (VmRSS when the step started), MiB."""
    return r["peak_rss_mib"] - r["runtime_rss_mib"]


def memory(args: argparse.Namespace) -> None:
    rows = []
    for side in args.sides:
        for p in args.ranks:
            print(f"{p} rank(s), {side} ...", flush=True)
            rows.append({"side": side, "ranks": p, "per_rank": run_step(args, p, side)})
    record = {**header(args), "rows": rows}
    lines = [
        f"# {args.setup.name}: memory per rank of one training step, blocks read from zarr\n",
        env_line(record),
        "| side | ranks | saved activations per rank, MiB (max) | 1-rank / P | ratio | "
        "peak RSS per rank, MiB (max) | above the runtime (max) | 1-rank / P | ratio | "
        "ratio above the cold runtime | runtime RSS, cold / warm | input block, MiB | "
        "largest extent / whole |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in rows:
        one = next((r for r in rows if r["side"] == row["side"] and r["ranks"] == 1), None)
        per = row["per_rank"]
        worst = max(per, key=lambda r: r["saved_mib"])
        ideal = one["per_rank"][0]["saved_mib"] / row["ranks"] if one else float("nan")
        rss_ideal = above(one["per_rank"][0]) / row["ranks"] if one else float("nan")
        row["ideal_mib"], row["ratio"] = ideal, worst["saved_mib"] / ideal
        row["rss_above_mib"] = max(above(r) for r in per)
        row["rss_ideal_mib"], row["rss_ratio"] = rss_ideal, row["rss_above_mib"] / rss_ideal
        cold = max(r["peak_rss_mib"] - r["cold_rss_mib"] for r in per)
        cold_one = (one["per_rank"][0]["peak_rss_mib"] - one["per_rank"][0]["cold_rss_mib"]
                    if one else float("nan"))  # fmt: skip
        row["rss_cold_ratio"] = cold / (cold_one / row["ranks"])
        lines.append(
            f"| {row['side']} | {row['ranks']} | {worst['saved_mib']:.1f} | {ideal:.1f} | "
            f"{row['ratio']:.3f} | {max(r['peak_rss_mib'] for r in per):.0f} | "
            f"{row['rss_above_mib']:.0f} | {rss_ideal:.0f} | {row['rss_ratio']:.3f} | "
            f"{row['rss_cold_ratio']:.3f} | {max(r['cold_rss_mib'] for r in per):.0f} / "
            f"{max(r['runtime_rss_mib'] for r in per):.0f} | "
            f"{max(r['input_mib'] for r in per):.1f} | "
            f"{max(r['largest_extent'] for r in per):.3f} |"
        )
    lines += layer_table(rows)
    write(args.out_dir / "memory", "\n".join(lines) + "\n", record)


def layer_table(rows: list[dict]) -> list[str]:
    """Saved MiB per layer at the largest side: 1 rank, and P x the worst rank of the most
    ranks (1.00 would be ideal), the layers whose saved bytes do not divide first."""
    side = max(r["side"] for r in rows)
    at = {r["ranks"]: r for r in rows if r["side"] == side}
    if 1 not in at or len(at) < 2:
        return []
    p = max(at)
    one = at[1]["per_rank"][0]["layers_mib"]
    worst = max(at[p]["per_rank"], key=lambda r: r["saved_mib"])["layers_mib"]
    excess = {n: worst.get(n, 0.0) * p - one.get(n, 0.0) for n in set(one) | set(worst)}
    names = sorted(excess, key=lambda n: -excess[n])[:LAYERS_SHOWN]
    lines = [
        f"\nThe {LAYERS_SHOWN} layers whose saved bytes divide worst, at side {side} (saved "
        f"MiB; {p} ranks: the rank that saves most; every layer in the JSON):\n",
        f"| layer | 1 rank | {p} ranks | {p} x ({p} ranks) / (1 rank) |", "|---|---|---|---|",
    ]  # fmt: skip
    for n in names:
        a, b = one.get(n, 0.0), worst.get(n, 0.0)
        lines.append(f"| {n} | {a:.2f} | {b:.2f} | {p * b / a if a else float('inf'):.2f} |")
    return lines


def budget(args: argparse.Namespace) -> None:
    results, trials = {}, []
    for p in args.ranks:
        print(f"largest side within {args.budget_mib:g} MiB per rank, {p} rank(s):", flush=True)
        if args.sides:  # these sides only
            found = [trial(p, side, args) for side in args.sides]
            best = max((t["side"] for t in found if t["fits"]), default=None)
        else:
            best, found = largest_side(p, args)
        results[p], trials = best, trials + found
    record = {**header(args), "largest_side": results, "trials": trials}
    one = results.get(1)
    what = "is predicted whole (eval mode)" if args.predict else "trains"
    lines = [
        f"# {args.setup.name}: the largest {args.setup.noun} side that {what} within "
        f"{args.budget_mib:g} MiB per rank (RLIMIT_DATA), blocks read from zarr\n",
        env_line(record), "| ranks | largest side | vs 1 rank |", "|---|---|---|",
    ]  # fmt: skip
    for p, best in results.items():
        ratio = f"{best / one:.3f}x" if one and best else "-"
        lines.append(f"| {p} | {best or f'< {args.lo}'} | {ratio} |")
    how = "the sides asked for" if args.sides else f"bisection over multiples of {args.multiple}"
    lines += [f"\nTrials ({how}):\n", "| ranks | side | result | s |",
              "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {t['ranks']} | {t['side']} | {t['how']} | {t['seconds']} |" for t in trials]
    write(args.out_dir / ("predict_budget" if args.predict else "budget"),
          "\n".join(lines) + "\n", record)


def write(stem: Path, markdown: str, record: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(markdown)
    print(f"wrote {stem}.md and .json")


def main(setup: Setup, doc: str, out_dir: Path) -> None:
    """The command line of an example's ``measure.py`` (``doc``: its docstring)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="saved activations and peak RSS per rank")
    mem.add_argument("--sides", type=int, nargs="+", default=list(setup.sides))
    mem.add_argument("--ranks", type=int, nargs="+", default=list(setup.ranks))
    mem.set_defaults(func=memory)
    bud = sub.add_parser("budget", help="the largest side within a per-rank memory budget")
    bud.add_argument("--budget-mib", type=float, default=setup.budget_mib)
    bud.add_argument("--ranks", type=int, nargs="+", default=list(setup.budget_ranks))
    bud.add_argument("--lo", type=int, default=setup.lo, help="a side that fits")
    bud.add_argument("--hi", type=int, default=setup.hi, help="the largest side tried")
    bud.add_argument("--multiple", type=int, default=setup.multiple, help="sides tried: k x this")
    bud.add_argument("--sides", type=int, nargs="+", help="try these sides (no bisection)")
    bud.add_argument("--predict", action="store_true", help="a whole-sample prediction "
                     "(parallelkit predict's Predictor) instead of a training step")
    bud.set_defaults(func=budget)
    for p in (mem, bud):
        p.add_argument("--width", type=int, default=setup.width,
                       help="channels of the first stage")  # fmt: skip
        p.add_argument("--timeout", type=float, default=900.0, help="seconds per step")
        p.add_argument("--mmap-threshold-kib", type=float, default=128,
                       help="the ranks' MALLOC_MMAP_THRESHOLD_ (0: glibc's default)")
        p.add_argument("--out-dir", type=Path, default=out_dir)
        p.add_argument("--store-dir", type=Path, default=ROOT / "runs" / "stores",
                       help="where the generated zarr stores are written, one per side")
    args = parser.parse_args()
    args.setup = setup
    args.predict = getattr(args, "predict", False)
    args.func(args)
