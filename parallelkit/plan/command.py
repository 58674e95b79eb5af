"""``parallelkit plan``: which grid to train a model on, before spending the ranks.

    parallelkit plan --model resnet18 --image-size 224 --batch 8 --ranks 4
    parallelkit plan --model resnet50 --image-size 1024 --batch 8 --ranks 8 --device h100-sxm
    parallelkit plan --model dcgan --image-size 64 --batch 16 --ranks 2 --json plan.json
    parallelkit plan --model timm:resnet26d --image-size 224 --batch 32 --ranks 4 \\
        --bandwidth 25 --latency 2 --flop-rate 20000
    parallelkit plan --model monai:UNet --image-size 256 --channels 1 --classes 3 \\
        --model-kwargs "{channels: [16, 32, 64], strides: [2, 2]}" \\
        --batch 2 --ranks 8 --device h100-sxm --blocks-in

``parallelkit plan --config RUN.yaml [key=value ...] [--device ...]`` plans a training config:
its model, crop (``data.image_size``), channels, classes, global batch and ``parallel.ranks``
(``--blocks-in`` for a ``FORMAT:DIR`` reader), and ends with the ``parallel.*`` overrides that
train on the recommended grid.

Samples are images unless told: ``--image-size S`` is a square; with ``--dims 3`` (the default
for ``monai:NAME``) a cube of side S; ``--image-size D H W`` (or ``H W``) gives every side.
Volumes are planned on grids with a ``depth`` dimension too (data x depth x rows x cols).
``--blocks-in`` plans ``pk.parallelize(..., spatial_input="blocks")`` (what ``parallelkit train``
does with a block reader, ``data.name=FORMAT:DIR``): a rank holds only its block of every input
and label, and a per-pixel output stays split; the table then shows each grid's memory with
whole samples beside it.

Compute is measured here on one rank (each layer's forward and backward, a few seconds): at
the real size where that is cheap, otherwise at a smaller image (halved until it is) and
scaled to the real size by each layer's operation counts; so is the memory a real step takes
beyond its tensors (one 1-rank step in a fresh process, at the profiled size). For a device
not at hand, ``--device`` (a datasheet preset: parallelkit/plan/devices.py) or
``--flop-rate`` (GFLOP/s) count the compute instead, and ``--device`` (or ``--memory-gib``)
marks grids that need more memory per rank than the device has. The network is probed here
between two local ranks (a few seconds) unless ``--preset``, ``--bandwidth`` and
``--latency``, or ``--device`` (its usual interconnect) describe one. With the probe, the
ranks share this machine's cores; otherwise each rank is taken to have a device of its own
(``--cores`` overrides either).

Progress goes to stderr, a line per stage. Prints the ranked table and the recommendation;
``--json PATH`` writes the plan. Exit status 2 with one line on stderr for a mistake (an
unknown model, a zoo library that does not import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from parallelkit.plan import devices, measure, network, walk
from parallelkit.plan.cost import calibrate
from parallelkit.plan.machine import Machine
from parallelkit.plan.measure import Profile
from parallelkit.plan.planner import Plan, plan, table
from parallelkit.plan.walk import Net

PROG = "parallelkit plan"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument(
        "--config",
        metavar="RUN.yaml",
        help="plan a training config instead (a run's config.yaml, key=value overrides after "
        "it): its model (built-in, a zoo network or your own package.module:Class), crop, "
        "channels, classes, batch and parallel.ranks; then --model and the sizes are not given",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"{', '.join(walk.BUILTIN)}, torchvision:NAME, timm:NAME, monai:NAME, smp:ARCH "
        "or your own package.module:Class",
    )
    p.add_argument(
        "--model-kwargs",
        type=model_kwargs,
        default={},
        help="the model's constructor arguments, as train's model.kwargs: "
        '"{channels: [16, 32, 64], strides: [2, 2]}" for monai:UNet',
    )
    p.add_argument(
        "--image-size",
        type=int,
        nargs="+",
        required=True,
        metavar="SIDE",
        help="pixels: one side (a square, or a cube with --dims 3), or every side: H W or D H W",
    )
    p.add_argument(
        "--dims",
        type=int,
        choices=(1, 2, 3),
        help="spatial dimensions of a sample with one --image-size side: 2 images, 3 volumes, "
        "1 signals (default: 3 for monai:NAME, else 2)",
    )
    p.add_argument("--channels", type=int, default=3, help="input channels")
    p.add_argument("--batch", type=int, required=True, help="global batch (all ranks)")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument(
        "--blocks-in",
        action="store_true",
        help="each rank passes only its block of every input and label "
        "(pk.parallelize's spatial_input='blocks'); default: whole samples on every rank",
    )
    p.add_argument("--stem", default="imagenet", choices=("imagenet", "cifar"), help="ResNet stem")
    p.add_argument("--classes", type=int, default=10)
    net = p.add_argument_group("network (default: --device's interconnect, or probed here)")
    net.add_argument("--preset", choices=sorted(network.PRESETS), help="an interconnect")
    net.add_argument("--bandwidth", type=float, help="GB/s per direction (with --latency)")
    net.add_argument("--latency", type=float, help="microseconds per message (with --bandwidth)")
    comp = p.add_argument_group("compute (default: measured here, at a reduced image size)")
    comp.add_argument(
        "--device",
        choices=sorted(devices.DEVICES),
        help="one rank's accelerator, from its datasheet: bf16 FLOP/s, memory GB/s and size",
    )
    comp.add_argument(
        "--flop-rate",
        type=float,
        help="GFLOP/s (1e9 FLOP/s) of one rank's device, e.g. 312000 for 312 TFLOP/s "
        "(overrides --device's)",
    )
    comp.add_argument(
        "--byte-rate", type=float, help="GB/s of its memory (default: --device's, or GFLOP/s / 10)"
    )
    comp.add_argument(
        "--memory-gib",
        type=float,
        help="GiB of one rank's device; grids needing more are marked as not fitting "
        "(default: --device's; otherwise not checked)",
    )
    comp.add_argument(
        "--cores", type=float, help="cores the ranks share (default: this machine's with the probe)"
    )
    comp.add_argument(
        "--baseline-mib",
        type=float,
        help="a rank's memory before the model (default: measured; 0 with --device)",
    )
    p.add_argument("--json", type=Path, help="write the plan here")
    args = p.parse_args(argv)
    if (args.bandwidth is None) != (args.latency is None):
        p.error("--bandwidth and --latency go together")

    if args.preset and args.bandwidth is not None:
        p.error("--preset or --bandwidth/--latency, not both")
    if len(args.image_size) > 3 or (
        args.dims is not None and len(args.image_size) > 1 and args.dims != len(args.image_size)
    ):
        p.error("--image-size takes one side, or 2 (H W) or 3 (D H W) matching --dims")
    return args


def check(args: argparse.Namespace) -> None:
    """What can be refused before any profiling (``ValueError``): rates and sizes that are not
    positive, and a model or ``--model-kwargs`` that does not build (on the meta device)."""
    for name in ("bandwidth", "latency", "flop_rate", "byte_rate", "memory_gib", "cores"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if args.batch < 1 or args.ranks < 1 or min(args.image_size) < 1:
        raise ValueError("--batch, --ranks and --image-size must be at least 1")
    size = sample_size(args)
    try:
        walk.build(args.model, size, args.classes, args.stem, args.channels, dims=len(size),
                   kwargs=args.model_kwargs)  # fmt: skip
    except TypeError as e:  # the model's own constructor refusing a keyword
        raise ValueError(str(e).splitlines()[0]) from None


def model_kwargs(text: str) -> dict[str, Any]:
    """``--model-kwargs``: a YAML mapping, spelt as ``parallelkit train``'s ``model.kwargs``."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at column {where.column + 1}" if where is not None else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is not YAML{at}: {getattr(e, 'problem', None) or e}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mapping such as '{{width: 32}}'")
    return value


