"""parallelkit next to its peers: ChainerMN, and torch's DDP, SyncBatchNorm and DTensor.

    make bench-peers       # creates .venv-chainer on first use, then runs this (~3 min here)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers.py --chainer-python .venv-chainer/bin/python
    ... --quick            # short blocks, a smoke test (~2.5 min)

The same workloads in each framework, in one run, on the same inputs and weights (drawn here,
written to a temporary WORKDIR as inputs.npz), each reported as speed next to exactness:

    bn       ChainerMN MultiNodeBatchNormalization vs parallelkit SyncBatchNorm, with an even
             and an uneven split of the batch (ChainerMN weights every rank's statistics
             equally); torch.nn.SyncBatchNorm on CPU (its refusal is recorded)
    conv     the ChainerMN parallel_convolution example's channel split (a grouped convolution)
             vs parallelkit ChannelParallelConv2d(split="out")
    dp       chainermn.create_multi_node_optimizer vs parallelkit DataParallel vs torch DDP, on
             the same small CNN, one SGD step
    spatial  DTensor's convolution of an input Shard(2) / Shard(3) vs parallelkit
             SpatialParallelConv2d over rows / columns

Each at 1 and 2 ranks, so that each framework's parallel overhead shows apart from its raw
speed (chainer computes in numpy, torch in ATen). ChainerMN runs in .venv-chainer under its own
mpiexec (peers_chainer.py, the ``naive`` communicator). The torch side (peers_torch.py) runs
twice: under this venv's mpiexec on pk.init("mpi") (this script with the hidden ``--worker
mpi``), the parallelkit variants only, on the same transport as ChainerMN (both venvs install
the same pip ``mpich``); and in gloo ranks (``parallelkit.testing.Ranks``), parallelkit next
to torch's DDP, SyncBatchNorm and DTensor, which need torch.distributed. Every row names its
transport ("gloo", or the MPI library's name: "MPICH").

Overheads (bn, dp) are reported as a ratio and as milliseconds added per step, each against
the framework's own times: its 2-rank step against its 1-rank step, and against its baseline
without communication in the same processes; the report's goal line compares parallelkit's
added milliseconds with ChainerMN's, both on MPI (peers_report.py).

Exactness: every result in float64 against the dense single-process torch computation on the
whole batch or image; the error is max |a - ref| / max |ref| per quantity (output, input
gradient, weight gradient, running statistics; for data parallelism the SGD update). Speed:
float32 step times (forward + backward; for dp the whole SGD step), median over blocks of the
slowest rank. Frameworks run one after another in one run on a shared machine, so the ratios
are what this run measured, not constants.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from _common import (
    OtherLoad,
    command_line,
    environment,
    keep_freed_memory,
    library_state,
    mpiexec,
    save,
)
from peers_report import GLOO, key_ratios, mpi_transport, overheads, report
from peers_torch import SmallCNN

WORKER_TIMEOUT_S = 1800.0


@dataclass
class Config:
    """What both sides compute: float64 exactness cases and float32 timing shapes."""

    ranks: list[int] = field(default_factory=lambda: [1, 2])
    repeats: int = 7  # timed blocks per variant, alternating
    target_s: float = 0.3  # rough duration of one timed block
    eps: float = 1e-5
    pad: int = 1  # every convolution: 3x3, padding 1
    lr: float = 0.1
    # exactness (float64)
    bn_exact_shape: tuple[int, ...] = (12, 6, 5, 5)  # the whole batch
    bn_splits: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {"1": {"even": [12]}, "2": {"even": [6, 6], "uneven": [2, 10]}}
    )
    conv_exact_shape: tuple[int, ...] = (4, 8, 9, 9)  # x; 8 -> 6 channels
    conv_exact_out: int = 6
    dp_exact_batch: int = 8
    dp_exact_size: int = 12
    spatial_exact_shape: tuple[int, ...] = (2, 4, 12, 12)  # x; 4 -> 5 channels
    spatial_exact_out: int = 5
    # timing (float32)
    bn_shape: list[int] = field(default_factory=lambda: [16, 64, 32, 32])  # per rank
    conv_shape: list[int] = field(default_factory=lambda: [16, 64, 32, 32])  # the whole input
    conv_out: int = 64
    dp_batch: int = 32  # per rank
    dp_size: int = 32
    spatial_shape: list[int] = field(default_factory=lambda: [1, 32, 256, 256])  # whole image


# ---------------------------------------------------------------------------- inputs
def make_inputs(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Every input and weight both sides use, float64 (labels int64)."""
    rng = np.random.default_rng(seed)
    n = rng.standard_normal
    c = cfg.bn_exact_shape[1]
    conv_in = cfg.conv_exact_shape[1]
    sp_in = cfg.spatial_exact_shape[1]
    conv_y = (cfg.conv_exact_shape[0], cfg.conv_exact_out, *cfg.conv_exact_shape[2:])
    sp_y = (cfg.spatial_exact_shape[0], cfg.spatial_exact_out, *cfg.spatial_exact_shape[2:])
    inputs = {
        "bn_x": n(cfg.bn_exact_shape) * 2 + 0.5,
        "bn_dy": n(cfg.bn_exact_shape),
        "bn_gamma": 1 + 0.1 * n(c),
        "bn_beta": 0.1 * n(c),
        "conv_x": n(cfg.conv_exact_shape),
        "conv_w": n((cfg.conv_exact_out, conv_in, 3, 3)) / 3,
        "conv_dy": n(conv_y),
        "dp_x": n((cfg.dp_exact_batch, 3, cfg.dp_exact_size, cfg.dp_exact_size)),
        "dp_t": rng.integers(0, 10, cfg.dp_exact_batch),
        "sp_x": n(cfg.spatial_exact_shape),
        "sp_w": n((cfg.spatial_exact_out, sp_in, 3, 3)) / 3,
        "sp_b": n(cfg.spatial_exact_out),
        "sp_dy": n(sp_y),
    }
    torch.manual_seed(seed)  # SmallCNN's own initialisation, shared with chainer through npz
    for name, p in SmallCNN().double().state_dict().items():
        inputs[f"dp_{name}"] = p.numpy()
    return inputs


