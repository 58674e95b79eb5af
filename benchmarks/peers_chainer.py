"""The ChainerMN side of benchmarks/peers.py: one worker per MPI rank, in the chainer venv.

    mpiexec -n 2 .venv-chainer/bin/python benchmarks/peers_chainer.py WORKDIR

peers.py writes ``WORKDIR/inputs.npz`` (every input and weight, float64) and
``WORKDIR/config.json``, starts this script under mpiexec at each rank count, and reads back
``WORKDIR/chainer_<ranks>.npz`` (the results, assembled on rank 0) and
``WORKDIR/chainer_<ranks>.json`` (times and versions). It lives in its own file because chainer
7.8.1 needs numpy<2 and its own venv, where torch (and so parallelkit and _common.py) is absent;
the timing loop below is _common.py's scheme (warm-up, calibrated blocks, slowest rank, median)
written again in numpy and mpi4py.

Three workloads, as ChainerMN offers them (its ``naive`` communicator, on CPU):

    bn     chainermn.links.MultiNodeBatchNormalization: each rank's batch, statistics from
           all ranks (the mean of per-rank means and of per-rank E[x^2], equal weights)
    conv   the parallel_convolution example's ParallelConvolution2D: rank r convolves input
           channels r, r+size, ... into its block of output channels, then all-gathers the
           outputs (a grouped convolution); written here after the example
    dp     chainermn.create_multi_node_optimizer(SGD): a small CNN, gradients averaged

Exactness runs in float64 on the cases in the inputs; timing in float32 on the timing shapes,
each ChainerMN variant alternating with its chainer baseline without communication (local
BatchNormalization, the dense Convolution2D, plain SGD) in the same processes, so that the
ratio of the two is ChainerMN's parallel overhead under the same load.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import mpi4py
import numpy as np
from mpi4py import MPI

# chainermn marks its collectives and links "experimental" with a warning on every call.
warnings.filterwarnings("ignore", category=FutureWarning, module="chainer")

WARMUP = 2
MIN_ITERS = 2
Step = Callable[[], object]


# ---------------------------------------------------------------------------- timing
def time_block(fn: Callable[[], object], iters: int, comm: Any) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, on the slowest rank."""
    comm.mpi_comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / iters


def measure(steps: dict[str, Step], comm: Any, repeats: int, target_s: float) -> dict:
    """Warm up, size the blocks to ~target_s, then time ``repeats`` blocks of every variant,
    in order on even rounds and reversed on odd ones; the median of each and every block."""
    iters = {}
    for name, fn in steps.items():
        for _ in range(WARMUP):
            fn()
        iters[name] = max(MIN_ITERS, round(target_s / max(time_block(fn, 1, comm), 1e-6)))
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(time_block(steps[name], iters[name], comm))
    return {
        name: {"s": statistics.median(ts), "times": ts, "iters": iters[name]}
        for name, ts in times.items()
    }


# ---------------------------------------------------------------------------- helpers
def block(x: np.ndarray, sizes: list[int], rank: int) -> np.ndarray:
    """This rank's rows of ``x`` when the first axis is split into ``sizes``."""
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]]


def even_sizes(n: int, parts: int) -> list[int]:
    """torch.tensor_split's block sizes: the first blocks one larger."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def gathered(comm: Any, x: np.ndarray) -> np.ndarray | None:
    """Every rank's ``x`` concatenated along axis 0, on rank 0 (None elsewhere)."""
    parts = comm.mpi_comm.gather(np.asarray(x), root=0)
    return None if parts is None else np.concatenate(parts)


def summed(comm: Any, x: np.ndarray) -> np.ndarray | None:
    """The sum over ranks of ``x``, on rank 0."""
    parts = comm.mpi_comm.gather(np.asarray(x), root=0)
    return None if parts is None else np.sum(parts, axis=0)


# ---------------------------------------------------------------------------- bn
def bn_layer(comm: Any, c: int, dtype: Any, eps: float) -> Any:
    """MultiNodeBatchNormalization with torch's eps and momentum 0.1 (decay 0.9)."""
    return chainermn.links.MultiNodeBatchNormalization(c, comm, decay=0.9, eps=eps, dtype=dtype)


