"""The torch side of benchmarks/peers.py: what every torch rank runs, on gloo or on MPI.

parallelkit and torch's own distributed tools on the same inputs as the ChainerMN worker
(peers_chainer.py), which peers.py wrote to ``WORKDIR/inputs.npz``. Two transports:

    gloo  ranks started by parallelkit.testing.Ranks: every variant below
    MPI   ``mpiexec -n N python benchmarks/peers.py --worker mpi --workdir WORKDIR``, the
          ranks on pk.init("mpi") (``mpi_worker``): the parallelkit variants only, since
          torch's DDP, SyncBatchNorm and DTensor need torch.distributed; on the same MPI
          library as ChainerMN, parallelkit's overhead is measured like for like

The workloads:

    bn       parallelkit SyncBatchNorm; torch.nn.SyncBatchNorm (refuses on CPU: recorded)
    conv     parallelkit ChannelParallelConv2d(split="out"), the dense convolution
    dp       parallelkit DataParallel and torch DistributedDataParallel on the same SmallCNN
    spatial  parallelkit SpatialParallelConv2d over rows and over columns; DTensor's sharded
             convolution, the input ``Shard(2)`` / ``Shard(3)`` on a 1-D device mesh

``exact_rank`` returns this rank's float64 results (peers.py assembles and compares them with
the dense reference); ``time_rank`` the float32 step times of every variant, timed with
_common.py in alternating order. What raises is returned as its message, never hidden.
``mpi_worker`` runs both on an MPI rank and writes every rank's exactness results and rank 0's
times to ``WORKDIR/torch_mpi_<ranks>.pt``. Legend: ``_blk`` this rank's block of a split tensor.
"""

from __future__ import annotations

import copy
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from _common import WARMUP, Sync, alternating, choose_iters, time_block, torch_sync

if TYPE_CHECKING:
    from parallelkit.comm.base import Communicator
    from parallelkit.comm.torch_dist import TorchCommunicator

Step = Callable[[], object]


