"""Which design lets ``torch.compile`` keep a spatial region in a few graphs: a measured
prototype of three, on 2 gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_designs.py           # ~3 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_designs.py --quick   # ~1 min

parallelkit's spatial guard is a ``TorchFunctionMode`` whose record of which tensors are
blocks is keyed by tensor identity. dynamo guards on identity, so every step's new tensors
fail the guards and recompile (docs/design.md, "Compiled steps"). The fix is to carry a block's
layout on the tensor itself. Three ways to do that, each written here at the same small scope
(a convolution with zero padding on a block of rows, pointwise operations, a sum over the
blocks; the rest of a network's operators would follow the same pattern):

    aten subclass      DTensor's design: a wrapper tensor subclass with the whole shape, its
                       block inside, ``__torch_dispatch__`` rules on aten operators (forward and
                       backward: ``convolution``, ``convolution_backward``, ...), traced by
                       AOTAutograd through ``__tensor_flatten__``
    function subclass  a tensor subclass holding the block itself, the layout an attribute,
                       ``__torch_function__`` rules on torch's functions (``F.conv2d``), their
                       communication in autograd Functions: the guard's rules as they are
    mode, layout on    the guard's design kept (a ``TorchFunctionMode`` entered by the
      the tensor       region) with the layout an attribute of each block instead of an entry
                       keyed by identity

Every design exchanges halos and sums through torch's functional collectives (an all-gather
of each rank's edge rows, an all-reduce), which dynamo keeps in the graph; parameters are
whole and their gradients summed over the ranks in backward.

For each design: the loss and every parameter gradient against the dense network on the
whole input (float64, rows split unevenly), the graphs ``torch._dynamo.explain`` finds, the
graphs compiled over 5 steps on new tensors (recompilation), the first compiled step (the
compile, inductor's caches off), and eager and compiled steps (float32, median of alternating
rounds, the slowest rank). The library's own spatial region on the same network
(``pk.parallelize(..., "spatial")``: eager, and compiled, where it runs eager) is timed
beside them.

Results: benchmarks/results/compile_designs.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from _common import alternating, command_line, environment, save, torch_sync

aten = torch.ops.aten
DESIGNS = ("aten subclass", "function subclass", "mode, layout on the tensor")
WORKER_TIMEOUT_S = 1200.0


@dataclass
class Config:
    exact_shape: tuple[int, ...] = (2, 3, 31, 24)  # rows 16 + 15 on 2 ranks
    time_shape: tuple[int, ...] = (2, 3, 64, 64)
    width: int = 16
    depth: int = 3
    rounds: int = 9
    steps: int = 5  # per timed block


class Net(nn.Module):
    """A stem, residual 3x3 blocks and a head, ending in a sum: every operator the
    prototypes cover."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.body = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(depth))
        self.head = nn.Conv2d(width, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for conv in self.body:
            h = h + F.relu(conv(h))
        return self.head(h).sum()


# --------------------------------------------------------------- collectives (functional)
def _world() -> tuple[Any, int, int]:
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def _with_halo(x: torch.Tensor, p: int) -> torch.Tensor:
    """Block ``x`` (N, C, h, W) with ``p`` rows of each neighbour above and below (zeros past
    the sample's edges): one all-gather of every rank's first and last ``p`` rows."""
    if p == 0:
        return x
    group, rank, size = _world()
    edges = torch.cat([x[:, :, :p], x[:, :, -p:]], 2).contiguous()
    every = funcol.all_gather_single(edges, 0, group).view(size, *edges.shape)
    zeros = x.new_zeros(x.shape[0], x.shape[1], p, x.shape[3])
    above = every[rank - 1][:, :, p:] if rank > 0 else zeros
    below = every[rank + 1][:, :, :p] if rank < size - 1 else zeros
    return torch.cat([above, x, below], 2)


def _halo_back(g: torch.Tensor, p: int) -> torch.Tensor:
    """The adjoint of :func:`_with_halo`: the halo rows' gradients added to their owners'."""
    if p == 0:
        return g
    group, rank, size = _world()
    out = g[:, :, p:-p].clone()
    sent = torch.cat([g[:, :, :p], g[:, :, -p:]], 2).contiguous()
    every = funcol.all_gather_single(sent, 0, group).view(size, *sent.shape)
    if rank > 0:
        out[:, :, :p] += every[rank - 1][:, :, p:]
    if rank < size - 1:
        out[:, :, -p:] += every[rank + 1][:, :, :p]
    return out


def _sum(t: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


class Halo(Function):
    @staticmethod
    def forward(ctx, x, p):  # type: ignore[override]
        ctx.p = p
        return _with_halo(x, p)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _halo_back(g, ctx.p), None


class Whole(Function):
    """A whole tensor (a parameter) meeting blocks: identity forward, gradients summed."""

    @staticmethod
    def forward(ctx, w):  # type: ignore[override]
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _sum(g)


class SumAll(Function):
    """The sum over every rank's block; every rank computes the same loss from it."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.shape = x.shape
        return _sum(x.sum())

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.expand(ctx.shape)


def _conv_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, int, int]:
    """(x, weight, bias, row padding, column padding) of an ``F.conv2d`` call with stride 1,
    dilation 1, one group and zero padding."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    pad = args[4] if len(args) > 4 else kwargs.get("padding", 0)
    pad = (pad, pad) if isinstance(pad, int) else tuple(pad)
    rest = [*args[3:4], *args[5:]]
    if any(a not in (1, (1, 1)) for a in rest):
        raise NotImplementedError("the prototypes convolve with stride 1, dilation 1, 1 group")
    return x, w, b, pad[0], pad[1]


# --------------------------------------------------------------- 1. aten subclass
class AtenBlock(torch.Tensor):
    """This rank's rows of whole images, shaped as the whole; rules on aten operators."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, rows: int) -> AtenBlock:
        shape = (*local.shape[:2], rows, *local.shape[3:])
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=local.requires_grad
        )

    def __init__(self, local: torch.Tensor, rows: int) -> None:
        self._local, self._rows = local, rows

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AtenBlock({tuple(self._local.shape)}, rows={self._rows})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[int]]:
        return ["_local"], (self._rows,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):  # type: ignore[no-untyped-def]
        return AtenBlock(inner["_local"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        rows = next(a._rows for a in args if isinstance(a, AtenBlock))
        _, rank, size = _world()

        def local(t: Any) -> Any:  # a block's rows; a whole tensor of the image cut to them
            if isinstance(t, AtenBlock):
                return t._local
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] == rows:
                return torch.tensor_split(t, size, 2)[rank]  # the loss's expanded gradient
            return t

        if func is aten.convolution.default:
            x, w, b, stride, pad, dil, transposed, outpad, groups = args
            y = aten.convolution(_with_halo(x._local, pad[0]), w, b, stride, [0, pad[1]], dil,
                                 transposed, outpad, groups)  # fmt: skip
            return AtenBlock(y, rows)
        if func is aten.convolution_backward.default:
            g, x, w, bias_sizes, stride, pad, dil, transposed, outpad, groups, mask = args
            gx, gw, gb = aten.convolution_backward(
                local(g), _with_halo(x._local, pad[0]), w, bias_sizes, stride, [0, pad[1]], dil,
                transposed, outpad, groups, mask)  # fmt: skip
            gx = None if gx is None else AtenBlock(_halo_back(gx, pad[0]), rows)
            return gx, None if gw is None else _sum(gw), None if gb is None else _sum(gb)
        if func is aten.sum.default:
            return _sum(aten.sum(args[0]._local))

        out = func(*tree_map(local, args), **tree_map(local, kwargs))  # pointwise
        return tree_map(lambda t: AtenBlock(t, rows)
                        if isinstance(t, torch.Tensor) and t.dim() == 4 else t, out)  # fmt: skip


# --------------------------------------------------------------- 2. function subclass
class FunctionBlock(torch.Tensor):
    """This rank's rows, the whole row count an attribute; rules on torch's functions."""

    _rows: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.conv2d:
            x, w, b, p, q = _conv_args(args, kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                y = F.conv2d(Halo.apply(x, p), Whole.apply(w), b if b is None else
                             Whole.apply(b), 1, (0, q))  # fmt: skip
            y = torch._tensor._convert(y, cls)
            y._rows = x._rows
            return y
        if func is torch.Tensor.sum and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunctionSubclass():
                return SumAll.apply(args[0])
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, FunctionBlock):
            out._rows = next(a._rows for a in args if isinstance(a, FunctionBlock))
        return out


# --------------------------------------------------------------- 3. the mode, layout on tensors
class LayoutMode(TorchFunctionMode):
    """The guard's design: a mode the region enters; a block carries ``_rows``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        block = next((a for a in args if isinstance(a, torch.Tensor) and hasattr(a, "_rows")),
                     None)  # fmt: skip
        if block is None:
            return func(*args, **kwargs)
        if func is F.conv2d:
            x, w, b, p, q = _conv_args(args, kwargs)
            y = F.conv2d(Halo.apply(x, p), Whole.apply(w), b if b is None else Whole.apply(b),
                         1, (0, q))  # fmt: skip
        elif func is torch.Tensor.sum and len(args) == 1 and not kwargs:
            return SumAll.apply(args[0])
        else:
            y = func(*args, **kwargs)
        if isinstance(y, torch.Tensor):
            y._rows = block._rows
        return y


class InMode(nn.Module):
    """``net`` run inside :class:`LayoutMode`, as a spatial region runs its model."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with LayoutMode():
            return self.net(x)


def _block(design: str, x: torch.Tensor) -> torch.Tensor:
    _, rank, size = _world()
    local = torch.tensor_split(x, size, 2)[rank].contiguous()
    if design not in DESIGNS:  # the library's own region takes plain blocks
        return local
    if design == DESIGNS[0]:
        return AtenBlock(local, x.shape[2])
    t = local.as_subclass(FunctionBlock) if design == DESIGNS[1] else local
    t._rows = x.shape[2]
    return t


def _model(design: str, net: nn.Module) -> nn.Module:
    return InMode(net) if design == DESIGNS[2] else net


# --------------------------------------------------------------- on every rank
def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


def _error(net: nn.Module, model: nn.Module, design: str, x: torch.Tensor,
           loss: torch.Tensor, ref: list[torch.Tensor]) -> float:  # fmt: skip
    """The largest difference from the dense loss and gradients, relative to their scale."""
    net.zero_grad(set_to_none=True)
    out = model(_block(design, x))
    out.backward()
    scale = max([abs(float(loss))] + [float(r.abs().max()) for r in ref])
    diffs = [abs(float(out.detach()) - float(loss))]
    diffs += [float((p.grad - r).abs().max()) for p, r in zip(net.parameters(), ref, strict=True)]
    return max(diffs) / scale


def rank_job(comm: Any, cfg: Config) -> dict[str, Any]:
    """Exactness, graphs and steps of every design on this rank."""
    from torch._dynamo.utils import counters

    import parallelkit as pk

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Net(cfg.width, cfg.depth)
    sync = torch_sync(comm.group)
    result: dict[str, Any] = {}

    x64, dense = torch.randn(cfg.exact_shape, dtype=torch.float64), copy.deepcopy(base).double()
    loss = dense(x64)
    loss.backward()
    ref = _grads(dense)
    x = torch.randn(cfg.time_shape)
    torch.compile(copy.deepcopy(base))(x).backward()  # inductor's one-time start, unmeasured
    steps: dict[str, Any] = {}
    for design in DESIGNS:
        net = copy.deepcopy(base).double()
        row: dict[str, Any] = {
            "eager error": _error(net, _model(design, net), design, x64, loss, ref)
        }
        torch._dynamo.reset()
        compiled = torch.compile(_model(design, net))
        row["compiled error"] = _error(net, compiled, design, x64, loss, ref)
        explained = torch._dynamo.explain(_model(design, net))(_block(design, x64))
        row["graphs"], row["breaks"] = explained.graph_count, explained.graph_break_count
        row["break reasons"] = [str(b.reason)[:200] for b in explained.break_reasons]
        # new tensors each step: does the compiled code hold, or recompile?
        torch._dynamo.reset()
        net32 = copy.deepcopy(base)
        compiled = torch.compile(_model(design, net32))
        before = counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        compiled(_block(design, x)).backward()
        row["first compiled step s"] = sync.max(time.perf_counter() - started)
        for _ in range(4):
            compiled(_block(design, x)).backward()
        row["graphs compiled over 5 steps"] = counters["stats"]["unique_graphs"] - before
        eager = _model(design, net32)
        steps[f"{design}, eager"] = lambda m=eager, d=design: m(_block(d, x)).backward()
        steps[f"{design}, compiled"] = lambda m=compiled, d=design: m(_block(d, x)).backward()
        result[design] = row

    library = pk.parallelize(copy.deepcopy(base), comm, "spatial", spatial_input="blocks")
    torch._dynamo.reset()
    library_compiled = torch.compile(library)
    library_compiled(_block("", x)).backward()  # the compile, as above
    explained = torch._dynamo.explain(library)(_block("", x))
    result["parallelkit today"] = {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
    }
    steps["parallelkit today, eager"] = lambda: library(_block("", x)).backward()
    steps["parallelkit today, compiled"] = lambda: library_compiled(_block("", x)).backward()
    dense32 = copy.deepcopy(base)
    steps["dense, the whole input on one rank"] = lambda: dense32(x).backward()

    times: dict[str, list[float]] = {name: [] for name in steps}
    for name in steps:
        steps[name]()  # warm
    for name in alternating(list(steps), cfg.rounds):
        sync.barrier()
        started = time.perf_counter()
        for _ in range(cfg.steps):
            steps[name]()
        times[name].append(sync.max(time.perf_counter() - started) / cfg.steps)
    result["steps ms"] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return result


# --------------------------------------------------------------- parent
def report(cfg: Config, res: dict[str, Any], env: dict[str, str]) -> str:
    lines = [
        "# Compiling a spatial region: three designs, measured",
        "",
        f"Command: `{env['command']}`",
        "",
        f"Machine: {env['cpu']}, {env['nproc']} cores; python {env['python']}, torch "
        f"{env['torch']}; {env['date']}.",
        "",
        f"2 gloo ranks, rows split. The network: a 3x3 stem to {cfg.width} channels, "
        f"{cfg.depth} residual 3x3 blocks, a 1x1 head, a sum. Errors: the loss and every "
        f"parameter gradient against the dense network on the whole input, {cfg.exact_shape} "
        "in float64, relative to their largest value. Graphs: `torch._dynamo.explain` of the "
        "forward; then graphs compiled over 5 steps on new tensors. Steps: forward and "
        f"backward on {cfg.time_shape} in float32, median of {cfg.rounds} alternating rounds "
        f"of {cfg.steps}, the slowest rank.",
        "",
        "| design | eager error | compiled error | graphs | breaks | graphs compiled over 5 "
        "steps | first compiled step |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for design in DESIGNS:
        r = res[design]
        lines.append(
            f"| {design} | {r['eager error']:.1e} | {r['compiled error']:.1e} | {r['graphs']} "
            f"| {r['breaks']} | {r['graphs compiled over 5 steps']} | "
            f"{r['first compiled step s']:.1f} s |"
        )
    today = res["parallelkit today"]
    lines.append(
        f"| parallelkit today (its region runs eager under compile) | | | "
        f"{today['graphs']} | {today['breaks'] if today['graphs'] else '-'} | | |"
    )
    reasons = {d: res[d]["break reasons"] for d in DESIGNS if res[d]["break reasons"]}
    if reasons:
        lines += ["", "Graph breaks: " + "; ".join(f"{d}: {r}" for d, r in reasons.items())]
    steps = res["steps ms"]
    dense = steps["dense, the whole input on one rank"]
    lines += ["", "| step | ms | x dense |", "|---|--:|--:|"]
    lines += [f"| {name} | {ms:.2f} | {ms / dense:.2f} |" for name, ms in steps.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from parallelkit.testing import Ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    cfg = Config()
    if args.quick:
        cfg.rounds = 3
    # The first compiled step should be the compile itself, not a read of inductor's caches.
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    env = environment(command=command_line(), backend="gloo")
    with Ranks(2, "gloo", comm_timeout=900) as ranks:
        res = ranks.run(rank_job, cfg, timeout=WORKER_TIMEOUT_S)[0]
    markdown = report(cfg, res, env)
    print(markdown)
    default = Path("benchmarks/results/compile_designs.md")
    out = args.out or (Path("/tmp/compile_designs_quick.md") if args.quick else default)
    save(out, markdown, env, cfg, [res])


if __name__ == "__main__":
    main()
