"""Rank-side DataParallel cases, shared by the gloo and mpiexec tiers.

The reference is one process training the same model on the concatenated global batch; the
parallel run gives each rank its slice, with the loss scaled so that the mean over ranks of the
gradients is the global batch's gradient even when slices differ in size.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.comm import Communicator
from parallelkit.nn import SyncBatchNorm, convert_sync_batchnorm
from parallelkit.parallel import DataParallel

BATCHES = {
    "equal": lambda r, n: 4,
    "uneven": lambda r, n: r + 2,
    "one empty rank": lambda r, n: 0 if r == n - 1 and n > 1 else 3,
}


def small_cnn(batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(1)
    norm = nn.BatchNorm2d if batchnorm else lambda c: nn.Identity()
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        norm(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, bias=False),
        norm(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def _batch(step: int, sizes: list[int], dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(sizes), 1, 9, 9, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (sum(sizes),), generator=g)
    return x, y


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def training_parity(
    comm: Communicator,
    batches: str = "uneven",
    steps: int = 5,
    dtype: torch.dtype = torch.float64,
    micro: int = 1,
    device: str | None = None,
    **dp_kwargs,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """SGD with momentum for ``steps`` steps: parameters and buffers after every step.

    ``micro > 1`` splits each rank's slice into micro-batches, all but the last under
    ``no_sync()``: gradient accumulation must equal the big batch (without BatchNorm, whose
    statistics would then differ by construction). ``device``: where the replicas train.
    """
    sizes = [BATCHES[batches](r, comm.size) for r in range(comm.size)]
    total, start, mine = sum(sizes), sum(sizes[: comm.rank]), sizes[comm.rank]
    reference = small_cnn(batchnorm=micro == 1).to(dtype)
    # Start every rank from different weights: DataParallel must broadcast rank 0's.
    torch.manual_seed(comm.rank)
    local = copy.deepcopy(reference)
    if comm.rank > 0:
        for p in local.parameters():
            p.data.normal_()
    model = DataParallel(convert_sync_batchnorm(local, comm).to(device), comm, **dp_kwargs)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

    triples = []
    for step in range(steps):
        x, y = _batch(step, sizes, dtype)
        opt_ref.zero_grad()
        F.cross_entropy(reference(x), y, reduction="sum").div(total).backward()
        opt_ref.step()

        opt.zero_grad()
        x_mine, y_mine = x[start : start + mine].to(device), y[start : start + mine].to(device)
        # The mean over ranks of these gradients is the global batch's gradient.
        scale = comm.size / total
        pieces = list(zip(x_mine.tensor_split(micro), y_mine.tensor_split(micro), strict=True))
        for j, (xj, yj) in enumerate(pieces):
            last = j == len(pieces) - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                F.cross_entropy(model(xj), yj, reduction="sum").mul(scale).backward()
        opt.step()
        ours, theirs = _state(model.module), _state(reference)
        triples += [(f"step {step} {k}", ours[k], theirs[k]) for k in theirs]
    return triples


def bucket_counts(comm: Communicator, bucket_cap_mb: float) -> int:
    model = DataParallel(small_cnn(), comm, bucket_cap_mb=bucket_cap_mb)
    return len(model.buckets)


def state_dict_after_backward(comm: Communicator) -> list[str]:
    """The wrapper is a module like DDP: its buffers and state_dict still work once its
    flat gradient buckets exist."""
    model = DataParallel(small_cnn(), comm)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    assert [n for n, _ in model.named_buffers()] == [
        f"module.{n}" for n, _ in model.module.named_buffers()
    ]
    return list(model.state_dict())


def broadcast_buffers(comm: Communicator, own_group: bool) -> tuple[list[int], list[float]]:
    """The sizes of the buffer broadcasts in a training forward, and the running means after it.

    Rank 1 perturbs every running mean first. The plain BatchNorm's buffers are broadcast
    (rank 0's win); a SyncBatchNorm over the wrapper's own communicator keeps its buffers
    equal by itself and is left out, unless it synchronizes over another communicator
    object (``own_group=False``, the negative control).
    """
    torch.manual_seed(0)
    sync_comm = comm if own_group else comm.split(0, comm.rank)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), SyncBatchNorm(4, comm=sync_comm))
    model = DataParallel(model, comm)
    if comm.rank == 1:
        with torch.no_grad():
            model.module[1].running_mean.fill_(7.0)
            model.module[2].running_mean.fill_(7.0)
    sizes, broadcast = [], comm.broadcast
    comm.broadcast = lambda t, src=0, **kw: sizes.append(t.numel()) or broadcast(t, src, **kw)
    try:
        model(torch.randn(2, 1, 6, 6))
    finally:
        del comm.broadcast
    return sizes, [float(model.module[1].running_mean[0]), float(model.module[2].running_mean[0])]


# ----------------------------------------------------------------------------- overlap, order
class _Branchy(nn.Module):
    """Parameters registered in a different order than they are used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(8, 2)
        self.body = nn.Linear(4, 8)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.head(torch.relu(self.body(x)))
        return out + self.extra(x) if use_extra else out


def launch_progress(comm: Communicator) -> list[int]:
    """How many gradients were ready when each bucket's all-reduce started (one per bucket)."""
    model = DataParallel(small_cnn(), comm, bucket_cap_mb=0)
    seen = []
    inner = comm.all_reduce_async

    def spy(*args, **kwargs):
        seen.append(sum(model._ready))
        return inner(*args, **kwargs)

    comm.all_reduce_async = spy
    try:
        model(torch.randn(2, 1, 9, 9)).sum().backward()
    finally:
        del comm.all_reduce_async
    return seen


def bucket_order(comm: Communicator) -> tuple[list, list]:
    """Buckets before and after the first backward (rebuilt in arrival order)."""
    model = DataParallel(_Branchy(), comm, bucket_cap_mb=0, find_unused_parameters=True)
    before = model.buckets
    model(torch.randn(3, 4)).sum().backward()
    return before, model.buckets


def unused_parameters(comm: Communicator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``extra`` is used on even ranks only: odd ranks contribute zeros to its mean."""
    plain = _Branchy()
    model = DataParallel(copy.deepcopy(plain), comm, find_unused_parameters=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(comm.rank))
    use_extra = comm.rank % 2 == 0
    for _ in range(2):  # the second step runs on the rebuilt buckets
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            m(x, use_extra).sum().backward()
    triples = []
    for (name, p), q in zip(plain.named_parameters(), model.module.parameters(), strict=True):
        local = p.grad if p.grad is not None else torch.zeros_like(p)
        triples.append((name, q.grad, comm.all_reduce(local) / comm.size))
    return triples


def globally_unused_keeps_none(comm: Communicator) -> bool:
    model = DataParallel(_Branchy(), comm, find_unused_parameters=True)
    model(torch.randn(3, 4)).sum().backward()
    return model.module.extra.weight.grad is None and model.module.head.weight.grad is not None


def unused_without_flag_raises(comm: Communicator) -> str:
    model = DataParallel(_Branchy(), comm)
    with pytest.raises(ValueError) as info:
        model(torch.randn(3, 4)).sum().backward()
    # The model still works afterwards once every parameter is used.
    model(torch.randn(3, 4), use_extra=True).sum().backward()
    return str(info.value)


def reduce_over(comm: Communicator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``head`` left alone, ``body`` averaged over pairs of ranks, ``extra`` over everyone."""
    pairs = comm.split(comm.rank // 2, comm.rank)
    plain = _Branchy()
    model = DataParallel(
        copy.deepcopy(plain),
        comm,
        reduce_over={
            "head.weight": None,
            "head.bias": None,
            "body.weight": pairs,
            "body.bias": pairs,
        },
    )
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(comm.rank))
    for m in (plain, model):
        m(x, True).sum().backward()
    grads = dict(plain.named_parameters())
    triples = []
    for name, q in model.module.named_parameters():
        g = grads[name].grad
        want = {"head": g, "body": pairs.all_reduce(g) / pairs.size}.get(name.split(".")[0])
        triples.append((name, q.grad, want if want is not None else comm.all_reduce(g) / comm.size))
    return triples


def dropped_wrapper_is_freed(comm) -> bool:
    """A DataParallel that nobody holds any more is garbage (its parameters' gradient hooks
    hold it weakly): otherwise every dropped model stays in memory for good."""
    import gc
    import weakref

    from torch import nn

    from parallelkit.parallel import DataParallel

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    wrapper = DataParallel(model, comm)
    wrapper(torch.randn(2, 3)).sum().backward()
    ref = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    return ref() is None