class SmallCNN(nn.Module):
    """conv 3x3 (3 -> 16), ReLU, conv 3x3 stride 2 (16 -> 32), ReLU, global mean, linear (32 ->
    10): the data-parallel workload, written the same way in peers_chainer.py."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(h.mean((2, 3)))


def load_inputs(workdir: str) -> dict[str, torch.Tensor]:
    with np.load(Path(workdir) / "inputs.npz") as f:
        return {k: torch.from_numpy(f[k]) for k in f.files}


def small_cnn(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> SmallCNN:
    """SmallCNN holding the weights that peers.py drew (the same as the chainer model's)."""
    model = SmallCNN().to(dtype)
    state = {k[3:]: v.to(dtype) for k, v in inputs.items() if k.startswith("dp_") and "." in k}
    model.load_state_dict(state)
    return model


def error_text(exc: BaseException) -> str:
    """The exception's type and first line, for the table."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def on_torch_dist(comm: Communicator) -> bool:
    """Whether ``comm`` runs on torch.distributed (gloo), where DDP, torch's SyncBatchNorm and
    DTensor can run next to parallelkit; on MPI only parallelkit's variants run."""
    from parallelkit.comm.torch_dist import TorchCommunicator

    return isinstance(comm, TorchCommunicator)


def rank_sync(comm: Communicator) -> Sync:
    """The raw backend's barrier and max-reduction around timed blocks: torch.distributed on
    the process group, or mpi4py on the MPI communicator."""
    if on_torch_dist(comm):
        return torch_sync(comm.group)
    from mpi4py import MPI

    mc = comm.comm
    return Sync(mc.Barrier, lambda x: mc.allreduce(x, op=MPI.MAX))


# ---------------------------------------------------------------------------- exactness
def bn_exact(
    comm: Communicator,
    x: torch.Tensor,
    dy: torch.Tensor,
    cfg: dict,
    inputs: dict[str, torch.Tensor],
    sizes: list[int],
) -> dict[str, torch.Tensor]:
    """parallelkit SyncBatchNorm on this rank's rows; running_var starts at 0 like chainer's."""
    from parallelkit.nn import SyncBatchNorm

    x_blk = x.split(sizes)[comm.rank].clone().requires_grad_()
    bn = SyncBatchNorm(x.shape[1], eps=cfg["eps"], comm=comm).double()
    with torch.no_grad():
        bn.weight.copy_(inputs["bn_gamma"])
        bn.bias.copy_(inputs["bn_beta"])
        bn.running_var.zero_()
    y_blk = bn(x_blk)
    y_blk.backward(dy.split(sizes)[comm.rank])
    return {
        "y": y_blk,
        "gx": x_blk.grad,
        "gweight": bn.weight.grad,
        "gbias": bn.bias.grad,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
    }


def torch_syncbn_refusal(x: torch.Tensor) -> str:
    """What torch.nn.SyncBatchNorm says when trained on CPU tensors ("ran" if it does)."""
    bn = nn.SyncBatchNorm(x.shape[1]).double()
    try:
        bn(x.clone().requires_grad_()).sum().backward()
    except (RuntimeError, ValueError) as exc:
        return error_text(exc)
    return "ran"


def conv_exact(comm: Communicator, inputs: dict[str, torch.Tensor], pad: int) -> dict:
    """ChannelParallelConv2d(split="out"): output and input gradient (whole on every rank),
    this rank's block of the weight gradient (output channels)."""
    from parallelkit.nn import ChannelParallelConv2d

    dense = nn.Conv2d(*inputs["conv_w"].shape[1::-1], 3, padding=pad, bias=False).double()
    with torch.no_grad():
        dense.weight.copy_(inputs["conv_w"])
    layer = ChannelParallelConv2d.from_dense(dense, comm, split="out")
    x = inputs["conv_x"].clone().requires_grad_()
    y = layer(x)
    y.backward(inputs["conv_dy"])
    return {"y": y, "gx": x.grad, "gweight_blk": layer.weight.grad}


def dp_exact(
    comm: Communicator, inputs: dict[str, torch.Tensor], lr: float, wrapper: str
) -> dict[str, torch.Tensor]:
    """The parameters after one SGD step on this rank's share of the batch."""
    from parallelkit.parallel import DataParallel

    model = small_cnn(inputs, torch.float64)
    if wrapper == "pk":
        wrapped = DataParallel(model, comm)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=comm.group)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, t = (inputs[k].tensor_split(comm.size)[comm.rank] for k in ("dp_x", "dp_t"))
    F.cross_entropy(wrapped(x), t).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def spatial_exact(
    comm: Communicator, inputs: dict[str, torch.Tensor], pad: int, dim: int
) -> dict[str, torch.Tensor]:
    """SpatialParallelConv2d with the image split along ``dim`` (2: rows, 3: columns):
    this rank's output and input-gradient blocks, and its weight and bias gradients."""
    import parallelkit as pk
    from parallelkit.nn import SpatialParallelConv2d

    grid = (comm.size, 1) if dim == 2 else (1, comm.size)
    dense = nn.Conv2d(*inputs["sp_w"].shape[1::-1], 3, padding=pad).double()
    with torch.no_grad():
        dense.weight.copy_(inputs["sp_w"])
        dense.bias.copy_(inputs["sp_b"])
    layer = SpatialParallelConv2d.from_dense(dense, comm, grid=grid)
    x_blk = pk.spatial.scatter(inputs["sp_x"], comm, grid).clone().requires_grad_()
    y_blk = layer(x_blk)
    y_blk.backward(inputs["sp_dy"].tensor_split(comm.size, dim)[comm.rank])
    return {"y": y_blk, "gx": x_blk.grad, "gweight": dense.weight.grad, "gbias": dense.bias.grad}


def dtensor_exact(
    comm: TorchCommunicator, inputs: dict[str, torch.Tensor], pad: int, dim: int
) -> dict[str, Any]:
    """DTensor's convolution of an input ``Shard(dim)`` on a 1-D mesh, weight replicated.

    Returns what each rank holds (``.to_local()``) and the placements DTensor claims, or the
    message of what raised; peers.py decides whether the blocks are the dense result.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (comm.size,))
    out: dict[str, Any] = {}
    try:
        x = distribute_tensor(inputs["sp_x"], mesh, [Shard(dim)]).requires_grad_()
        w = distribute_tensor(inputs["sp_w"], mesh, [Replicate()]).requires_grad_()
        b = distribute_tensor(inputs["sp_b"], mesh, [Replicate()]).requires_grad_()
        y = F.conv2d(x, w, b, padding=pad)
        out.update(y=y.to_local(), y_placements=str(y.placements), y_shape=list(y.shape))
        y.backward(distribute_tensor(inputs["sp_dy"], mesh, [Shard(dim)]))
        for name, t in (("gx", x), ("gweight", w), ("gbias", b)):
            out[name] = None if t.grad is None else t.grad.full_tensor()
    except Exception as exc:  # whatever DTensor raises is the result
        out["error"] = f"{error_text(exc)} (in {raised_in(exc)})"
    return out


def raised_in(exc: BaseException) -> str:
    """The innermost function of torch.distributed.tensor that the exception passed through."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if "distributed/tensor" in f.filename
    ]
    return "torch.distributed.tensor." + (
        f"{Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else "?"
    )


