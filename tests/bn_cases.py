"""Rank-side SyncBatchNorm cases, shared by the gloo and mpiexec tiers.

Every rank builds the same global batch, runs torch.nn.BatchNorm*d on all of it, and runs
SyncBatchNorm on its own slice (a block of samples, or a band of rows of every image). Each
case returns (label, got, expected) triples: this rank's output and input-gradient slices,
the parameter gradients summed over ranks, and the running statistics after every step.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.comm.local import LocalCommunicator
from parallelkit.geometry import tensor_split_sizes
from parallelkit.nn import SyncBatchNorm

Triple = tuple[str, torch.Tensor, torch.Tensor]

BATCHES = {
    "equal": lambda r, n: 3,
    "uneven": lambda r, n: r + 1 if n > 1 else 2,
    "one empty rank": lambda r, n: 0 if r == n - 1 and n > 1 else r + 2,
    "one": lambda r, n: 1,
}
DENSE = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}

# name -> spec; see ``parity`` for the keys and their defaults.
CASES: dict[str, dict] = {
    "(N, C)": dict(features=(5,)),
    "(N, C, L), empty rank": dict(features=(4, 7), batches="one empty rank"),
    "(N, C, H, W)": dict(features=(3, 5, 4), steps=3),
    "(N, C, H, W) equal batches": dict(features=(3, 5, 4), batches="equal"),
    "(N, C, D, H, W), empty rank": dict(features=(2, 3, 4, 3), batches="one empty rank"),
    "momentum=None": dict(features=(3, 4, 4), bn=dict(momentum=None), steps=3),
    "affine=False": dict(features=(3, 4, 4), bn=dict(affine=False)),
    "track_running_stats=False": dict(features=(3, 4, 4), bn=dict(track_running_stats=False)),
    "no running stats, eval": dict(
        features=(3, 4, 4), bn=dict(track_running_stats=False), eval_after=True
    ),
    "eval after training": dict(features=(3, 4, 4), eval_after=True),
    "channels_last": dict(features=(6, 5, 3), memory_format=torch.channels_last),
    "channels_last_3d": dict(features=(3, 2, 3, 4), memory_format=torch.channels_last_3d),
    "bfloat16": dict(features=(4, 5, 5), dtype=torch.bfloat16, batches="one empty rank"),
    "float16": dict(features=(4, 5, 5), dtype=torch.float16),
    "float64": dict(features=(3, 4, 4), dtype=torch.float64),
    # Stable merging: a float64 reference, since float32 torch BN itself is off by ~3e-4 here
    # (its x * scale + shift loses digits when |x| >> std); E[x^2] - E[x]^2 would be off by ~10.
    "mean 1e4 >> std": dict(
        features=(3, 6, 6), offset=1e4, reference=torch.float64, tol=dict(rtol=1e-3, atol=1e-2)
    ),
    "height split": dict(features=(3, 9, 4), batches="equal", split="height", steps=2),
    "height split, 1 image": dict(features=(2, 7, 3), batches="one image", split="height"),
    # Spatial parallelism: the layer itself sums the parameter-gradient shares over the ranks.
    "height split, grad_comm": dict(
        features=(3, 9, 4), batches="equal", split="height", grad_comm=True
    ),
    # Volumes (BatchNorm3d) and signals (BatchNorm1d): "split" cuts the first spatial dimension,
    # D of a volume (the depth strategy), L of a signal.
    "3d (N, C, D, H, W) uneven": dict(features=(3, 4, 5, 3), steps=3),
    "3d float64 momentum=None": dict(
        features=(2, 3, 4, 4), dtype=torch.float64, bn=dict(momentum=None), steps=3
    ),
    "3d eval after training": dict(features=(3, 3, 4, 2), eval_after=True),
    "3d depth split": dict(features=(3, 7, 4, 3), batches="equal", split="height", steps=2),
    "3d depth split, 1 volume": dict(features=(2, 5, 3, 3), batches="one image", split="height"),
    "3d depth split, grad_comm": dict(
        features=(3, 7, 4, 3), batches="equal", split="height", grad_comm=True
    ),
    "1d (N, C, L) uneven": dict(features=(4, 9), steps=3),
    "1d length split": dict(features=(3, 11), batches="equal", split="height", steps=2),
}
# Gradients laid out otherwise than the input: where the ranks' slices and the dense batch meet
# torch's kernels on different paths. Only on 2 ranks or more: a communicator of one rank is
# torch's own BatchNorm, this layout's defect included (below).
LAYOUT_CASES: dict[str, dict] = {
    # A class token's cat backward leaves each sample's gradient channels last in memory,
    # offset by the token: torch's CPU batch-norm backward takes a batch of one as laid out
    # like its input (its channels-last check ignores the batch stride) and reads it wrongly.
    "one sample a rank, a class token's gradient": dict(
        features=(4, 5, 3), batches="one", dy_layout="tokens", steps=1
    ),
}
TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def parity(
    comm: Communicator, name: str, per_rank: bool = False, device: str | None = None
) -> list[Triple]:
    """SyncBatchNorm over ``comm`` on this rank's slice vs. dense BatchNorm on the whole batch.

    ``per_rank=True`` is the negative control: each rank normalizes with its own statistics.
    ``device``: where SyncBatchNorm and its input live (the reference stays on the CPU).
    """
    spec = {**CASES, **LAYOUT_CASES}[name]
    features, dtype = spec["features"], spec.get("dtype", torch.float32)
    fmt = spec.get("memory_format", torch.contiguous_format)
    kwargs = spec.get("bn", {})
    c = features[0]
    if spec.get("split", "batch") == "batch":
        sizes = [BATCHES[spec.get("batches", "uneven")](r, comm.size) for r in range(comm.size)]
        total, dim = sum(sizes), 0
    else:  # height: every rank holds the same images, a band of their rows
        total, dim = (1 if spec["batches"] == "one image" else 2), 2
        sizes = tensor_split_sizes(features[1], comm.size)
    start, mine = sum(sizes[: comm.rank]), sizes[comm.rank]

    torch.manual_seed(0)
    ref_dtype = spec.get("reference", dtype)
    dense = DENSE[len(features) + 1](c, **kwargs).to(ref_dtype if ref_dtype.itemsize > 4 else None)
    if dense.affine:
        with torch.no_grad():
            dense.weight.uniform_(0.5, 1.5)
            dense.bias.uniform_(-1, 1)
    sync = SyncBatchNorm(
        c,
        **kwargs,
        comm=LocalCommunicator() if per_rank else comm,
        grad_comm=comm if spec.get("grad_comm") else None,
    )
    sync.load_state_dict(dense.state_dict())
    sync.to(dtype if dtype.itemsize > 4 else None)
    sync.to(device)

    triples: list[Triple] = []
    tol = spec.get("tol", TOLERANCE.get(dtype, {}))
    for step in range(spec.get("steps", 2)):
        g = torch.Generator().manual_seed(step)
        shape = (total, *features)
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + spec.get("offset", 0.0)
        x = x.to(dtype).contiguous(memory_format=fmt)
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        x_mine = x.narrow(dim, start, mine).clone().to(device).contiguous(memory_format=fmt)
        x.requires_grad_()
        x_mine.requires_grad_()
        y = dense(x.to(ref_dtype))
        y.backward(dy.to(ref_dtype))
        y_mine = sync(x_mine)
        dy_mine = dy.narrow(dim, start, mine).to(device)
        y_mine.backward(_token_layout(dy_mine) if spec.get("dy_layout") else dy_mine)

        at = f"step {step}"
        triples.append((f"{at} output", y_mine, y.narrow(dim, start, mine)))
        triples.append((f"{at} input grad", x_mine.grad, x.grad.narrow(dim, start, mine)))
        if fmt != torch.contiguous_format and device is None:
            triples.append((f"{at} output format", _is(y_mine, fmt), torch.tensor(True)))
        if dense.affine:
            for p, q in ((sync.weight, dense.weight), (sync.bias, dense.bias)):
                summed = p.grad if spec.get("grad_comm") else comm.all_reduce(p.grad)
                triples.append((f"{at} param grad", summed, q.grad))
                p.grad, q.grad = None, None
        if dense.track_running_stats:
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                # Clone: the next step updates the buffers in place.
                triples.append(
                    (f"{at} {buf}", getattr(sync, buf).clone(), getattr(dense, buf).clone())
                )
    if spec.get("eval_after"):
        dense.eval()
        sync.eval()
        x = torch.randn((total, *features), generator=torch.Generator().manual_seed(9)).to(dtype)
        with torch.no_grad():
            triples.append(
                (
                    "eval output",
                    sync(x.narrow(dim, start, mine).to(device)),
                    dense(x).narrow(dim, start, mine),
                )
            )
    return [(label, got, expected.to(got.dtype), tol) for label, got, expected in triples]


def _token_layout(dy: torch.Tensor) -> torch.Tensor:
    """``dy``'s values in the layout that ``torch.cat((cls, y.flatten(2).transpose(1, 2)), 1)``'s
    backward leaves for ``y``: channels last in memory, behind one token's row."""
    n, c, *spatial = dy.shape
    rows = dy.new_empty(n, 1 + math.prod(spatial), c)
    out = rows[:, 1:].transpose(1, 2).unflatten(2, spatial)
    return out.copy_(dy)


