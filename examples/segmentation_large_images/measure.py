"""Memory per rank of a U-Net training step on large images, and the largest image that trains
within a per-rank memory budget, on 1 rank and on P ranks splitting each image by rows.

    python examples/segmentation_large_images/measure.py memory               # table 1
    python examples/segmentation_large_images/measure.py budget               # table 2
    python examples/segmentation_large_images/measure.py memory --sides 128 --ranks 1 2 \
        --out-dir /tmp/seg                                                    # a smoke test

One step is what ``parallelkit train train.task=segment`` does on a batch of one image: the
library's U-Net (``--width`` channels in the first stage, 4 classes) on a generated shapes
scene, per-pixel cross-entropy on this rank's block of the logits (``spatial_output="blocks"``:
the logits are never gathered), backward, an SGD step. One rank runs the plain torch model (the
reference, without parallelkit); P ranks run ``pk.parallelize(model, grid, "spatial")``.

Every measurement starts fresh processes (:class:`parallelkit.testing.Ranks`: gloo ranks, one
thread each, a deadline; a rank that fails brings the others down), so a rank's peak resident
set size is that of one step. What is measured on each rank:

    saved       every storage autograd keeps for backward (counted once, parameters left out),
                through ``torch.autograd.graph.saved_tensors_hooks``: the activation memory,
                exact and repeatable; also per layer (the leaf module that saved it first)
    peak RSS    ``ru_maxrss`` after the step: the torch runtime and gloo, the weights, the data,
                the activations, the gradients in flight, what the allocator keeps

The budget: every rank sets its soft RLIMIT_DATA (``resource.setrlimit``) before it draws its
data and builds its model (the runtime, already loaded, counts against it too), and lifts it
after the step, so that a rank that ran out can still report. RLIMIT_DATA caps the private
writable memory a process maps (heap and anonymous mappings, thread stacks); an allocation
beyond it fails (torch: "can't allocate memory" or std::bad_alloc, Python: MemoryError), that
rank raises, and the others, waiting in a collective, are killed. The largest side that trains
is found by bisection over multiples of 64.

Results: ``memory.md``/``.json`` and ``budget.md``/``.json`` in ``--out-dir`` (this folder).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit import models
from parallelkit.comm import tensor_split_sizes
from parallelkit.data.shapes import ShapesDataset, draw_image, draw_mask
from parallelkit.testing import RankError, Ranks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
from _common import command_line, environment, library_state  # noqa: E402

MIB = 2**20
CLASSES = 4
LAYERS_SHOWN = 10
# How a failed allocation shows in a rank's traceback (torch's CPU allocator, C++, Python, and
# oneDNN when it cannot allocate a convolution's workspace); any other failure is raised.
OUT_OF_MEMORY = (
    "can't allocate memory", "not enough memory", "Cannot allocate memory", "bad_alloc",
    "MemoryError", "could not create a primitive",
)  # fmt: skip


# ---------------------------------------------------------------------------- on every rank
def status_kib(key: str) -> int:
    """A ``/proc/self/status`` entry in KiB (VmRSS, VmData, ...)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def draw(side: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Scene 0 of the shapes data at ``side``: the whole (1, 3, side, side) image and this
    rank's rows of the (1, side, side) mask. The image is drawn in bands of 256 rows (the same
    pixels as ``ShapesDataset``, which draws it at once), so that the float64 temporaries of
    drawing do not outweigh the step being measured."""
    ds = ShapesDataset(1, side, num_classes=CLASSES)
    scene, whole = ds.scene(0), slice(0, side)
    image = torch.empty(3, side, side)
    for r0 in range(0, side, 256):
        band = slice(r0, min(side, r0 + 256))
        image[:, band] = draw_image(scene, side, (band, whole), CLASSES)
    return image[None], draw_mask(scene, side, (rows, whole))[None]


def step(comm: pk.Communicator, side: int, width: int, budget_mib: float | None = None) -> dict:
    """One training step on this rank within ``budget_mib`` (the soft RLIMIT_DATA, lifted
    again afterwards, so that a rank that ran out can still report it); what it measured."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if budget_mib is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (int(budget_mib * MIB), hard))
    try:
        return measured_step(comm, side, width)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def measured_step(comm: pk.Communicator, side: int, width: int) -> dict:
    data_kib = status_kib("VmData")
    runtime_kib = status_kib("VmRSS")
    p = comm.size
    sizes = tensor_split_sizes(side, p)
    start = sum(sizes[: comm.rank])
    x, mask = draw(side, slice(start, start + sizes[comm.rank]))
    torch.manual_seed(0)
    model = models.create("unet", num_classes=CLASSES, widths=[width * 2**i for i in range(4)])
    if p > 1:
        grid = pk.Grid(comm, rows=p)
        model = pk.parallelize(model, grid, grid, spatial_output="blocks")
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

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)  # this rank's block: (1, classes, rows, side)
        running.append("loss")
        part = F.cross_entropy(logits, mask, reduction="sum")  # over this rank's block
        loss = pkf.reduce_from_group(part, comm) / side**2  # the mean over the whole image
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
        "loss": loss.item(),
    }


# ---------------------------------------------------------------------------- the parent
def run_step(ranks: int, side: int, width: int, budget_mib=None, timeout=900.0) -> list[dict]:
    """:func:`step` on ``ranks`` fresh local processes; every rank's result."""
    with Ranks(ranks, backend="gloo" if ranks > 1 else "local", comm_timeout=timeout) as pool:
        return pool.run(step, side, width, budget_mib, timeout=timeout)


