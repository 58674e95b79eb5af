"""XLA backend: the collectives of ``torch_xla.core.xla_model`` between the replicas of a job.

Under ``torch_xla.launch`` / ``xmp.spawn`` every XLA device is one replica (rank); PJRT runs
the replicas as threads of one process (CPU devices, TPU v2/v3 cores) or as processes (one
per TPU chip on v4 and later). ``pk.init("xla")`` in each replica gives its communicator.

Lazy tensors. torch_xla records operations into a graph and runs it at ``torch_xla.sync()``
(or when a value is read on the host). A collective here only adds its HLO operation to the
graph (all-reduce, all-gather, reduce-scatter, collective-permute), so a whole training step,
forward, backward and gradient all-reduces, stays one graph that XLA compiles once. Nothing
in this module reads a device value.

Host tensors. The layers also pass small *host* (CPU) tensors to collectives: the block
sizes a spatial layer learns from its neighbours, the bucket order DataParallel settles once,
the signatures of debug mode, ``split``'s colours. Sending them through the device would add
a device-to-host read, which ends the graph mid-step. They are exchanged on the host instead
(:class:`_HostExchange`): between threads of one process through shared memory, which never
touches the device; between processes with ``xm.rendezvous``, torch_xla's own payload
exchange, which does run a small device program and so ends the pending graph (on multi-host
TPU, layers that exchange host data every step, the spatial ones, are better run with SPMD:
see ``parallelkit.xla`` and docs/tpu.md). A host exchange is world-wide: every replica
reaches each one, in the same order, which holds for programs where every replica runs the
same layers.

Why not derive sizes from static shapes instead: the blocks of a tensor_split layout differ
by one between ranks (7 rows over 2 ranks are 4 + 3), and a rank's own block does not tell
the others' (3 could be the last block of 6 or of 7), so the sizes must be exchanged; on
threads the exchange is free.

XLA specifics, each handled below:

- replica groups must partition all replicas (``groups`` lists every group, not only this
  one), so ``split`` is world-wide too: every replica calls it, each on its own group;
- all-gather and reduce-scatter take equal blocks: uneven blocks are padded to the largest;
- collective-permute sends one tensor per replica along fixed (source, target) pairs that
  every replica must know: ``neighbor_exchange`` shares its message list on the host (the
  list, not the data), then sends in rounds in which each replica sends and receives at most
  one (flattened, padded) message: a halo exchange in both directions is one round;
- broadcast and reduce mask with a 0/1 *device* tensor, not a constant, so that every
  replica traces the same graph (torch_xla's ``collective_broadcast`` does the same).

Legend: ``ordinal`` a replica's global index (``xr.global_ordinal()``), ``rank`` its index in
this communicator, ``members[rank] = ordinal``.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from parallelkit.comm.base import CommError, Communicator, DoneWork, Op, Work
from parallelkit.comm.settings import env_debug, env_timeout

_XM_OPS = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}
_HOST_OPS = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
Group = list[int]


class XlaCommunicator(Communicator):
    """The replicas ``members`` (global ordinals, in rank order) of an XLA job.

    ``groups`` is the partition of all replicas that this communicator belongs to (its
    ``split`` siblings included), what XLA's replica groups need. Default: all replicas.

    ``pin_layout`` (torch_xla's option, on by default as there) fixes the memory layout of
    collective operands, so that replicas whose programs differ (spatial layers trace
    different graphs on edge and inner ranks) cannot disagree on it; torch_xla then lowers
    an all-gather as an all-reduce of zero-padded blocks. ``pin_layout=False`` emits real
    all-gathers, moving a group's size times less data, for programs identical on all ranks.
    """

    def __init__(
        self,
        members: Sequence[int] | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        pin_layout: bool = True,
    ) -> None:
        world = xr.world_size()
        self.ordinal = xr.global_ordinal()
        self.members: Group = list(range(world) if members is None else members)
        self.groups: list[Group] = [list(g) for g in groups] if groups else [self.members]
        self.rank, self.size = self.members.index(self.ordinal), len(self.members)
        self.backend = "xla"
        self.timeout = env_timeout() if timeout is None else timeout
        self.debug = env_debug() if debug is None else debug
        self.device = torch_xla.device()
        self.pin_layout = pin_layout
        self._host = _HostExchange.get(world)
        self._flags: dict[tuple[int, str], torch.Tensor] = {}
        # XLA writes "all replicas" as no groups at all; anything else lists every group.
        self._xla_groups = None if len(self.groups) == 1 else self.groups

    @classmethod
    def init(
        cls, *, timeout: float | None = None, debug: bool | None = None, pin_layout: bool = True
    ) -> XlaCommunicator:
        """The world communicator of this replica (one per XLA device)."""
        if xr.is_spmd():
            raise ValueError(
                "pk.init('xla'): this process runs XLA SPMD (xr.use_spmd()), where one process "
                "drives every device and there are no ranks; use parallelkit.xla.parallelize "
                "(or pk.parallelize(..., backend='xla-spmd')) instead of a communicator"
            )
        return cls(timeout=timeout, debug=debug, pin_layout=pin_layout)

    # ------------------------------------------------------------------ reductions
    def _all_reduce(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> torch.Tensor:
        if not _on_xla(t):
            return out.copy_(_HOST_OPS[op](torch.stack(self._host_gather(t)), 0))
        reduced = xm.all_reduce(_XM_OPS[op], t, groups=self._xla_groups, pin_layout=self.pin_layout)
        return out.copy_(reduced)

    def _all_reduce_async(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> Work:
        # Lazy tensors are asynchronous already: the reduction runs with the step's graph.
        return DoneWork(self._all_reduce(t, op, out))

    def _reduce(self, t: torch.Tensor, dst: int, op: Op, out: torch.Tensor) -> torch.Tensor:
        total = self._all_reduce(t, op, torch.empty_like(t))
        if not _on_xla(t):
            return out.copy_(total) if self.rank == dst else out.zero_()
        return out.copy_(torch.where(self._is_rank(dst, t.device), total, 0))

    def _broadcast(self, out: torch.Tensor, src: int) -> torch.Tensor:
        if not _on_xla(out):
            return out.copy_(self._host_gather(out)[src])
        # A sum in which only src contributes; where() rather than a product, so that
        # whatever the other ranks hold (even NaN) cannot leak in.
        masked = torch.where(self._is_rank(src, out.device), out, 0)
        return out.copy_(xm.all_reduce(
            xm.REDUCE_SUM, masked, groups=self._xla_groups, pin_layout=self.pin_layout
        ))

    # ------------------------------------------------------------------ gather, scatter
    def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
        if not _on_xla(t):
            return torch.cat(self._host_gather(t), out=out)
        self._check_equal_groups("all_gather")
        block = max(sizes)
        if min(sizes) == block:
            return out.copy_(self._xm_all_gather(t))
        gathered = self._xm_all_gather(_pad_rows(t, block))
        pieces = [gathered[r * block : r * block + n] for r, n in enumerate(sizes)]
        return out.copy_(torch.cat(pieces))

    def _reduce_scatter(
        self, t: torch.Tensor, sizes: list[int], op: Op, out: torch.Tensor
    ) -> torch.Tensor:
        if not _on_xla(t):
            total = _HOST_OPS[op](torch.stack(self._host_gather(t)), 0)
            start = sum(sizes[: self.rank])
            return out.copy_(total[start : start + sizes[self.rank]])
        self._check_equal_groups("reduce_scatter")
        block = max(sizes)
        if min(sizes) != block:  # every block padded to the largest
            t = torch.cat([_pad_rows(piece, block) for piece in torch.split(t, sizes)])
        mine = xm.reduce_scatter(
            _XM_OPS[op], t, 1.0, 0, self.size, groups=self._xla_groups, pin_layout=self.pin_layout
        )
        return out.copy_(mine[: sizes[self.rank]])

    # ------------------------------------------------------------------ neighbours
    def _exchange(
        self, send: list[tuple[int, int, torch.Tensor]], recv: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Collective-permute rounds over the messages of every replica, learnt on the host.

        The list is world-wide, like the exchange that shares it, so that every replica
        traces the same permutes (the groups of a split exchange side by side). A round
        carries at most one message out of and into each replica, all of one dtype, flattened
        and padded to the round's longest; every replica runs every round, sending zeros where
        it has nothing to send. Host tensors travel with the list itself.
        """
        mine = [
            (self.members[peer], tag, t.numel(), str(t.dtype), None if _on_xla(t) else t)
            for peer, tag, t in send
        ]
        table = self._host.exchange(self.ordinal, mine, self.timeout)
        messages = [
            (src, dst, tag, numel, dtype)
            for src, sent in sorted(table.items())
            for dst, tag, numel, dtype, host in sent
            if host is None
        ]
        wanted = {(self.members[peer], tag): buf for peer, tag, buf in recv}
        for src, sent in table.items():
            for dst, tag, _, _, host in sent:
                if host is not None and dst == self.ordinal:
                    buf = wanted[(src, tag)]
                    buf.copy_(host.view(buf.shape))
        outgoing = {(self.members[peer], tag): t for peer, tag, t in send}
        for round_ in _rounds(messages):
            width = max(numel for _, _, _, numel, _ in round_)
            dtype = getattr(torch, round_[0][4].removeprefix("torch."))
            payload = torch.zeros(width, dtype=dtype, device=self.device)
            for src, dst, tag, _, _ in round_:
                if src == self.ordinal:
                    payload = _pad_rows(outgoing[(dst, tag)].reshape(-1), width)
            received = xm.collective_permute(payload, [[src, dst] for src, dst, *_ in round_])
            for src, dst, tag, numel, _ in round_:
                if dst == self.ordinal:
                    buf = wanted[(src, tag)]
                    buf.copy_(received[:numel].view(buf.shape))

    # ------------------------------------------------------------------ groups
    def _barrier(self) -> None:
        self._host_gather(None)

    def _split(self, color: int, key: int) -> XlaCommunicator:
        """MPI_Comm_split, world-wide: the new groups of every replica form XLA's partition."""
        table = self._host.exchange(self.ordinal, (tuple(self.members), color, key), self.timeout)
        new_groups: dict[tuple[tuple[int, ...], int], list[tuple[int, int, int]]] = {}
        for ordinal, (parent, c, k) in sorted(table.items()):
            new_groups.setdefault((parent, c), []).append((k, parent.index(ordinal), ordinal))
        groups = [[o for _, _, o in sorted(g)] for _, g in sorted(new_groups.items())]
        members = next(g for g in groups if self.ordinal in g)
        return XlaCommunicator(
            members, groups, timeout=self.timeout, debug=self.debug, pin_layout=self.pin_layout
        )

    def _host_all_gather(self, row: list[int]) -> list[list[int]]:
        return [list(r) for r in self._host_gather(row)]  # replicas in threads share objects

    # ------------------------------------------------------------------ helpers
    def _check_device(self, t: torch.Tensor, name: str) -> None:
        """Host tensors are accepted too: every primitive sends them on the host exchange."""
        if t.device.type != "cpu":
            super()._check_device(t, name)

    def _host_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (host data), in rank order, without touching the device."""
        table = self._host.exchange(self.ordinal, value, self.timeout)
        return [table[o] for o in self.members]

    def _xm_all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return xm.all_gather(t, 0, groups=self._xla_groups, pin_layout=self.pin_layout)

    def _is_rank(self, rank: int, device: torch.device) -> torch.Tensor:
        """A 0-d device bool, true on ``rank``: data, not a constant, so that every replica
        traces the same graph. Uploaded once per rank and device, then reused."""
        key = (rank, str(device))
        if key not in self._flags:
            self._flags[key] = torch.tensor(self.rank == rank).to(device)
        return self._flags[key]

    def _check_equal_groups(self, name: str) -> None:
        if len({len(g) for g in self.groups}) > 1:
            raise ValueError(
                f"{name}: XLA gathers and scatters within replica groups of one size, but this "
                f"communicator was split into groups of sizes {[len(g) for g in self.groups]}; "
                "split into equal groups (as pk.Grid does)"
            )


def _on_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended along dim 0 up to ``rows``."""
    if t.shape[0] == rows:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - t.shape[0]])