def exact_rank(comm: Communicator, cfg: dict, workdir: str) -> dict[str, Any]:
    """Every float64 exactness case on this rank (torch's own only on torch.distributed)."""
    inputs = load_inputs(workdir)
    x, dy = inputs["bn_x"], inputs["bn_dy"]
    peers = on_torch_dist(comm)
    out: dict[str, Any] = {
        "conv": conv_exact(comm, inputs, cfg["pad"]),
        "dp_pk": dp_exact(comm, inputs, cfg["lr"], "pk"),
    }
    if peers:
        out["torch_syncbn"] = torch_syncbn_refusal(x)
        out["dp_ddp"] = dp_exact(comm, inputs, cfg["lr"], "ddp")
    for split_name, sizes in cfg["bn_splits"][str(comm.size)].items():
        out[f"bn_{split_name}"] = bn_exact(comm, x, dy, cfg, inputs, sizes)
    for dim in (2, 3):
        out[f"spatial_{dim}"] = spatial_exact(comm, inputs, cfg["pad"], dim)
        if peers:
            out[f"dtensor_{dim}"] = dtensor_exact(comm, inputs, cfg["pad"], dim)
    return out


# ---------------------------------------------------------------------------- timing
def fwd_bwd(
    module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor
) -> Step:
    """One forward + backward of ``module`` on ``x`` with output gradient ``dy``."""

    def step() -> None:
        x.grad = None
        module(x).backward(dy)

    return step


def bn_steps(comm: Communicator, shape: list[int], eps: float) -> dict[str, Step]:
    from parallelkit.nn import SyncBatchNorm

    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(shape, generator=gen).requires_grad_()
    dy = torch.randn(shape, generator=gen)
    return {
        "local BatchNorm2d": fwd_bwd(nn.BatchNorm2d(shape[1], eps=eps), x, dy),
        "parallelkit": fwd_bwd(SyncBatchNorm(shape[1], eps=eps, comm=comm), x, dy),
    }


def conv_steps(comm: Communicator, shape: list[int], c_out: int, pad: int) -> dict[str, Step]:
    from parallelkit.nn import ChannelParallelConv2d

    gen = torch.Generator().manual_seed(0)
    dense = nn.Conv2d(shape[1], c_out, 3, padding=pad, bias=False)
    x = torch.randn(shape, generator=gen).requires_grad_()
    dy = torch.randn(shape[0], c_out, *shape[2:], generator=gen)
    layer = ChannelParallelConv2d.from_dense(dense, comm, split="out")
    return {"dense": fwd_bwd(dense, x, dy), "parallelkit": fwd_bwd(layer, x, dy)}


def dp_steps(
    comm: Communicator, inputs: dict[str, torch.Tensor], batch: int, size: int, lr: float
) -> dict[str, Step]:
    """bare (no communication), parallelkit DataParallel and (on torch.distributed) DDP: each
    its own model copy."""
    from parallelkit.parallel import DataParallel

    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(batch, 3, size, size, generator=gen)
    t = torch.randint(0, 10, (batch,), generator=gen)
    steps = {}
    names = ("bare", "parallelkit", "DDP") if on_torch_dist(comm) else ("bare", "parallelkit")
    for name in names:
        model = small_cnn(inputs, torch.float32)
        if name == "parallelkit":
            wrapped = DataParallel(model, comm)
        elif name == "DDP":
            wrapped = nn.parallel.DistributedDataParallel(model, process_group=comm.group)
        else:
            wrapped = model
        steps[name] = train_step(wrapped, torch.optim.SGD(model.parameters(), lr=lr), x, t)
    return steps


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
) -> Step:
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), t).backward()
        opt.step()

    return step