def fits(ranks: int, side: int, width: int, budget_mib: float, timeout: float) -> tuple[bool, str]:
    """Whether a step at ``side`` trains on ``ranks`` ranks within the budget, and how it
    ended. A rank that runs out of memory fails the step; any other error is raised."""
    try:
        rows = run_step(ranks, side, width, budget_mib, timeout)
    except RankError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if oom := [ln for ln in lines if any(s in ln for s in OUT_OF_MEMORY)]:
            return False, oom[0]
        if "died" in lines[0]:  # killed without a word (by the kernel's OOM killer?)
            return False, lines[0]
        raise
    return True, f"trains, peak RSS {max(r['peak_rss_mib'] for r in rows):.0f} MiB"


def trial(ranks: int, side: int, args: argparse.Namespace) -> dict:
    """One step at ``side`` on ``ranks`` ranks within the budget: how it ended."""
    started = time.perf_counter()
    ok, how = fits(ranks, side, args.width, args.budget_mib, args.timeout)
    print(f"  {ranks} rank(s), {side}^2: {how}", flush=True)
    seconds = round(time.perf_counter() - started, 1)
    return {"ranks": ranks, "side": side, "fits": ok, "how": how, "seconds": seconds}


def largest_side(ranks: int, args: argparse.Namespace) -> tuple[int | None, list[dict]]:
    """Bisection over multiples of 64 in [lo, hi]: the largest side that fits; the trials."""
    trials, best = [], None
    lo, hi = args.lo // 64, args.hi // 64  # a side that fits: every smaller one fits too
    while lo <= hi:
        mid = (lo + hi) // 2
        trials.append(trial(ranks, 64 * mid, args))
        if trials[-1]["fits"]:
            best, lo = 64 * mid, mid + 1
        else:
            hi = mid - 1
    return best, trials


def header(args: argparse.Namespace) -> dict:
    env = environment(parallelkit=pk.__version__, library=library_state())
    load = os.getloadavg()
    return {"command": command_line(), "env": env, "load_at_end": [round(v, 2) for v in load],
            "settings": {k: v for k, v in vars(args).items() if k != "func"}}  # fmt: skip


def env_line(record: dict) -> str:
    e = record["env"]
    return (
        f"`{record['command']}`\n\n{e['date']}; {e['cpu']} x {e['nproc']}; Python {e['python']}, "
        f"torch {e['torch']}, parallelkit {e['parallelkit']} ({e['library']}); load average at "
        f"the end {record['load_at_end'][0]}\n"
    )


def memory(args: argparse.Namespace) -> None:
    rows = []
    for side in args.sides:
        for p in args.ranks:
            print(f"{p} rank(s), {side}^2 ...", flush=True)
            results = run_step(p, side, args.width, timeout=args.timeout)
            rows.append({"side": side, "ranks": p, "per_rank": results})
    record = {**header(args), "rows": rows}
    lines = [
        f"# U-Net (width {args.width}) training step: memory per rank\n", env_line(record),
        "| side | ranks | saved activations per rank, MiB (max) | 1-rank / P | ratio | "
        "peak RSS per rank, MiB (max) | runtime RSS before the step |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in rows:
        one = next((r for r in rows if r["side"] == row["side"] and r["ranks"] == 1), None)
        worst = max(row["per_rank"], key=lambda r: r["saved_mib"])
        ideal = one["per_rank"][0]["saved_mib"] / row["ranks"] if one else float("nan")
        row["ideal_mib"], row["ratio"] = ideal, worst["saved_mib"] / ideal
        lines.append(
            f"| {row['side']} | {row['ranks']} | {worst['saved_mib']:.1f} | {ideal:.1f} | "
            f"{row['ratio']:.3f} | "
            f"{max(r['peak_rss_mib'] for r in row['per_rank']):.0f} | "
            f"{max(r['runtime_rss_mib'] for r in row['per_rank']):.0f} |"
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
        f"\nThe {LAYERS_SHOWN} layers whose saved bytes divide worst, at {side}^2 (saved MiB; "
        f"{p} ranks: the rank that saves most; every layer in the JSON):\n",
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
    lines = [
        f"# U-Net (width {args.width}): the largest image side that trains within "
        f"{args.budget_mib:g} MiB per rank (RLIMIT_DATA)\n", env_line(record),
        "| ranks | largest side | vs 1 rank |", "|---|---|---|",
    ]  # fmt: skip
    for p, best in results.items():
        ratio = f"{best / one:.2f}x" if one and best else "-"
        lines.append(f"| {p} | {best or f'< {args.lo}'} | {ratio} |")
    how = "the sides asked for" if args.sides else "bisection over multiples of 64"
    lines += [f"\nTrials ({how}):\n", "| ranks | side | result | s |",
              "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {t['ranks']} | {t['side']} | {t['how']} | {t['seconds']} |" for t in trials]
    write(args.out_dir / "budget", "\n".join(lines) + "\n", record)


def write(stem: Path, markdown: str, record: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(markdown)
    print(f"wrote {stem}.md and .json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="saved activations and peak RSS per rank")
    mem.add_argument("--sides", type=int, nargs="+", default=[1024, 2048])
    mem.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    mem.set_defaults(func=memory)
    bud = sub.add_parser("budget", help="the largest side within a per-rank memory budget")
    bud.add_argument("--budget-mib", type=float, default=1536)
    bud.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    bud.add_argument("--lo", type=int, default=512, help="a side that fits")
    bud.add_argument("--hi", type=int, default=3072, help="the largest side tried")
    bud.add_argument("--sides", type=int, nargs="+", help="try these sides (no bisection)")
    bud.set_defaults(func=budget)
    for p in (mem, bud):
        p.add_argument("--width", type=int, default=8, help="U-Net channels of the first stage")
        p.add_argument("--timeout", type=float, default=900.0, help="seconds per step")
        p.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