def bn_exact(comm: Any, inputs: dict, sizes: list[int], eps: float) -> dict[str, Any]:
    """y and the input gradient (rows of every rank), gamma/beta gradients summed over ranks,
    running mean and variance after one step."""
    x = block(inputs["bn_x"], sizes, comm.rank)
    dy = block(inputs["bn_dy"], sizes, comm.rank)
    bn = bn_layer(comm, x.shape[1], np.float64, eps)
    bn.gamma.array[:] = inputs["bn_gamma"]
    bn.beta.array[:] = inputs["bn_beta"]
    bn.cleargrads()  # chainer fills a new parameter's gradient with NaN until cleared
    xv = chainer.Variable(x.copy())
    y = bn(xv)
    y.grad = dy.copy()
    y.backward()
    return {
        "y": gathered(comm, y.array),
        "gx": gathered(comm, xv.grad),
        "gweight": summed(comm, bn.gamma.grad),
        "gbias": summed(comm, bn.beta.grad),
        "running_mean": bn.avg_mean.copy(),
        "running_var": bn.avg_var.copy(),
    }


def fwd_bwd(link: Any, x: np.ndarray, dy: np.ndarray) -> Step:
    """One forward + backward of ``link`` on ``x`` with output gradient ``dy``."""
    xv = chainer.Variable(x)

    def step() -> None:
        link.cleargrads()
        xv.grad = None
        y = link(xv)
        y.grad = dy
        y.backward()

    return step


def bn_steps(comm: Any, shape: list[int], eps: float) -> dict[str, Step]:
    """float32 forward + backward on this rank's batch: chainer's local BatchNormalization
    (no communication, the baseline) and MultiNodeBatchNormalization."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    return {
        "chainer local BatchNormalization": fwd_bwd(L.BatchNormalization(shape[1], eps=eps), x, dy),
        "ChainerMN MultiNodeBatchNormalization": fwd_bwd(
            bn_layer(comm, shape[1], np.float32, eps), x, dy
        ),
    }


# ---------------------------------------------------------------------------- conv
class ExampleParallelConv2D(chainer.links.Convolution2D):
    """The parallel_convolution example's layer: input channels rank::size in, this rank's
    block of output channels out, outputs all-gathered along channels."""

    def __init__(self, comm: Any, weight: np.ndarray, pad: int) -> None:
        self.comm = comm
        c_out, c_in = weight.shape[:2]
        self.in_index = list(range(comm.rank, c_in, comm.size))
        out_sizes = even_sizes(c_out, comm.size)
        out_start = sum(out_sizes[: comm.rank])
        w = weight[out_start : out_start + out_sizes[comm.rank]][:, self.in_index]
        super().__init__(
            len(self.in_index), w.shape[0], w.shape[2:], pad=pad, nobias=True, initialW=w.copy()
        )

    def forward(self, x: Any) -> Any:
        y = super().forward(x[:, self.in_index])
        ys = chainermn.functions.allgather(self.comm, y)  # one Variable on 1 rank, else a tuple
        return F.concat(ys if isinstance(ys, tuple) else (ys,), axis=1)


def conv_exact(comm: Any, inputs: dict, pad: int) -> dict[str, Any]:
    """Output, input gradient (summed over ranks) and the weight gradient placed in the dense
    weight's shape (entries this layer does not hold stay 0), all on rank 0."""
    weight = inputs["conv_w"]
    with chainer.using_config("dtype", np.float64):
        conv = ExampleParallelConv2D(comm, weight, pad)
    conv.cleargrads()
    xv = chainer.Variable(inputs["conv_x"].copy())
    y = conv(xv)
    y.grad = inputs["conv_dy"].copy()
    y.backward()
    gw = np.zeros_like(weight)
    out_sizes = even_sizes(weight.shape[0], comm.size)
    out_start = sum(out_sizes[: comm.rank])
    rows = slice(out_start, out_start + out_sizes[comm.rank])
    gw[rows, conv.in_index] = conv.W.grad
    return {"y": y.array, "gx": summed(comm, xv.grad), "gweight": summed(comm, gw)}


def conv_steps(comm: Any, shape: list[int], c_out: int, pad: int) -> dict[str, Step]:
    """The dense Convolution2D on the whole input (every rank) and the example's layer."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((c_out, shape[1], 3, 3), dtype=np.float32) * 0.05
    dense = L.Convolution2D(shape[1], c_out, 3, pad=pad, nobias=True, initialW=weight)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal((shape[0], c_out, *shape[2:]), dtype=np.float32)
    return {
        "chainer dense Convolution2D": fwd_bwd(dense, x, dy),
        "ChainerMN parallel_convolution example": fwd_bwd(
            ExampleParallelConv2D(comm, weight, pad), x, dy
        ),
    }


# ---------------------------------------------------------------------------- dp
class SmallCNN(chainer.Chain):
    """peers.py's SmallCNN in chainer: conv 3x3 (3 -> 16), ReLU, conv 3x3 stride 2
    (16 -> 32), ReLU, global mean, linear (32 -> 10)."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 16, 3, pad=1)
            self.conv2 = L.Convolution2D(16, 32, 3, stride=2, pad=1)
            self.fc = L.Linear(32, 10)

    def forward(self, x: Any) -> Any:
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.fc(F.mean(h, axis=(2, 3)))