def spatial_steps(comm: Communicator, shape: list[int], pad: int) -> dict[str, Step]:
    """Dense on the whole image, parallelkit on rows / columns, and (on torch.distributed)
    DTensor Shard(2) / Shard(3)."""
    import parallelkit as pk
    from parallelkit.nn import SpatialParallelConv2d

    gen = torch.Generator().manual_seed(0)
    dense = nn.Conv2d(shape[1], shape[1], 3, padding=pad)
    x = torch.randn(shape, generator=gen)
    dy = torch.randn(shape, generator=gen)
    steps = {"dense": fwd_bwd(dense, x.clone().requires_grad_(), dy)}
    for dim, where in ((2, "rows"), (3, "columns")):
        grid = (comm.size, 1) if dim == 2 else (1, comm.size)
        layer = SpatialParallelConv2d.from_dense(copy.deepcopy(dense), comm, grid=grid)
        x_blk = pk.spatial.scatter(x, comm, grid).detach().requires_grad_()
        dy_blk = dy.tensor_split(comm.size, dim)[comm.rank]
        hw = tuple(shape[2:])  # given, so that no size all-gather runs
        step = fwd_bwd(lambda v, m=layer, hw=hw: m(v, size=hw), x_blk, dy_blk)
        steps[f"parallelkit {where}"] = step
        dt = dtensor_step(comm, dense, x, dy, dim, pad) if on_torch_dist(comm) else None
        if dt is not None:
            steps[f"DTensor Shard({dim})"] = dt
    return steps


def dtensor_step(
    comm: TorchCommunicator, dense: nn.Conv2d, x: torch.Tensor, dy: torch.Tensor, dim: int, pad: int
) -> Step | None:
    """DTensor forward + backward as it runs (None if it raises; exactness says the rest)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (comm.size,))
    x_d = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
    w_d = distribute_tensor(dense.weight.detach(), mesh, [Replicate()]).requires_grad_()
    b_d = distribute_tensor(dense.bias.detach(), mesh, [Replicate()]).requires_grad_()
    dy_d = distribute_tensor(dy, mesh, [Shard(dim)])

    def step() -> None:
        x_d.grad = w_d.grad = b_d.grad = None
        F.conv2d(x_d, w_d, b_d, padding=pad).backward(dy_d)

    try:
        step()
    except Exception:  # recorded by dtensor_exact
        return None
    return step


def measure(steps: dict[str, Step], sync: Sync, repeats: int, target_s: float) -> dict[str, Any]:
    """Warm up, size the blocks, time them alternating; median of the slowest rank per step."""
    for fn in steps.values():
        for _ in range(WARMUP):
            fn()
    iters = {name: choose_iters(fn, sync, target_s) for name, fn in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for name in alternating(list(steps), repeats):
        times[name].append(time_block(steps[name], iters[name], sync))
    return {
        name: {"s": statistics.median(ts), "times": ts, "iters": iters[name]}
        for name, ts in times.items()
    }


def time_rank(comm: Communicator, cfg: dict, workdir: str) -> dict[str, Any]:
    """Every workload's variants, float32, on this rank; rank 0's answer is everyone's."""
    inputs = load_inputs(workdir)
    sync = rank_sync(comm)
    torch.manual_seed(0)
    workloads = {
        "bn": lambda: bn_steps(comm, cfg["bn_shape"], cfg["eps"]),
        "conv": lambda: conv_steps(comm, cfg["conv_shape"], cfg["conv_out"], cfg["pad"]),
        "dp": lambda: dp_steps(comm, inputs, cfg["dp_batch"], cfg["dp_size"], cfg["lr"]),
        "spatial": lambda: spatial_steps(comm, cfg["spatial_shape"], cfg["pad"]),
    }
    return {
        name: measure(make(), sync, cfg["repeats"], cfg["target_s"])
        for name, make in workloads.items()
    }


# ---------------------------------------------------------------------------- MPI ranks
def mpi_worker(workdir: str) -> None:
    """One rank under mpiexec on pk.init("mpi"): the exactness cases and the timings, as on
    gloo; rank 0 writes ``WORKDIR/torch_mpi_<ranks>.pt``: {"exact": every rank's results,
    "times": rank 0's, "mpi": the MPI library's version line}."""
    import json

    from mpi4py import MPI

    import parallelkit as pk

    torch.set_num_threads(1)
    comm = pk.init("mpi", timeout=300)
    cfg = json.loads((Path(workdir) / "config.json").read_text())
    exact = comm.comm.gather(exact_rank(comm, cfg, workdir), root=0)
    times = time_rank(comm, cfg, workdir)
    if comm.rank == 0:
        mpi = " ".join(MPI.Get_library_version().splitlines()[0].split())
        record = {"exact": exact, "times": times, "mpi": mpi}
        torch.save(record, Path(workdir) / f"torch_mpi_{comm.size}.pt")
