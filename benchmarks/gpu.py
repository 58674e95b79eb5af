"""GPU numbers on one GPU: what a spatial layer's halo costs, and parallelkit next to torch.

    python benchmarks/gpu.py                  # on a CUDA machine: benchmarks/results/gpu.md/.json
    python benchmarks/gpu.py --device cpu --quick   # smoke run of the script itself, anywhere

One process, world size 1 (``pk.init("nccl")`` on a one-rank group). Four parts:

1. spatial  a 3x3 convolution, padding 1, 64 -> 64 channels, batch 1, bf16, at 2048^2 and
            4096^2. Forward + backward time of the dense layer, and of one rank's share on P
            ranks (the band of H/P rows plus its halo rows, convolved without padding rows).
            Halo bytes per rank and step come from the geometry (``received_rows``: the rows
            a band fetches, forward, and sends back, backward); the exchange time is the cost
            model ``2 x (latency + bytes / bandwidth)`` at NVLink and InfiniBand figures. The
            ratio exchange / compute says where the split pays without overlap.
2. syncbn   parallelkit's SyncBatchNorm against torch.nn.SyncBatchNorm on the same shapes,
            forward + backward. At world size 1 both take their one-rank paths.
3. dp       DataParallel against DistributedDataParallel, a ResNet-50 step (forward, backward,
            SGD), batch 32 at 224^2, world size 1.
4. resnet50 one ResNet-50 training step per strategy under ``pk.parallelize`` at world size 1
            (data, spatial, channel): the overhead of each wrapper over the plain model.

Timing: ``--warmup`` untimed steps, then the median of ``--repeats`` timed steps, each step
ended by ``torch.cuda.synchronize()`` (CUDA events would split hairs finer than the spread).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
from parallelkit.geometry import blocks, received_rows

from _common import environment, save

# name -> (latency s, bandwidth B/s): per direction, per GPU, as vendors state them.
LINKS = {
    "NVLink 4 (H100, 450 GB/s)": (3e-6, 450e9),
    "InfiniBand NDR (50 GB/s)": (5e-6, 50e9),
    "InfiniBand HDR (25 GB/s)": (5e-6, 25e9),
}


@dataclass
class Config:
    device: str = "cuda"
    sides: tuple[int, ...] = (2048, 4096)
    ranks: tuple[int, ...] = (2, 4, 8)
    channels: int = 64
    warmup: int = 3
    repeats: int = 10
    quick: bool = False


def timed(step: Callable[[], object], cfg: Config) -> float:
    """Median seconds of one ``step``."""
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    for _ in range(cfg.warmup):
        step()
    sync()
    times = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def conv_step(x: torch.Tensor, conv: nn.Conv2d, padding: tuple[int, int]) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        y = F.conv2d(x, conv.weight, conv.bias, padding=padding)
        y.backward(torch.ones_like(y))

    return step


def spatial(cfg: Config) -> list[dict]:
    rows = []
    c, dtype = cfg.channels, torch.bfloat16
    conv = nn.Conv2d(c, c, 3, padding=1).to(cfg.device, dtype)
    for side in cfg.sides:
        x = torch.randn(1, c, side, side, device=cfg.device, dtype=dtype, requires_grad=True)
        dense = timed(conv_step(x, conv, (1, 1)), cfg)
        rows.append(dict(part="spatial", side=side, ranks=1, compute_ms=dense * 1e3))
        for p in cfg.ranks:
            # The largest band with its halo (one row each side inside the image).
            bands = blocks(side, p)
            want = [(a - 1, b + 1) for a, b in bands]
            halo_rows = max(received_rows([b - a for a, b in bands], want))
            band = bands[0][1] - bands[0][0] + halo_rows
            xb = torch.randn(1, c, band, side, device=cfg.device, dtype=dtype, requires_grad=True)
            share = timed(conv_step(xb, conv, (0, 1)), cfg)
            halo_bytes = halo_rows * side * c * x.element_size()  # one direction, one step
            row = dict(
                part="spatial", side=side, ranks=p, compute_ms=share * 1e3,
                speedup_compute=dense / share, halo_rows=halo_rows, halo_mib=halo_bytes / 2**20,
            )  # fmt: skip
            for link, (latency, bandwidth) in LINKS.items():
                # Forward fetch and backward return, each latency + bytes / bandwidth.
                exchange = 2 * (latency + halo_bytes / bandwidth)
                row[f"exchange_ms {link}"] = exchange * 1e3
                row[f"speedup {link}"] = dense / (share + exchange)
            rows.append(row)
    return rows


def syncbn(cfg: Config, comm: pk.Communicator) -> list[dict]:
    rows = []
    shapes = [(32, 64, 112, 112), (32, 256, 56, 56)] if not cfg.quick else [(4, 8, 16, 16)]
    for shape in shapes:
        x = torch.randn(shape, device=cfg.device, requires_grad=True)
        ours = pk.nn.SyncBatchNorm(shape[1], comm=comm).to(cfg.device)
        theirs = nn.SyncBatchNorm(shape[1]).to(cfg.device)
        row = dict(part="syncbn", shape=str(shape))
        for name, layer in (("parallelkit", ours), ("torch", theirs)):

            def step(layer: nn.Module = layer, x: torch.Tensor = x) -> None:
                x.grad = None
                layer(x).sum().backward()

            try:
                row[f"{name}_ms"] = timed(step, cfg) * 1e3
            except (ValueError, RuntimeError) as e:  # torch's refuses to train on the CPU
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = str(e).splitlines()[0]
        rows.append(row)
    return rows


def resnet50(cfg: Config):
    from parallelkit.models import resnet50 as build

    return build(num_classes=1000).to(cfg.device).to(memory_format=torch.channels_last)


def train_step(model: nn.Module, cfg: Config, batch: int, side: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, side, side, device=cfg.device).contiguous(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (batch,), device=cfg.device)
    amp = torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def data_parallel(cfg: Config, comm: pk.Communicator) -> list[dict]:
    batch, side = (32, 224) if not cfg.quick else (2, 64)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(resnet50(cfg))
    ours = pk.parallel.DataParallel(resnet50(cfg), comm)
    times = {
        name: timed(train_step(model, cfg, batch, side), cfg)
        for name, model in (("DDP", ddp), ("DataParallel", ours))
    }
    ms = {f"{k}_ms": v * 1e3 for k, v in times.items()}
    return [
        dict(part="dp", batch=batch, side=side, **ms, ratio=times["DataParallel"] / times["DDP"])
    ]


def strategies(cfg: Config, comm: pk.Communicator) -> list[dict]:
    batch, side = (32, 224) if not cfg.quick else (2, 64)
    rows = []
    plain = timed(train_step(resnet50(cfg), cfg, batch, side), cfg)
    rows.append(dict(part="resnet50", strategy="plain", step_ms=plain * 1e3, ratio=1.0))
    for strategy in ("data", "spatial", "channel"):
        model = pk.parallelize(resnet50(cfg), comm, strategy)
        t = timed(train_step(model, cfg, batch, side), cfg)
        rows.append(dict(part="resnet50", strategy=strategy, step_ms=t * 1e3, ratio=t / plain))
    return rows


def markdown(rows: list[dict], env: dict[str, str], command: str) -> str:
    lines = ["# GPU benchmarks (one GPU, world size 1)", "", f"`{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    for part in ("spatial", "syncbn", "dp", "resnet50"):
        table = [r for r in rows if r["part"] == part]
        if not table:
            continue
        keys = [k for k in table[-1] if k != "part"]
        lines += ["", f"## {part}", "", "| " + " | ".join(keys) + " |"]
        lines.append("|" + "---|" * len(keys))
        for r in table:
            cells = [
                f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                for k in keys
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def one_rank_group(device: str) -> pk.Communicator:
    """pk.init on a one-rank group: NCCL on a GPU, gloo elsewhere (for the smoke run)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    return pk.init("nccl" if device.startswith("cuda") else "gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu.md")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device here (--device cpu runs a smoke test)")
    cfg = Config(device=args.device, quick=args.quick)
    if args.quick:
        cfg.sides, cfg.ranks, cfg.channels, cfg.warmup, cfg.repeats = (128,), (2,), 8, 1, 2
    torch.backends.cudnn.benchmark = True
    comm = one_rank_group(cfg.device)
    rows = spatial(cfg) + syncbn(cfg, comm) + data_parallel(cfg, comm) + strategies(cfg, comm)
    extra = {"gpu": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "none"}
    env = environment(**extra)
    from _common import command_line

    text = markdown(rows, env, command_line())
    print(text)
    if not args.quick:
        print("saved", save(args.out, text, env, cfg, rows))
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