PARAMS = {  # torch state_dict name -> chainer parameter path
    "conv1.weight": "conv1/W",
    "conv1.bias": "conv1/b",
    "conv2.weight": "conv2/W",
    "conv2.bias": "conv2/b",
    "fc.weight": "fc/W",
    "fc.bias": "fc/b",
}


def dp_setup(comm: Any, inputs: dict, dtype: Any, lr: float) -> tuple[SmallCNN, Any]:
    with chainer.using_config("dtype", dtype):
        model = SmallCNN()
    params = dict(model.namedparams())
    for torch_name, path in PARAMS.items():
        params["/" + path].array = inputs[f"dp_{torch_name}"].astype(dtype)
    optimizer = chainermn.create_multi_node_optimizer(chainer.optimizers.SGD(lr=lr), comm)
    optimizer.setup(model)
    # Its first update() broadcasts rank 0's parameters and steps nothing; do it here, so
    # that the steps below are all SGD steps.
    model.cleargrads()
    optimizer.update()
    return model, optimizer


def dp_train_step(model: SmallCNN, optimizer: Any, x: np.ndarray, t: np.ndarray) -> None:
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    optimizer.update()


def dp_exact(comm: Any, inputs: dict, lr: float) -> dict[str, Any]:
    """The parameters after one SGD step on this rank's share of the batch (rank 0's copy)."""
    model, optimizer = dp_setup(comm, inputs, np.float64, lr)
    sizes = even_sizes(len(inputs["dp_x"]), comm.size)
    x, t = (block(inputs[k], sizes, comm.rank) for k in ("dp_x", "dp_t"))
    dp_train_step(model, optimizer, x, t.astype(np.int32))
    params = dict(model.namedparams())
    return {name: params["/" + path].array.copy() for name, path in PARAMS.items()}


def dp_steps(comm: Any, inputs: dict, batch: int, size: int, lr: float) -> dict[str, Step]:
    """An SGD step on this rank's batch: plain chainer SGD (no communication, the baseline)
    and the multi-node optimizer, each on its own model copy."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((batch, 3, size, size), dtype=np.float32)
    t = rng.integers(0, 10, batch).astype(np.int32)
    bare = SmallCNN()
    plain = chainer.optimizers.SGD(lr=lr)
    plain.setup(bare)
    model, optimizer = dp_setup(comm, inputs, np.float32, lr)
    return {
        "chainer bare (plain SGD)": lambda: dp_train_step(bare, plain, x, t),
        "ChainerMN multi-node optimizer": lambda: dp_train_step(model, optimizer, x, t),
    }


# ---------------------------------------------------------------------------- main
def exact_results(comm: Any, inputs: dict, cfg: dict) -> dict[str, np.ndarray]:
    """Every exactness case, flattened to ``case/name`` arrays (rank 0)."""
    out: dict[str, Any] = {}
    for split_name, sizes in cfg["bn_splits"][str(comm.size)].items():
        for k, v in bn_exact(comm, inputs, sizes, cfg["eps"]).items():
            out[f"bn_{split_name}/{k}"] = v
    for k, v in conv_exact(comm, inputs, cfg["pad"]).items():
        out[f"conv/{k}"] = v
    for k, v in dp_exact(comm, inputs, cfg["lr"]).items():
        out[f"dp/{k}"] = v
    return out


def timings(comm: Any, inputs: dict, cfg: dict) -> dict[str, Any]:
    rep, target = cfg["repeats"], cfg["target_s"]
    workloads = {
        "bn": lambda: bn_steps(comm, cfg["bn_shape"], cfg["eps"]),
        "conv": lambda: conv_steps(comm, cfg["conv_shape"], cfg["conv_out"], cfg["pad"]),
        "dp": lambda: dp_steps(comm, inputs, cfg["dp_batch"], cfg["dp_size"], cfg["lr"]),
    }
    return {name: measure(make(), comm, rep, target) for name, make in workloads.items()}


def main() -> None:
    workdir = Path(sys.argv[1])
    cfg = json.loads((workdir / "config.json").read_text())
    comm = chainermn.create_communicator("naive")
    inputs = dict(np.load(workdir / "inputs.npz"))
    results = exact_results(comm, inputs, cfg)
    times = timings(comm, inputs, cfg)
    if comm.rank == 0:
        np.savez(workdir / f"chainer_{comm.size}.npz", **results)
        versions = {
            "chainer": chainer.__version__,
            "numpy": np.__version__,
            "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "python": platform.python_version(),
        }
        record = {"ranks": comm.size, "versions": versions, "times": times}
        (workdir / f"chainer_{comm.size}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