def _rounds(messages: list[tuple[int, int, int, int, str]]) -> list[list[tuple]]:
    """Messages ``(src, dst, tag, numel, dtype)`` in rounds: in each, one dtype, and every rank
    sends at most one and receives at most one message. Greedy, in a fixed order, so that
    every rank computes the same rounds."""
    rounds: list[list[tuple]] = []
    for message in sorted(messages, key=lambda m: (m[4], m[2], (m[1] - m[0]), m[0])):
        src, dst, _, _, dtype = message
        for r in rounds:
            if r[0][4] == dtype and all(m[0] != src and m[1] != dst for m in r):
                r.append(message)
                break
        else:
            rounds.append([message])
    return rounds


class _HostExchange:
    """All-gathers of small Python values between all replicas, on the host.

    ``exchange(ordinal, value)`` returns ``{ordinal: value}`` of every replica; replicas call
    it in the same order. Replicas that are threads of this process meet in shared memory;
    replicas in several processes meet through ``xm.rendezvous``.
    """

    _instances: ClassVar[dict[int, _HostExchange]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, world: int) -> None:
        self.world = world
        self.threads = xr.process_count() == 1
        self._cond = threading.Condition()
        self._slots: dict[int, dict[int, Any]] = {}
        self._read: dict[int, int] = {}
        self._calls: dict[int, int] = {}  # per replica; the autograd thread may call too

    @classmethod
    def get(cls, world: int) -> _HostExchange:
        with cls._lock:
            if world not in cls._instances:
                cls._instances[world] = cls(world)
            return cls._instances[world]

    def exchange(self, ordinal: int, value: Any, timeout: float) -> dict[int, Any]:
        if self.world == 1:
            return {ordinal: value}
        if not self.threads:
            with self._cond:
                seq = self._calls.get(ordinal, 0)
                self._calls[ordinal] = seq + 1
            payloads = xm.rendezvous(f"parallelkit-{seq}", pickle.dumps((ordinal, value)))
            return dict(pickle.loads(p) for p in payloads)
        with self._cond:
            seq = self._calls.get(ordinal, 0)
            self._calls[ordinal] = seq + 1
            slot = self._slots.setdefault(seq, {})
            slot[ordinal] = value
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(slot) == self.world, timeout):
                missing = sorted(set(range(self.world)) - set(slot))
                raise CommError(
                    f"xla: replicas {missing} did not reach host exchange #{seq} within "
                    f"{timeout:g} s (one failed, or the replicas called different collectives)"
                )
            self._read[seq] = self._read.get(seq, 0) + 1
            if self._read[seq] == self.world:  # the last reader frees the slot
                del self._slots[seq], self._read[seq]
            return dict(slot)
