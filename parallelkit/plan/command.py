"""``parallelkit plan``: which grid to train a model on, before spending the ranks.

    parallelkit plan --model resnet18 --image-size 224 --batch 8 --ranks 4
    parallelkit plan --model resnet50 --image-size 512 --batch 64 --ranks 8 --preset nvlink4
    parallelkit plan --model dcgan --image-size 64 --batch 16 --ranks 2 --json plan.json
    parallelkit plan --model timm:resnet26d --image-size 224 --batch 32 --ranks 4 \\
        --bandwidth 25 --latency 2 --flop-rate 20000

Compute is measured here on one rank (each layer's forward and backward at the real size, a
few seconds), and so is the memory a real step takes beyond its tensors (one 1-rank step in
a fresh process), unless ``--flop-rate`` (GFLOP/s of a device not at hand) is given. The network is
probed here between two local ranks (a few seconds) unless ``--preset`` or ``--bandwidth`` and
``--latency`` describe one. With the probe, the ranks share this machine's cores; otherwise
each rank is taken to have a device of its own (``--cores`` overrides either).

Prints the ranked table and the recommendation; ``--json PATH`` writes the plan. Exit status
2 with one line on stderr for a mistake (an unknown model, a zoo library that does not import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from parallelkit.plan import measure, network, walk
from parallelkit.plan.cost import Machine, calibrate
from parallelkit.plan.planner import Plan, plan, table

PROG = "parallelkit plan"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument(
        "--model", required=True, help=f"{', '.join(walk.BUILTIN)}, torchvision:NAME or timm:NAME"
    )
    p.add_argument("--image-size", type=int, required=True, help="H = W, pixels")
    p.add_argument("--batch", type=int, required=True, help="global batch (all ranks)")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--stem", default="imagenet", choices=("imagenet", "cifar"), help="ResNet stem")
    p.add_argument("--classes", type=int, default=10)
    net = p.add_argument_group("network (default: probed here)")
    net.add_argument("--preset", choices=sorted(network.PRESETS))
    net.add_argument("--bandwidth", type=float, help="GB/s per direction (with --latency)")
    net.add_argument("--latency", type=float, help="microseconds per message (with --bandwidth)")
    comp = p.add_argument_group("compute (default: measured here)")
    comp.add_argument("--flop-rate", type=float, help="GFLOP/s of one rank's device")
    comp.add_argument("--byte-rate", type=float, help="GB/s of its memory (default: GFLOP/s / 10)")
    comp.add_argument(
        "--cores", type=float, help="cores the ranks share (default: this machine's with the probe)"
    )
    comp.add_argument(
        "--baseline-mib", type=float, help="a rank's memory before the model (default: measured)"
    )
    p.add_argument("--json", type=Path, help="write the plan here")
    args = p.parse_args(argv)
    if (args.bandwidth is None) != (args.latency is None):
        p.error("--bandwidth and --latency go together")
    if args.preset and args.bandwidth is not None:
        p.error("--preset or --bandwidth/--latency, not both")
    return args


def link_of(args: argparse.Namespace) -> network.Network:
    if args.preset:
        return network.PRESETS[args.preset]
    if args.bandwidth is not None:
        return network.given(args.latency, args.bandwidth)
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


def make_plan(args: argparse.Namespace) -> Plan:
    """Walk, measure (or count), probe (or take) the network, and plan."""
    for name in ("image_size", "batch", "ranks"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    nets = walk.build(args.model, args.image_size, args.classes, args.stem)
    if args.flop_rate:
        byte_rate = (args.byte_rate or args.flop_rate / 10) * 1e9
        profiles = [measure.from_flops(n, args.flop_rate * 1e9, byte_rate) for n in nets]
    else:
        import torch

        torch.set_num_threads(1)  # one compute thread per rank, as the training runs
        small = max(1, args.batch // args.ranks)  # the smallest per-rank batch of any grid
        profiles = [measure.measure(n, small) for n in nets]
    link = link_of(args)
    cores = (
        args.cores if args.cores is not None else (os.cpu_count() if link.shares_cores else None)
    )
    base = args.baseline_mib if args.baseline_mib is not None else baseline_mib()
    machine = Machine(cores=cores, baseline_mib=base)
    if not args.flop_rate:  # this machine: calibrate the memory model on one rank
        b = max(1, args.batch // args.ranks)
        peak = measure.peak_mib(args.model, args.image_size, args.classes, args.stem, b)
        machine = calibrate(nets, b, machine, peak)
    return plan(nets, profiles, args.batch, args.ranks, link, machine, args.model, args.image_size)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        p = make_plan(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(table(p))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(p.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