def sample_size(args: argparse.Namespace) -> walk.Shape:
    """The sample's spatial size: every side given, or one side over ``--dims`` dimensions
    (by default the model's: :func:`parallelkit.plan.walk.default_dims`)."""
    if len(args.image_size) > 1:
        return tuple(args.image_size)
    dims = args.dims or walk.default_dims(args.model, args.model_kwargs)
    return walk.sample_shape(args.image_size[0], dims)


def walk_at(args: argparse.Namespace, size: walk.Shape) -> list[Net]:
    """The model's networks walked at spatial ``size``."""
    return walk.build(args.model, size, args.classes, args.stem, args.channels,
                      dims=len(size), kwargs=args.model_kwargs)  # fmt: skip


def size_text(size: walk.Shape) -> str:
    return "x".join(map(str, size))


def link_of(args: argparse.Namespace) -> network.Network:
    if args.preset:
        return network.PRESETS[args.preset]
    if args.bandwidth is not None:
        return network.given(args.latency, args.bandwidth)
    if args.device:
        return network.PRESETS[devices.DEVICES[args.device].link]
    return network.probe()


def baseline_mib() -> float:
    """Peak resident memory of a process that imports parallelkit and runs one small
    convolution forward and backward (which loads torch's CPU kernels): what every rank
    holds before its model."""
    # VmHWM, not ru_maxrss: Linux carries the parent's peak into a child's ru_maxrss.
    code = (
        "import re, torch, parallelkit\n"
        "c = torch.nn.Conv2d(3, 8, 3); c(torch.randn(1, 3, 8, 8)).sum().backward()\n"
        "status = open('/proc/self/status').read()\n"
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', status).group(1)) / 1024)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout)


def progress_lines() -> Callable[[str], None]:
    """A function printing one progress line on stderr, with the seconds since this call."""
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"{PROG}: [{time.perf_counter() - start:5.1f} s] {line}", file=sys.stderr, flush=True)

    return say


