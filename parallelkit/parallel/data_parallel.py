"""Data parallelism: every rank runs the whole model on its own batch; gradients are averaged.

``DataParallel(module, comm)`` works like torch's DistributedDataParallel, over any
communicator (gloo, NCCL, MPI, ...). At construction rank 0's parameters and buffers are
broadcast. In backward a hook counts each gradient the moment autograd has accumulated it
(``register_post_accumulate_grad_hook``); when a bucket is complete its gradients are copied
into its flat buffer in one operation and its all-reduce starts asynchronously while backward
goes on with earlier layers. A callback at the end of backward waits for the buckets and
copies the means back, so when ``loss.backward()`` returns every parameter's ``.grad`` is the
mean over ranks.

Buckets are launched strictly in bucket order on every rank (collectives are matched by
order), so a bucket that completes early waits for the ones before it. They start in reverse
parameter order; after the first synchronized backward they are rebuilt in the order the
gradients really arrived (rank 0's order, broadcast once), as DDP does.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from parallelkit.comm import Communicator, Work, world
from parallelkit.nn.sync_batchnorm import SyncBatchNorm
from parallelkit.parallel.buckets import Bucket, assign_buckets

COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DataParallel(nn.Module):
    """Average gradients over ``comm`` in buckets overlapped with backward.

    Args:
        module: the model, used as is (its parameters and buffers become rank 0's).
        comm: the data-parallel communicator (``None``: the world communicator of ``pk.init``).
        bucket_cap_mb: bucket size in MiB (DDP's default, 25; the first bucket holds at most
            1 MiB so communication starts early). 0 gives every parameter its own all-reduce.
        find_unused_parameters: allow parameters that get no gradient in a backward, on some
            ranks or on all; otherwise that is an error naming them. A parameter unused on
            every rank keeps its ``.grad``; one used on some ranks gets the mean, zeros counted.
        compression: None, "bf16" or "fp16": all-reduce float gradients in that dtype (half
            the bytes; they are divided by the group size first, against overflow).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm running statistics)
            before each forward in training mode, as DDP does. A SyncBatchNorm over ``comm``
            keeps its own buffers equal on every rank (each computes them from the same merged
            statistics), so those are left out: two collectives and a few hundred small
            operations a step on a ResNet-50. The layers that hold buffers are found once, at
            construction, as DDP does, not by a walk of every module at each forward.
        reduce_over: parameter name -> the communicator to average its gradient over instead
            of ``comm``, or ``None`` to leave it alone (e.g. a parameter that model parallelism
            shards over ``comm`` and whose layer reduces it itself).
        replicas: how many model replicas ``comm`` holds (default: one per rank). The
            gradients are summed over ``comm`` and divided by it: under spatial parallelism
            one replica spans the ranks of a spatial group, each holding a share of the
            replica's gradient (``pk.parallelize`` passes the data dimension).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        compression: str | None = None,
        broadcast_buffers: bool = True,
        reduce_over: Mapping[str, Communicator | None] | None = None,
        replicas: int | None = None,
    ) -> None:
        super().__init__()
        if compression not in COMPRESSION:
            raise ValueError(
                f"DataParallel: compression must be None, 'bf16' or 'fp16', got {compression!r}"
            )
        if bucket_cap_mb < 0:
            raise ValueError(f"DataParallel: bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        reduce_over = dict(reduce_over or {})
        if unknown := sorted(set(reduce_over) - {n for n, _ in module.named_parameters()}):
            raise ValueError(f"DataParallel: reduce_over names unknown parameters {unknown}")
        self.module = module
        self._buffer_holders = [m for m in module.modules() if any(True for _ in m.buffers(False))]
        self.comm = comm if comm is not None else world()
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.compression = COMPRESSION[compression]
        self.replicas = self.comm.size if replicas is None else replicas
        if not 1 <= self.replicas <= self.comm.size or self.comm.size % self.replicas:
            raise ValueError(
                f"DataParallel: replicas must divide the group size {self.comm.size}, got "
                f"{replicas}"
            )
        self._cap_bytes = bucket_cap_mb * 2**20

        # Every parameter starts as rank 0's copy over the group that averages it.
        by_comm: dict[int, tuple[Communicator, list[torch.Tensor]]] = {}
        for name, p in module.named_parameters():
            c = reduce_over.get(name, self.comm)
            if c is not None:
                by_comm.setdefault(id(c), (c, []))[1].append(p)
        for c, tensors in by_comm.values():
            _broadcast_coalesced(tensors, c)
        _broadcast_coalesced(list(module.buffers()), self.comm)

        # Only gradients averaged over more than one rank go into buckets.
        self._names, self._params, self._comms = [], [], []
        for name, p in module.named_parameters():
            c = reduce_over.get(name, self.comm)
            if p.requires_grad and c is not None and c.size > 1:
                self._names.append(name)
                self._params.append(p)
                self._comms.append(c)
                # Hooks hold the wrapper weakly: a parameter holding it strongly would keep it
                # (buffers, the model) alive through autograd, out of the garbage collector's
                # sight, after the wrapper is dropped.
                me = weakref.ref(self)
                p.register_post_accumulate_grad_hook(
                    functools.partial(_call, me, "_on_grad_ready", len(self._params) - 1)
                )
                if self.replicas < self.comm.size and c is self.comm:
                    p.register_hook(functools.partial(_call, me, "_grads_to_shares"))
        self._require_sync = True
        self._whole_grads = False  # replicas span several ranks and .grad holds whole sums
        self._rebuild_pending = True
        self._build_buckets(list(reversed(range(len(self._params)))))

    # ------------------------------------------------------------------ user-facing
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.training and self.comm.size > 1:
            _broadcast_coalesced(_not_kept_equal(self._buffer_holders, self.comm), self.comm)
        return self.module(*args, **kwargs)

    def _grads_to_shares(self, grad: torch.Tensor) -> torch.Tensor:
        """Before the first gradient of a backward is accumulated: gradients kept from a
        synchronized backward (accumulation without zero_grad) are whole, the same on every
        rank of a replica, and the coming sum over the replica's ranks would count them once
        per rank, so each rank keeps its share of them."""
        if self._whole_grads:
            self._whole_grads = False
            shares = self.comm.size // self.replicas
            with torch.no_grad():
                for p, c in zip(self._params, self._comms, strict=True):
                    if p.grad is not None and c is self.comm:
                        p.grad.div_(shares)
        return grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally; the next one outside averages them."""
        before, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = before

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names in each bucket, in launch order."""
        return [[self._names[i] for i in b.params] for b in self._buckets]

    # ------------------------------------------------------------------ buckets
    def _build_buckets(self, order: Sequence[int]) -> None:
        keys = [(id(c), p.dtype, p.device) for c, p in zip(self._comms, self._params, strict=True)]
        wire = [self._wire_dtype(p.dtype) for p in self._params]
        self._buckets: list[Bucket] = assign_buckets(
            [p.numel() for p in self._params],
            keys,
            [torch.empty((), dtype=d).element_size() for d in wire],
            order,
            self._cap_bytes,
        )
        # One flat buffer per bucket, plus (with find_unused_parameters) one "used" flag per
        # parameter at its end: the sum over ranks says which parameters were used anywhere.
        flags = self.find_unused_parameters
        self._flat = [
            torch.zeros(
                b.numel + (len(b.params) if flags else 0),
                dtype=wire[b.params[0]],
                device=self._params[b.params[0]].device,
            )
            for b in self._buckets
        ]
        # Each parameter's slot in its bucket, as a view made once (not twice per step).
        self._where, self._slots = {}, {}
        for k, b in enumerate(self._buckets):
            for slot, i in enumerate(b.params):
                self._where[i] = (k, slot)
                start, p = b.offsets[slot], self._params[i]
                self._slots[i] = self._flat[k][start : start + p.numel()].view_as(p)
        self._reset()

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.compression is not None and dtype in (torch.float32, torch.float64):
            return self.compression
        return dtype

    def _reset(self) -> None:
        self._ready = [False] * len(self._params)
        self._missing = [len(b.params) for b in self._buckets]
        self._works: list[Work] = []
        self._queued = False
        self._arrival: list[int] = []

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        if not self._require_sync or self._ready[i]:
            return
        if not self._queued:  # first gradient of this backward: finish when backward does
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._arrival.append(i)
        self._ready[i] = True
        self._missing[self._where[i][0]] -= 1
        self._launch_complete()

    def _fill(self, k: int) -> None:
        """Bucket k's gradients divided by the group size, in two operations for the bucket
        where every parameter has a gradient of the wire dtype (one per parameter would cost
        more than the copy on a fast device); otherwise parameter by parameter."""
        bucket, flat = self._buckets[k], self._flat[k]
        grads = [self._params[i].grad for i in bucket.params]
        if not all(g is not None and g.dtype == flat.dtype for g in grads):
            for i in bucket.params:
                self._copy_in(i, self._params[i].grad)
            return
        torch._foreach_copy_([self._slots[i] for i in bucket.params], grads)
        flat[: bucket.numel].mul_(self._scale(bucket.params[0]))
        if self.find_unused_parameters:
            flat[bucket.numel :] = 1.0

    def _scale(self, i: int) -> float:
        """What parameter i's gradient is multiplied by before the sum over its ranks."""
        comm = self._comms[i]
        return 1.0 / (self.replicas if comm is self.comm else comm.size)

    def _copy_in(self, i: int, grad: torch.Tensor | None) -> None:
        """Put ``grad / group size`` (zeros for no gradient) into parameter i's bucket slot."""
        k, slot = self._where[i]
        view, scale = self._slots[i], self._scale(i)
        if grad is None:
            view.zero_()
        elif view.dtype == grad.dtype:
            torch.mul(grad, scale, out=view)
        else:
            view.copy_(grad).mul_(scale)
        if self.find_unused_parameters:
            self._flat[k][self._buckets[k].numel + slot] = 0.0 if grad is None else 1.0

    def _launch_complete(self) -> None:
        """Start the all-reduces of complete buckets, in bucket order."""
        while len(self._works) < len(self._buckets) and self._missing[len(self._works)] == 0:
            k = len(self._works)
            self._fill(k)
            comm = self._comms[self._buckets[k].params[0]]
            self._works.append(comm.all_reduce_async(self._flat[k], out=self._flat[k]))

    def _finish(self) -> None:
        """End of backward: reduce what is left, wait, and write the means into ``.grad``."""
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if missing and not self.find_unused_parameters:
            for work in self._works:  # leave no collective in flight
                work.wait()
            self._reset()
            names = [self._names[i] for i in missing]
            raise ValueError(
                f"DataParallel: parameters {names} got no gradient in this backward. Pass "
                "find_unused_parameters=True if the model does not use every parameter in "
                "every step, or reduce_over={name: None} to leave a parameter out."
            )
        # The buckets still waiting are filled as they are launched: a gradient accumulated
        # under no_sync still counts, and none counts as zeros.
        for k in range(len(self._buckets)):
            self._missing[k] = 0
        self._launch_complete()
        for k, work in enumerate(self._works):
            work.wait()
            self._copy_out(k)
        if self._rebuild_pending:
            self._rebuild(self._arrival + missing)
        self._whole_grads = self.replicas < self.comm.size
        self._reset()

    def _copy_out(self, k: int) -> None:
        """Bucket k's means into ``.grad``: existing gradients in one fused copy."""
        bucket = self._buckets[k]
        used = [1.0] * len(bucket.params)
        if self.find_unused_parameters:  # the flags read once per bucket (a device sync)
            used = self._flat[k][bucket.numel :].tolist()
        grads, means = [], []
        for slot, i in enumerate(bucket.params):
            if used[slot] == 0:
                continue  # unused on every rank: leave .grad alone
            p, mean = self._params[i], self._slots[i]
            if p.grad is None:
                p.grad = mean.to(p.dtype, copy=True)
            else:
                grads.append(p.grad)
                means.append(mean)
        if grads:
            torch._foreach_copy_(grads, means)

    def _rebuild(self, arrival: list[int]) -> None:
        """Buckets in the order gradients arrived in the first backward, rank 0's order."""
        self._rebuild_pending = False
        order = self.comm.all_gather_ints(arrival)[0]  # host metadata: rank 0's order
        if order != list(reversed(range(len(self._params)))):
            self._build_buckets(order)


def _call(ref: weakref.ref, method: str, *args):  # type: ignore[no-untyped-def]
    """``ref().method(*args)`` while the wrapper lives; a tensor hook's return value."""
    obj = ref()
    if obj is not None:
        return getattr(obj, method)(*args)
    return None


def _not_kept_equal(holders: list[nn.Module], comm: Communicator) -> list[torch.Tensor]:
    """The buffers of ``holders`` that no layer keeps equal on every rank of ``comm`` by
    itself.

    A SyncBatchNorm over ``comm`` updates its running statistics from the same merged batch
    statistics on every rank, in the same operations, so its buffers are equal already.
    """
    return [
        b for m in holders if not (isinstance(m, SyncBatchNorm) and m.comm is comm)
        for b in m.buffers(recurse=False)
    ]  # fmt: skip


def _broadcast_coalesced(tensors: list[torch.Tensor], comm: Communicator) -> None:
    """Overwrite ``tensors`` with rank 0's values: one broadcast per dtype and device."""
    if comm.size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = comm.broadcast(torch.cat([t.reshape(-1) for t in group]), src=0)
            values = flat.split([t.numel() for t in group])
            torch._foreach_copy_(group, [v.view_as(t) for t, v in zip(group, values, strict=True)])