# ---------------------------------------------------------------------------- references
def grads(fn: Any, *tensors: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*tensors)`` and its gradients with respect to every tensor, for output grad dy."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


def bn_reference(inp: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """torch BatchNorm2d on the whole batch; running_var starts at 0 as ChainerMN's does."""
    bn = nn.BatchNorm2d(inp["bn_x"].shape[1], eps=cfg.eps).double()
    with torch.no_grad():
        bn.weight.copy_(inp["bn_gamma"])
        bn.bias.copy_(inp["bn_beta"])
        bn.running_var.zero_()
    x = inp["bn_x"].clone().requires_grad_()
    y = bn(x)
    y.backward(inp["bn_dy"])
    return {
        "y": y.detach(),
        "gx": x.grad,
        "gweight": bn.weight.grad,
        "gbias": bn.bias.grad,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
    }


def conv_reference(inp: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    y, gx, gw = grads(
        lambda x, w: F.conv2d(x, w, padding=cfg.pad),
        inp["conv_x"],
        inp["conv_w"],
        dy=inp["conv_dy"],
    )
    return {"y": y, "gx": gx, "gweight": gw}


def spatial_reference(inp: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    y, gx, gw, gb = grads(
        lambda x, w, b: F.conv2d(x, w, b, padding=cfg.pad),
        inp["sp_x"],
        inp["sp_w"],
        inp["sp_b"],
        dy=inp["sp_dy"],
    )
    return {"y": y, "gx": gx, "gweight": gw, "gbias": gb}


def dp_reference(inp: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """The SGD update of every parameter, one step on the whole batch."""
    model = SmallCNN().double()
    model.load_state_dict({k[3:]: v for k, v in inp.items() if k.startswith("dp_") and "." in k})
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    F.cross_entropy(model(inp["dp_x"]), inp["dp_t"]).backward()
    opt.step()
    return {k: v - inp[f"dp_{k}"] for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- comparison
def rel_err(got: Any, ref: torch.Tensor) -> float | str:
    """max |got - ref| / max |ref|, or why there is no number (missing, other shape)."""
    if got is None:
        return "not produced"
    got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)}, dense {tuple(ref.shape)}"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def compare(got: dict[str, Any], ref: dict[str, torch.Tensor]) -> dict[str, float | str]:
    return {k: rel_err(got.get(k), ref[k]) for k in ref}


def cat(results: list[dict], key: str, dim: int = 0) -> torch.Tensor:
    return torch.cat([r[key] for r in results], dim)


def total(results: list[dict], key: str) -> torch.Tensor:
    return torch.stack([r[key] for r in results]).sum(0)


def torch_rows(
    res: list[dict], refs: dict[str, dict], inp: dict, cfg: Config, transport: str
) -> list[dict]:
    """The exactness rows of the torch side at one rank count (``res``: by rank); torch's own
    (SyncBatchNorm, DDP, DTensor) where they ran, on gloo."""
    n, r0 = len(res), res[0]
    rows = []

    def row(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return make_row(*args, transport=transport, **kwargs)

    for split in cfg.bn_splits[str(n)]:
        ranks = [r[f"bn_{split}"] for r in res]
        got = {
            "y": cat(ranks, "y"),
            "gx": cat(ranks, "gx"),
            "gweight": total(ranks, "gweight"),
            "gbias": total(ranks, "gbias"),
            "running_mean": ranks[0]["running_mean"],
            "running_var": ranks[0]["running_var"],
        }
        rows.append(row("bn", "parallelkit SyncBatchNorm", n, split, compare(got, refs["bn"])))
    if "torch_syncbn" in r0:
        rows.append(row("bn", "torch.nn.SyncBatchNorm", n, "even", {}, note=r0["torch_syncbn"]))
    conv = [r["conv"] for r in res]
    got = {"y": conv[0]["y"], "gx": conv[0]["gx"], "gweight": cat(conv, "gweight_blk")}
    rows.append(
        row("conv", "parallelkit ChannelParallelConv2d", n, "split out", compare(got, refs["conv"]))
    )
    for key, name in (("dp_pk", "parallelkit DataParallel"), ("dp_ddp", "torch DDP")):
        if key not in r0:
            continue
        update = {k: v - inp[f"dp_{k}"] for k, v in r0[key].items()}
        rows.append(row("dp", name, n, "even", compare(update, refs["dp"])))
    for dim in (2, 3):
        sp = [r[f"spatial_{dim}"] for r in res]
        got = {
            "y": cat(sp, "y", dim),
            "gx": cat(sp, "gx", dim),
            "gweight": sp[0]["gweight"],
            "gbias": sp[0]["gbias"],
        }
        rows.append(
            row(
                "spatial",
                "parallelkit SpatialParallelConv2d",
                n,
                f"split dim {dim}",
                compare(got, refs["spatial"]),
            )
        )
        if f"dtensor_{dim}" in r0:
            dtensor = [r[f"dtensor_{dim}"] for r in res]
            rows.append(dtensor_row(dtensor, refs["spatial"], n, dim, transport))
    return rows


def dtensor_row(
    res: list[dict], ref: dict[str, torch.Tensor], n: int, dim: int, transport: str
) -> dict:
    """DTensor's blocks put together along ``dim`` (what its placements should have meant)."""
    r0 = res[0]
    case = f"Shard({dim})"
    if "error" in r0:
        return make_row("spatial", "DTensor conv", n, case, {}, r0["error"], transport)
    got = {"y": cat(res, "y", dim), "gx": r0["gx"], "gweight": r0["gweight"], "gbias": r0["gbias"]}
    note = f"output placements {r0['y_placements']}, global shape {tuple(r0['y_shape'])}"
    return make_row("spatial", "DTensor conv", n, case, compare(got, ref), note, transport)


def chainer_rows(
    res: dict[str, np.ndarray],
    refs: dict[str, dict],
    inp: dict,
    n: int,
    cfg: Config,
    transport: str,
) -> list[dict]:
    """The exactness rows of ChainerMN at ``n`` ranks (``res``: chainer_<n>.npz)."""

    def row(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return make_row(*args, transport=transport, **kwargs)

    def part(prefix: str) -> dict[str, np.ndarray]:
        return {k.split("/", 1)[1]: v for k, v in res.items() if k.startswith(prefix + "/")}

    rows = []
    for split in cfg.bn_splits[str(n)]:
        rows.append(
            row(
                "bn",
                "ChainerMN MultiNodeBatchNormalization",
                n,
                split,
                compare(part(f"bn_{split}"), refs["bn"]),
            )
        )
    conv = part("conv")
    # Its all-gather's backward sums the (replicated) output gradient over the ranks, so its
    # gradients come n times the dense ones: divided out, to show the grouping error alone.
    conv = {"y": conv["y"], "gx": conv["gx"] / n, "gweight": conv["gweight"] / n}
    rows.append(
        row(
            "conv",
            "ChainerMN parallel_convolution example",
            n,
            "channels r::n",
            compare(conv, refs["conv"]),
        )
    )
    update = {k: torch.from_numpy(v) - inp[f"dp_{k}"] for k, v in part("dp").items()}
    rows.append(row("dp", "ChainerMN multi-node optimizer", n, "even", compare(update, refs["dp"])))
    return rows


def make_row(
    workload: str,
    framework: str,
    ranks: int,
    case: str,
    errors: dict,
    note: str = "",
    transport: str = "",
) -> dict[str, Any]:
    return {
        "workload": workload,
        "framework": framework,
        "transport": transport,
        "ranks": ranks,
        "case": case,
        "errors": errors,
        "note": note,
    }


# ---------------------------------------------------------------------------- running
def run_chainer(python: str, workdir: Path, n: int) -> tuple[dict, dict]:
    """peers_chainer.py under the chainer venv's mpiexec on ``n`` ranks: (arrays, record)."""
    mpiexec = Path(python).parent / "mpiexec"
    script = Path(__file__).with_name("peers_chainer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(mpiexec), "-n", str(n), python, str(script), str(workdir)]
    subprocess.run(cmd, check=True, env=env, timeout=WORKER_TIMEOUT_S)
    with np.load(workdir / f"chainer_{n}.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads((workdir / f"chainer_{n}.json").read_text())


def run_torch_gloo(n: int, cfg: dict, workdir: Path) -> tuple[list[dict], dict]:
    """peers_torch.py's exactness (by rank) and timings (rank 0) on ``n`` gloo ranks."""
    from parallelkit.testing import Ranks

    import peers_torch

    with Ranks(n, "gloo", comm_timeout=300) as ranks:
        exact = ranks.run(peers_torch.exact_rank, cfg, str(workdir), timeout=WORKER_TIMEOUT_S)
        times = ranks.run(peers_torch.time_rank, cfg, str(workdir), timeout=WORKER_TIMEOUT_S)[0]
    return exact, times


def run_torch_mpi(n: int, workdir: Path) -> dict[str, Any]:
    """peers_torch.mpi_worker on ``n`` ranks under this venv's mpiexec (this script with the
    hidden ``--worker mpi``): {"exact": by rank, "times": rank 0's, "mpi": library version}."""
    cmd = [
        mpiexec(),
        "-n",
        str(n),
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "mpi",
        "--workdir",
        str(workdir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, timeout=WORKER_TIMEOUT_S)
    return torch.load(workdir / f"torch_mpi_{n}.pt")


def chainer_time_rows(record: dict, transport: str) -> list[dict]:
    return [
        {"workload": w, "framework": v, "transport": transport, "ranks": record["ranks"], **t}
        for w, variants in record["times"].items()
        for v, t in variants.items()
    ]


TORCH_NAMES = {
    ("bn", "local BatchNorm2d"): "torch local BatchNorm2d",
    ("conv", "dense"): "torch dense Conv2d",
    ("dp", "bare"): "torch bare (plain SGD)",
    ("spatial", "dense"): "torch dense Conv2d",
    ("bn", "parallelkit"): "parallelkit SyncBatchNorm",
    ("conv", "parallelkit"): "parallelkit ChannelParallelConv2d",
    ("dp", "parallelkit"): "parallelkit DataParallel",
    ("dp", "DDP"): "torch DDP",
    ("spatial", "parallelkit rows"): "parallelkit SpatialParallelConv2d rows",
    ("spatial", "parallelkit columns"): "parallelkit SpatialParallelConv2d columns",
}


def torch_time_rows(times: dict, n: int, transport: str) -> list[dict]:
    return [
        {
            "workload": w,
            "framework": TORCH_NAMES.get((w, v), v),
            "transport": transport,
            "ranks": n,
            **t,
        }
        for w, variants in times.items()
        for v, t in variants.items()
    ]


def run_all(cfg: Config, python: str, workdir: Path) -> tuple[list, list, dict, dict]:
    """Both sides at every rank count: exactness rows, time rows, versions (the chainer venv's
    and the MPI library of the torch side), load. Per rank count: ChainerMN on MPI, then
    parallelkit on MPI, then the torch side on gloo."""
    inputs = make_inputs(cfg)
    np.savez(workdir / "inputs.npz", **inputs)
    cfg_json = json.loads(json.dumps(asdict(cfg)))
    (workdir / "config.json").write_text(json.dumps(cfg_json))
    inp = {k: torch.from_numpy(v) for k, v in inputs.items()}
    refs = {
        "bn": bn_reference(inp, cfg),
        "conv": conv_reference(inp, cfg),
        "dp": dp_reference(inp, cfg),
        "spatial": spatial_reference(inp, cfg),
    }
    exact, timed, versions, others = [], [], {}, {}
    for n in cfg.ranks:
        load, start = OtherLoad(), time.monotonic()
        arrays, record = run_chainer(python, workdir, n)
        chainer_mpi = mpi_transport(record["versions"]["mpi"])
        exact += chainer_rows(arrays, refs, inp, n, cfg, chainer_mpi)
        timed += chainer_time_rows(record, chainer_mpi)
        versions = {f"chainer venv: {k}": v for k, v in record["versions"].items()}
        mpi = run_torch_mpi(n, workdir)
        torch_mpi = mpi_transport(mpi["mpi"])
        versions["torch venv: mpi"] = mpi["mpi"]
        exact += torch_rows(mpi["exact"], refs, inp, cfg, torch_mpi)
        timed += torch_time_rows(mpi["times"], n, torch_mpi)
        results, times = run_torch_gloo(n, cfg_json, workdir)
        exact += torch_rows(results, refs, inp, cfg, GLOO)
        timed += torch_time_rows(times, n, GLOO)
        others[n] = load.cores()
        print(
            f"{n} rank(s): {time.monotonic() - start:.0f} s, others used {others[n]:.2f} cores",
            flush=True,
        )
    return exact, timed, versions, others


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--chainer-python",
        default=".venv-chainer/bin/python",
        help="python of the venv holding chainer, mpi4py and mpich",
    )
    p.add_argument("--quick", action="store_true", help="short blocks, a smoke test")
    p.add_argument("--glibc-defaults", action="store_true", help="leave malloc's settings alone")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/peers.md"))
    p.add_argument("--worker", choices=["mpi"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker == "mpi":  # one rank under mpiexec, started by run_torch_mpi
        import peers_torch

        peers_torch.mpi_worker(args.workdir)
        return
    cfg = Config(repeats=3, target_s=0.1) if args.quick else Config()
    os.environ["OMP_NUM_THREADS"] = "1"
    env = environment(parallelkit=library_state())
    env["malloc"] = keep_freed_memory(args.glibc_defaults)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        exact, timed, versions, others = run_all(cfg, args.chainer_python, Path(tmp))
    env.update(versions)
    ratios, over = key_ratios(timed), overheads(timed)
    text = report(exact, timed, ratios, others, env, command_line(), over)
    json_path = save(
        args.out,
        text,
        env,
        cfg,
        timed,
        exactness=exact,
        ratios=ratios,
        overheads=over,
        other_load_cores=others,
    )
    print(text)
    print(f"wrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