def measured_here(
    args: argparse.Namespace, nets: list[Net], machine: Machine, progress: Callable[[str], None]
) -> tuple[list[Profile], Machine]:
    """Each network's profile on this process, and ``machine`` with the memory measured here.

    Profiled at a reduced size where the real one would take long
    (:func:`measure.reduced_size`) and carried to the real size by the operation counts
    (:func:`measure.scaled`). Meanwhile two fresh processes measure, on the other core, a bare
    rank's memory and a 1-rank step's peak at the profiled size (which calibrates the memory
    model); the profile counts CPU time, so they do not disturb it.
    """
    import torch

    torch.set_num_threads(1)  # one compute thread per rank, as the training runs
    b = max(1, args.batch // args.ranks)  # the smallest per-rank batch of any grid
    real = sample_size(args)
    size = min(measure.reduced_shape(n, real, b) for n in nets)
    small = nets
    if size != real:
        try:
            small = walk_at(args, size)
        except ValueError:  # a network that does not run at that size (a U-Net's odd side)
            small = []
        if len(small) != len(nets) or not all(map(measure.same_layers, nets, small)):
            progress(f"{args.model}'s layers change with the sample size: profiled at full size")
            size, small = real, nets
    with ThreadPoolExecutor(2) as pool:
        progress(f"measuring a bare rank's memory and a 1-rank step's at {size_text(size)}")
        base = pool.submit(baseline_mib) if args.baseline_mib is None else None
        peak = pool.submit(measure.peak_mib, args.model, size, args.classes, args.stem, b,
                           channels=args.channels, kwargs=args.model_kwargs)  # fmt: skip
        scaling = f", scaled to {size_text(real)}" if size != real else ""
        progress(f"profiling {b} sample(s) at {size_text(size)} on one core here{scaling}")
        profiles = []
        for full, net in zip(nets, small, strict=True):
            prof = measure.measure(net, b)
            profiles.append(prof if net is full else measure.scaled(prof, net, full))
        if base is not None:
            machine = replace(machine, baseline_mib=base.result())
        machine = calibrate(small, b, machine, peak.result())
    return profiles, machine


def counted_profiles(args: argparse.Namespace, nets: list[Net]) -> list[Profile]:
    """Profiles from FLOPs and bytes at the rates of ``--device``, ``--flop-rate`` and
    ``--byte-rate`` (the last two override the first)."""
    device = devices.DEVICES.get(args.device or "")
    flop_rate = args.flop_rate * 1e9 if args.flop_rate else device.flop_rate
    if args.byte_rate:
        byte_rate = args.byte_rate * 1e9
    else:
        byte_rate = device.byte_rate if device and not args.flop_rate else flop_rate / 10
    profiles = [measure.from_flops(n, flop_rate, byte_rate) for n in nets]
    if device and not args.flop_rate and not args.byte_rate:
        source = f"{device.name} datasheet, {flop_rate / 1e12:g} TFLOP/s bf16 peak"
        profiles = [replace(prof, source=source) for prof in profiles]
    return profiles


def quiet(line: str) -> None:
    """No progress lines."""


def make_plan(args: argparse.Namespace, progress: Callable[[str], None] = quiet) -> Plan:
    """Walk, measure (or count), probe (or take) the network, and plan; ``progress`` gets a
    line as each stage starts."""
    for name in ("batch", "ranks", "channels", "flop_rate", "byte_rate", "memory_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if min(args.image_size) <= 0:
        raise ValueError("--image-size must be positive")
    device = devices.DEVICES[args.device] if args.device else None
    size = sample_size(args)
    progress(f"walking {args.model} at {size_text(size)}")
    nets = walk_at(args, size)
    machine = Machine(
        baseline_mib=args.baseline_mib or 0.0,  # with --device: the host's memory is not on it
        device_mib=args.memory_gib * 1024 if args.memory_gib else device and device.memory_mib,
    )
    if args.flop_rate or device:
        profiles = counted_profiles(args, nets)
        if args.baseline_mib is None and not device:
            progress("measuring a bare rank's memory")
            machine = replace(machine, baseline_mib=baseline_mib())
    else:
        profiles, machine = measured_here(args, nets, machine, progress)
    if not (args.preset or args.bandwidth is not None or device):
        progress("probing the network between two local ranks")
    link = link_of(args)
    cores = args.cores
    if cores is None and link.shares_cores and not device:
        cores = os.cpu_count()
    machine = replace(machine, cores=cores)
    return plan(nets, profiles, args.batch, args.ranks, link, machine, args.model, size,
                blocks_in=args.blocks_in)  # fmt: skip


def from_config(argv: list[str]) -> list[str]:
    """``--config RUN.yaml [key=value ...]``: the plan's arguments for that training config (its
    model, crop, channels, classes, global batch and ``parallel.ranks``; ``--blocks-in`` for a
    block reader), followed by the rest of ``argv`` (``--device h100-sxm``, ...)."""
    from parallelkit.data.config import crop_shape
    from parallelkit.train import config

    i = argv.index("--config")
    path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    cfg = config.load(path, overrides)
    model, data = cfg.model, cfg.data
    out = [
        "--model", model.name, "--image-size", *map(str, crop_shape(data)),
        "--channels", str(data.channels), "--classes", str(data.num_classes),
        "--batch", str(cfg.train.batch_size), "--ranks", str(cfg.parallel.ranks),
        "--model-kwargs", yaml.safe_dump(dict(model.kwargs), default_flow_style=True).strip(),
    ]  # fmt: skip
    if model.name.startswith("resnet"):
        out += ["--stem", model.stem]
    if data.source.is_block_folder:
        out.append("--blocks-in")
    return out + [a for a in rest if a not in overrides]


def overrides_of(p: Plan) -> str:
    """The ``parallel.*`` overrides that train on the plan's recommended grid."""
    o = p.recommended.option
    strategy = o.strategy if o.strategy != "dense" else "data"
    grid = (f"parallel.{k}={v}" for k, v in o.as_dict().items() if k != "data")
    return f"parallel.ranks={o.ranks} parallel.strategy={strategy} {' '.join(grid)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(from_config(argv) if "--config" in argv else argv)
        check(args)
        p = make_plan(args, progress_lines())
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(table(p))
    if p.recommended.feasible:
        print(f"train on it with: {overrides_of(p)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(p.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
