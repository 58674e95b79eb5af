"""Global attention on split samples: memory per rank and step time of the head all-to-all, the
ring and gathering whole samples, against the dense model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/token_mixing.py            # ~5 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/token_mixing.py --ranks 4  # ~10 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/token_mixing.py --quick    # smoke, ~1 min

Two networks written here, so that they run in the main environment with nothing downloaded:

    volume  a UNETR-style encoder on a 3-D volume: a patch embedding (Conv3d, patch 8), ViT
            blocks (LayerNorm, multi-head self-attention by F.scaled_dot_product_attention,
            MLP) over the D*H*W/512 tokens, the tokens back to a map, a transposed-convolution
            decoder to the input's size and a 3x3x3 head
    image   a Segformer-style 2-D stage: the same, with patch 4 and efficient self-attention,
            whose keys and values come from the map reduced by a strided convolution (ratio 4)

Every variant is one training step (forward, loss, backward) of batch 1, float32, on P MPI
ranks (``--ranks``, 2 by default) that each hold 1/P of the sample (depth or rows), as
``pk.parallelize(model, comm, grid)`` runs it by default; the rank's step is the slowest
rank's, median of alternating rounds:

    dense   the plain model on the whole sample, on rank 0 alone (the others idle)
    heads   the volume network: 4 heads on 2 or 4 ranks and no mask, so the head all-to-all
    dense, bias
            the dense network with a whole relative-position bias (h, L, L) added to the
            scores, a parameter (zeros at the start), on rank 0 alone
    ring    that network parallelized: with a mask, the ring attention (against "dense,
            bias")
    gather  keep_dense=["encoder"]: the whole transformer runs on the gathered whole sample
            on every rank, as fallback="gather" would run it if its attention were refused
    pooled  the image network: its keys and values (16x fewer tokens) are gathered

Memory, per rank, from the step itself: the largest tensor any operator makes (a
``TorchDispatchMode``) and the bytes saved for backward (``saved_tensors_hooks``, each storage
once), against the dense model's divided by P. Parameters are left out (every rank holds them).

Results: benchmarks/results/token_mixing.md and .json (``token_mixing-<P>ranks`` for P > 2).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _common import alternating, comm_sync, command_line, environment, mpi_worker, run_mpi, save

WORKER_TIMEOUT_S = 1800.0
BIASED = "dense, bias"
DENSE = ("dense", BIASED)  # on rank 0 alone
REFERENCE = {"ring": BIASED}  # what a variant is compared with (else dense)


@dataclass
class Config:
    volume: int = 96  # side of the volume (UNETR's crops)
    image: int = 512  # side of the image
    width: int = 96
    heads: int = 4
    depth: int = 2
    warmup: int = 1
    repeats: int = 5
    ranks: int = 2


class Attention(nn.Module):
    """Multi-head self-attention over (N, L, C) tokens; keys and values from ``kv`` when
    given (Segformer's reduced map), a whole additive ``bias`` (h, L, L) when asked."""

    def __init__(self, c: int, heads: int, tokens: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.q, self.kv = heads, nn.Linear(c, c), nn.Linear(c, 2 * c)
        self.proj = nn.Linear(c, c)
        self.bias = nn.Parameter(torch.zeros(heads, tokens, tokens)) if bias else None

    def forward(self, t: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        n, length, c = t.shape
        src = t if kv is None else kv
        q = self.q(t).view(n, length, self.heads, -1).transpose(1, 2)
        k, v = self.kv(src).view(n, src.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, self.bias)
        return self.proj(y.transpose(1, 2).reshape(n, length, c))


class Encoder(nn.Module):
    """ViT blocks over the flattened map; ``reduce`` > 1: keys and values from the map reduced
    by a strided convolution (Segformer's efficient self-attention)."""

    def __init__(self, dims: int, c: int, heads: int, depth: int, tokens: int, bias: bool,
                 reduce: int) -> None:  # fmt: skip
        super().__init__()
        conv = getattr(nn, f"Conv{dims}d")
        self.norms = nn.ModuleList(nn.LayerNorm(c) for _ in range(2 * depth))
        self.attn = nn.ModuleList(Attention(c, heads, tokens, bias) for _ in range(depth))
        mlp = [nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
               for _ in range(depth)]  # fmt: skip
        self.mlp = nn.ModuleList(mlp)
        self.sr = conv(c, c, reduce, stride=reduce) if reduce > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, *spatial = x.shape
        kv = None if self.sr is None else self.sr(x).flatten(2).transpose(1, 2)
        t = x.flatten(2).transpose(1, 2)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp, strict=True)):
            t = t + attn(self.norms[2 * i](t), kv)
            t = t + mlp(self.norms[2 * i + 1](t))
        return t.transpose(1, 2).reshape(n, c, *spatial)


class Net(nn.Module):
    def __init__(self, dims: int, side: int, patch: int, cfg: Config, bias: bool = False,
                 reduce: int = 1) -> None:  # fmt: skip
        super().__init__()
        conv, up = getattr(nn, f"Conv{dims}d"), getattr(nn, f"ConvTranspose{dims}d")
        tokens = (side // patch) ** dims
        self.embed = conv(1, cfg.width, patch, stride=patch)
        self.encoder = Encoder(dims, cfg.width, cfg.heads, cfg.depth, tokens, bias, reduce)
        self.decode = up(cfg.width, 8, patch, stride=patch)
        self.head = conv(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.decode(self.encoder(self.embed(x)))))


class _Largest(TorchDispatchMode):
    """The largest tensor (bytes) any operator makes while active: new memory only (not a
    view or an in-place result, such as DataParallel's gradient buckets, nor a meta tensor:
    the spatial rules work out whole shapes on the meta device, which holds no memory), and
    not of a parameter's shape (its gradient: every rank holds the parameters)."""

    def __init__(self, params: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.largest, self.params = 0, params

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not t.is_meta  # shapes only: no memory
                    and tuple(t.shape) not in self.params
                    and t.untyped_storage().data_ptr() not in given):  # fmt: skip
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _memory(step: Any, model: nn.Module) -> dict[str, float]:
    """One step's largest tensor and saved-for-backward bytes (each storage once), in MiB,
    parameters left out."""
    saved: dict[int, int] = {}
    params = {tuple(p.shape) for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) not in params and not t.is_meta:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    largest = _Largest(params)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), largest:
        step()
    return {"largest_mib": largest.largest / 2**20, "saved_mib": sum(saved.values()) / 2**20}