def _is(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    return torch.tensor(t.is_contiguous(memory_format=fmt))


# ----------------------------------------------------------------------------- counting
_PRIMITIVES = (
    "_all_reduce",
    "_all_reduce_async",
    "_all_gather",
    "_reduce_scatter",
    "_broadcast",
    "_reduce",
    "_exchange",
    "_barrier",
)


@contextlib.contextmanager
def counting(comm: Communicator):
    """Count the backend primitives ``comm`` runs inside the block: ``{name: calls}``.

    Only outermost calls count: a backend may build one primitive on another.
    """
    counts: dict[str, int] = {}
    depth = [0]

    def wrap(name):
        inner = getattr(comm, name)

        def counted(*args, **kwargs):
            if depth[0] == 0:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return inner(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name in _PRIMITIVES:
        setattr(comm, name, wrap(name))
    try:
        yield counts
    finally:
        for name in _PRIMITIVES:
            delattr(comm, name)


def collective_counts(comm: Communicator, eval_mode: bool = False) -> tuple[int, int]:
    """How many collectives one SyncBatchNorm forward and one backward issue on this rank."""
    bn = SyncBatchNorm(4, comm=comm).train(not eval_mode)
    x = torch.randn(comm.rank + 2, 4, 3, 3, requires_grad=True)
    with counting(comm) as forward:
        y = bn(x)
    with counting(comm) as backward:
        (y * y).sum().backward()
    return sum(forward.values()), sum(backward.values())


def one_value_raises(comm: Communicator) -> str:
    """A global batch of one value per channel raises torch's error on every rank."""
    bn = SyncBatchNorm(3, comm=comm)
    x = torch.randn(1 if comm.rank == 0 else 0, 3)
    with pytest.raises(ValueError) as info:
        bn(x)
    return str(info.value)


def all_empty(comm: Communicator) -> list[Triple]:
    """An empty global batch behaves as torch does: empty output, running stats kept."""
    dense, sync = nn.BatchNorm2d(3), SyncBatchNorm(3, comm=comm)
    for bn in (dense, sync):
        bn.running_mean.fill_(2.0)
    x = torch.zeros(0, 3, 4, 4, requires_grad=True)
    y = sync(x)
    y.sum().backward()
    ref = dense(torch.zeros(0, 3, 4, 4))
    return [
        ("output", y, ref),
        ("input grad", x.grad, torch.zeros_like(x)),
        ("running_mean", sync.running_mean, dense.running_mean),
        ("running_var", sync.running_var, dense.running_var),
        ("num_batches_tracked", sync.num_batches_tracked, dense.num_batches_tracked),
    ]