def _step(model: nn.Module, x: torch.Tensor) -> Any:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return step


def rank_job(comm: Any, cfg: Config) -> dict[str, Any]:
    """Every variant's memory and step time on this rank; rank 0 alone runs dense."""
    import parallelkit as pk

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    cases = {
        "volume": (3, cfg.volume, 8, dict(depth=cfg.ranks), 1),
        "image": (2, cfg.image, 4, dict(rows=cfg.ranks), 4),
    }
    rows = []
    for name, (dims, side, patch, grid, reduce) in cases.items():
        x = torch.randn(1, 1, *(side,) * dims, generator=g)
        torch.manual_seed(0)
        plain = Net(dims, side, patch, cfg, reduce=reduce)
        variants: dict[str, nn.Module] = {"dense": plain}
        split = pk.Grid(comm, **grid)

        def parallel(model: nn.Module, split: Any = split, **kw: Any) -> nn.Module:
            # Outputs stay blocks: each rank's loss is over its block, as a segmentation's is.
            return pk.parallelize(model, split, split, spatial_output="blocks", **kw)

        if reduce == 1:
            biased = Net(dims, side, patch, cfg, bias=True)
            biased.load_state_dict(plain.state_dict(), strict=False)
            variants["heads"] = parallel(copy.deepcopy(plain))
            variants[BIASED] = biased
            variants["ring"] = parallel(copy.deepcopy(biased))
        else:
            variants["pooled"] = parallel(copy.deepcopy(plain))
        variants["gather"] = parallel(copy.deepcopy(plain), keep_dense=["encoder"])
        steps = {v: _step(m, x) for v, m in variants.items()}
        sync = comm_sync(comm)
        memory, times = {}, {v: [] for v in steps}
        for v, step in steps.items():
            sync.barrier()
            if v not in DENSE or comm.rank == 0:
                for _ in range(cfg.warmup):
                    step()
                memory[v] = _memory(step, variants[v])
        for v in alternating(list(steps), cfg.repeats):
            sync.barrier()
            start = time.perf_counter()
            if v not in DENSE or comm.rank == 0:
                steps[v]()
            times[v].append(sync.max(time.perf_counter() - start))
        tokens = (side // patch) ** dims
        ms = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
        rows.append({"case": name, "side": side, "tokens": tokens, "memory": memory, "ms": ms})
    return {"rank": comm.rank, "rows": rows}


def report(cfg: Config, results: list[dict[str, Any]], env: dict[str, str]) -> str:
    p = cfg.ranks
    lines = [
        f"# Global attention on split samples: memory per rank and step time, {p} MPI ranks", "",
        f"Command: `{env['command']}`", "",
        f"Machine: {env['cpu']}, {env['nproc']} cores; python {env['python']}, torch "
        f"{env['torch']}; {env['date']}.", "",
        f"Width {cfg.width}, {cfg.heads} heads, {cfg.depth} ViT blocks, batch 1, float32; "
        f"median of {cfg.repeats} alternating rounds, the slowest rank. Memory: the most of "
        f"the {p} ranks; `/ (dense / {p})` is against an even share of its dense step's (the "
        "ring's: the biased network's).", "",
    ]  # fmt: skip
    for i, row in enumerate(results[0]["rows"]):
        ms = row["ms"]
        lines += [f"## {row['case']}: {row['side']}^{3 if row['case'] == 'volume' else 2}, "
                  f"{row['tokens']} tokens", "",
                  f"| variant | ms / step | x its dense | largest tensor MiB | / (dense / {p}) "
                  f"| saved for backward MiB | / (dense / {p}) |",
                  "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
        for v in ms:
            ref = REFERENCE.get(v, "dense")
            dense = results[0]["rows"][i]["memory"][ref]
            mem = [r["rows"][i]["memory"][v] for r in results if v in r["rows"][i]["memory"]]
            largest = max(m["largest_mib"] for m in mem)
            saved = max(m["saved_mib"] for m in mem)
            share = 1 if v in DENSE else p
            lines.append(
                f"| {v} | {ms[v]:.0f} | {ms[v] / ms[ref]:.2f} | {largest:.1f} | "
                f"{largest / dense['largest_mib'] * share:.2f} | {saved:.1f} | "
                f"{saved / dense['saved_mib'] * share:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    p.add_argument("--ranks", type=int, default=2, help="ranks splitting each sample")
    p.add_argument("--image", type=int, help="the image's side (default 512)")
    p.add_argument("--volume", type=int, help="the volume's side (default 96)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        mpi_worker(rank_job, *args.worker, timeout=WORKER_TIMEOUT_S)
        return
    cfg = Config(ranks=args.ranks)
    if args.quick:
        cfg.volume, cfg.image, cfg.repeats = 32, 128, 2
    cfg.image, cfg.volume = args.image or cfg.image, args.volume or cfg.volume
    cfg.repeats = args.repeats or cfg.repeats
    env = environment(command=command_line())
    results = run_mpi(str(Path(__file__).resolve()), cfg.ranks, (cfg,), WORKER_TIMEOUT_S)
    markdown = report(cfg, results, env)
    print(markdown)
    suffix = "" if cfg.ranks == 2 else f"-{cfg.ranks}ranks"
    default = Path(f"benchmarks/results/token_mixing{suffix}.md")
    out = args.out or (Path("/tmp/token_mixing_quick.md") if args.quick else default)
    save(out, markdown, env, cfg, results)


if __name__ == "__main__":
    main()
