"""torch.distributed backend: gloo on CPUs, NCCL on GPUs (the same code path).

Collectives run on a ``ProcessGroup``; ranks given to and returned by this communicator are
ranks within that group. torch.distributed has no way to abort a peer, so a failed rank is
noticed through gloo's connection errors or, at worst, through the collective timeout given to
``init_process_group``; errors are re-raised as :class:`CommError` saying so.

Devices. An NCCL group moves CUDA tensors only, so ``pk.init("nccl")`` creates the world
group as ``"cpu:gloo,cuda:nccl"``: data on the GPU goes through NCCL and the small host
metadata of :meth:`~parallelkit.comm.Communicator.all_gather_ints` through gloo, in the same
group (sub-groups inherit both). A group made elsewhere without a CPU backend gets a gloo
companion group for its host metadata. The communicator declares ``device`` (this rank's GPU
under NCCL) and refuses data tensors elsewhere. A gloo group moves host memory: tensors on a
device (several ranks sharing one GPU, say) are staged through host buffers explicitly.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import os
import sys
import traceback
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from parallelkit.comm import launcher, traced
from parallelkit.comm.base import PEER_FAILED_EXIT, CommError, Communicator, Op, Work
from parallelkit.comm.settings import env_debug, env_timeout, resolve_device

# torch 2.13 renamed the single-tensor collectives; older releases (torch_xla's) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NEW_GROUP_ARGS = inspect.signature(dist.new_group).parameters
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
START_TIMEOUT_S = 300.0
"""The least time the rendezvous waits for every rank to start (``pk.init``'s timeout, when
longer, applies instead)."""


class TorchCommunicator(Communicator):
    """A communicator over a torch.distributed process group (the world group by default).

    ``device``: where data tensors must be (default: the current CUDA device under NCCL, any
    device otherwise). ``host_group``: the group for host metadata (default: ``group`` itself
    when it has a CPU backend, else a new gloo group over the same ranks).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        device: torch.device | str | None = None,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        config = str(dist.get_backend_config(self.group))  # e.g. "cpu:gloo,cuda:nccl"
        self.backend = "nccl" if "nccl" in config else str(dist.get_backend(self.group))
        self.timeout = env_timeout() if timeout is None else timeout
        self.debug = env_debug() if debug is None else debug
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        if device is None and self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = resolve_device(device)
        # gloo reads and writes host memory: tensors on a device are staged through it.
        self._stage = self.backend != "nccl"
        if host_group is None:
            host_group = self.group if "cpu:" in config else _gloo_group(self._global)
        self._host_group = host_group

    @classmethod
    def init(
        cls,
        backend: str,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        device: torch.device | str | None = None,
    ) -> TorchCommunicator:
        """Join (or create) the default process group from the torchrun environment (under
        ``srun``, from Slurm's: :func:`parallelkit.comm.launcher.torch_variables`)."""
        if not dist.is_initialized():
            job = launcher.detect()
            if job.name == "srun" and "RANK" not in os.environ:  # srun: Slurm's variables
                os.environ.update(launcher.torch_variables(job))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise ValueError(
                    f"pk.init({backend!r}) reads the torchrun variables; {', '.join(missing)} "
                    "not set. Launch with torchrun, or use backend='local' for one process."
                )
            seconds = env_timeout() if timeout is None else timeout
            kwargs = {}
            if backend == "nccl":
                local_rank = int(os.environ.get("LOCAL_RANK", 0))
                torch.cuda.set_device(local_rank)
                kwargs["device_id"] = torch.device("cuda", local_rank)
                backend = "cpu:gloo,cuda:nccl"  # host metadata on gloo, data on NCCL
            # The rendezvous waits for ranks that start late (a loaded machine, a slow file
            # system) up to its own limit, never less than the collectives' (a short one, set
            # to catch a stuck collective fast, would fail the start instead); its store keeps
            # that limit, so gloo's connection of each pair of ranks waits as long. torch's
            # env:// handler makes the store as init_process_group would, torchrun's agent
            # store included; the process group then runs under ``seconds``.
            start = datetime.timedelta(seconds=max(seconds, START_TIMEOUT_S))
            store, rank, size = next(dist.rendezvous("env://", timeout=start))
            dist.init_process_group(
                backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                world_size=size, timeout=datetime.timedelta(seconds=seconds), **kwargs,
            )  # fmt: skip
            # Tear the group down before the interpreter does: gloo's threads, still alive at
            # interpreter shutdown, can abort the process ("terminate called without an
            # active exception") after the job's work is done.
            atexit.register(_destroy_default_group)
            _install_except_hook()
        return cls(timeout=timeout, debug=debug, device=device)

    @contextlib.contextmanager
    def _errors(self, name: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, CommError):
                raise
            raise CommError(
                f"{self.backend} {name} failed on rank {self.rank} of {self.size}: {e}\n"
                f"A peer rank has probably failed. torch.distributed collectives time out after "
                f"{self.timeout:g} s (pk.init(timeout=...) or PARALLELKIT_TIMEOUT)."
            ) from e

    # Under torch.compile: functional collectives that dynamo keeps in the graph (traced.py).
    def _traceable(self, t: torch.Tensor, out: torch.Tensor | None) -> bool:
        return (self.size > 1 and out is None and not self.debug and traced.tracing()
                and not self._staged(t))  # fmt: skip

    def all_reduce(self, t: torch.Tensor, op: Op = "sum", *, out: torch.Tensor | None = None
                   ) -> torch.Tensor:  # fmt: skip
        if self._traceable(t, out):
            return traced.all_reduce(t, op, self.group, self.size)
        return super().all_reduce(t, op, out=out)

    def all_gather(self, t: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if self._traceable(t, out) and traced.equal(sizes, t.shape[dim]):
            return traced.all_gather(t, dim, self.group)
        return super().all_gather(t, dim, sizes, out=out)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0, op: Op = "sum",
                       sizes: Sequence[int] | None = None, *, out: torch.Tensor | None = None,
                       ) -> torch.Tensor:  # fmt: skip
        if self._traceable(t, out) and sizes is None and t.shape[dim] % self.size == 0:
            return traced.reduce_scatter(t, dim, op, self.group, self.size)
        return super().reduce_scatter(t, dim, op, sizes, out=out)

    def broadcast(self, t: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
                  ) -> torch.Tensor:  # fmt: skip
        if self._traceable(t, out) and 0 <= src < self.size:
            return traced.broadcast(t, self._global[src], self.group)
        return super().broadcast(t, src, out=out)

    # Staging (gloo with device tensors): inputs are copied to the host, results computed in
    # host buffers and copied back into the caller's ``out``; otherwise both are used as given.
    def _staged(self, t: torch.Tensor) -> bool:
        return self._stage and t.device.type != "cpu"

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or its host copy when staged."""
        return t.cpu() if self._staged(t) else t

    def _host_buffer(self, out: torch.Tensor) -> torch.Tensor:
        """``out``, or a host buffer of its shape when staged."""
        return torch.empty(out.shape, dtype=out.dtype) if self._staged(out) else out

    def _in_place_buffer(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A buffer holding ``t`` for an in-place collective: ``out`` or a host copy of ``t``."""
        if self._staged(t):
            return t.cpu()
        return out if out is t else out.copy_(t)

    def _all_reduce(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> torch.Tensor:
        return self._all_reduce_async(t, op, out).wait()

    def _all_reduce_async(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> Work:
        buf = self._in_place_buffer(t, out)
        with self._errors("all_reduce"):
            work = dist.all_reduce(buf, op=_OPS[op], group=self.group, async_op=True)
        return _TorchWork(self, work, buf, out)

    def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
        src, dst = self._on_host(t), self._host_buffer(out)
        block = max(sizes)
        if min(sizes) == block:
            with self._errors("all_gather"):
                _all_gather_single(dst, src, group=self.group)
            return _copy_back(out, dst)
        # gloo gathers equal sizes only: pad every rank's block to the largest.
        padded = torch.cat([src, src.new_zeros(block - src.shape[0], *src.shape[1:])])
        gathered = src.new_empty(self.size * block, *src.shape[1:])
        with self._errors("all_gather"):
            _all_gather_single(gathered, padded, group=self.group)
        pieces = [gathered[r * block : r * block + n] for r, n in enumerate(sizes)]
        return _copy_back(out, torch.cat(pieces, out=dst))

    def _reduce_scatter(
        self, t: torch.Tensor, sizes: list[int], op: Op, out: torch.Tensor
    ) -> torch.Tensor:
        src, dst = self._on_host(t), self._host_buffer(out)
        block = max(sizes)
        if min(sizes) == block:
            with self._errors("reduce_scatter"):
                _reduce_scatter_single(dst, src, op=_OPS[op], group=self.group)
            return _copy_back(out, dst)
        padded = src.new_zeros(self.size * block, *src.shape[1:])  # blocks padded to the largest
        for r, piece in enumerate(torch.split(src, sizes)):
            padded[r * block : r * block + sizes[r]] = piece
        mine = src.new_empty(block, *src.shape[1:])
        with self._errors("reduce_scatter"):
            _reduce_scatter_single(mine, padded, op=_OPS[op], group=self.group)
        return out.copy_(mine[: sizes[self.rank]])

    def _broadcast(self, out: torch.Tensor, src: int) -> torch.Tensor:
        buf = self._on_host(out)
        with self._errors("broadcast"):
            dist.broadcast(buf, src=self._global[src], group=self.group)
        return _copy_back(out, buf)

    def _reduce(self, t: torch.Tensor, dst: int, op: Op, out: torch.Tensor) -> torch.Tensor:
        buf = self._in_place_buffer(t, out)
        with self._errors("reduce"):
            dist.reduce(buf, dst=self._global[dst], op=_OPS[op], group=self.group)
        return _copy_back(out, buf if self.rank == dst else buf.zero_())

    def _exchange(
        self, send: list[tuple[int, int, torch.Tensor]], recv: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        host_recv = [(p, tag, self._host_buffer(t)) for p, tag, t in recv]
        ops = [
            dist.P2POp(dist.isend, self._on_host(t), self._global[p], self.group, tag)
            for p, tag, t in send
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self._global[p], self.group, tag) for p, tag, t in host_recv
        ]
        with self._errors("neighbor_exchange"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for (_, _, buf), (_, _, host) in zip(recv, host_recv, strict=True):
            _copy_back(buf, host)

    def _barrier(self) -> None:
        with self._errors("barrier"):
            dist.barrier(group=self._host_group)

    def _host_all_gather(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64)
        table = mine.new_empty(self.size * len(row))  # gloo takes the flat form only
        with self._errors("all_gather_ints"):
            _all_gather_single(table, mine, group=self._host_group)
        return table.view(self.size, len(row)).tolist()

    def _split(self, color: int, key: int) -> TorchCommunicator:
        # torch has no comm_split for gloo: learn every rank's (color, key), then each new group
        # is created by its own members only (use_local_synchronization).
        table = self.all_gather_ints([color, key])
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        ranks = [self._global[r] for _, r in members]
        kwargs = {"sort_ranks": False} if "sort_ranks" in _NEW_GROUP_ARGS else {}
        if not kwargs and ranks != sorted(ranks):
            raise ValueError("split: this torch sorts group ranks; order keys like ranks")
        with self._errors("split"):
            group = dist.new_group(ranks, use_local_synchronization=True, **kwargs)
            host_group = None if self._host_group is self.group else _gloo_group(ranks)
        return TorchCommunicator(
            group, timeout=self.timeout, debug=self.debug, device=self.device, host_group=host_group
        )


class _TorchWork:
    """An all-reduce in flight on ``buf``; ``wait()`` leaves the result in ``out``."""

    def __init__(
        self, comm: TorchCommunicator, work: dist.Work, buf: torch.Tensor, out: torch.Tensor
    ) -> None:
        self._comm, self._work, self._buf, self._out = comm, work, buf, out

    def wait(self) -> torch.Tensor:
        with self._comm._errors("all_reduce"):
            self._work.wait()
        return _copy_back(self._out, self._buf)


def _copy_back(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``buf``'s data (a no-op unless ``buf`` is a host stand-in for ``out``)."""
    return out if buf is out else out.copy_(buf)


def _gloo_group(ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` (global ranks) for host metadata, made by its members."""
    kwargs = {"sort_ranks": False} if "sort_ranks" in _NEW_GROUP_ARGS else {}
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kwargs)


def _install_except_hook() -> None:
    """An uncaught exception ends this rank at once, without the leave-together barrier of a
    normal exit (:func:`_destroy_default_group`).

    Its peers are typically stuck in a collective waiting for this rank, so a barrier would
    hold it until the collective timeout (``parallel.timeout``, minutes), and the launcher,
    which stops the job when one rank exits, would not learn of the failure. Exiting at once
    (after printing the traceback) closes this rank's connections, the peers' collectives
    fail, and the launcher (torchrun, ``parallelkit train``) stops the others within seconds
    and names this rank. ``PARALLELKIT_ABORT_ON_EXCEPTION=0`` keeps ``sys.excepthook``.
    """
    if os.environ.get("PARALLELKIT_ABORT_ON_EXCEPTION", "1") != "0":
        sys.excepthook = _exit_on_exception(sys.excepthook)


def _exit_on_exception(previous):  # type: ignore[no-untyped-def]
    def hook(exc_type, value, tb):  # type: ignore[no-untyped-def]
        try:
            rank, size = dist.get_rank(), dist.get_world_size()
            if issubclass(exc_type, CommError):
                # Nearly always the echo of a peer that failed first (and said why): one line,
                # with where this rank was, rather than a traceback that hides the cause.
                frames = [f for f in traceback.extract_tb(tb) if "contextlib" not in f.filename
                          and f"parallelkit{os.sep}comm" not in f.filename]  # fmt: skip
                where = frames[-1] if frames else None
                at = f" (in {where.name}, {where.filename}:{where.lineno})" if where else ""
                sys.stderr.write(
                    f"parallelkit: rank {rank} of {size} leaves: "
                    f"{str(value).splitlines()[0]}{at}\n"
                )
                return
            previous(exc_type, value, tb)
            sys.stderr.write(
                f"parallelkit: uncaught exception on rank {rank} of {size}; leaving at once "
                "(no leave-together barrier), so that the launcher stops the other ranks\n"
            )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PEER_FAILED_EXIT if issubclass(exc_type, CommError) else 1)

    return hook


def _destroy_default_group() -> None:
    """Leave together, then tear down: a rank that exits while a peer still talks to the
    store or the group can abort that peer. A peer that is gone (a failed job) costs at most
    the 30 s of the monitored barrier. Normal exits only: an uncaught exception leaves at
    once (:func:`_install_except_hook`)."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.destroy_process_group()
    # The world communicator still holds its groups; freed here, their threads are joined
    # while the interpreter is whole, not left to the C++ exit where a running one aborts.
    import parallelkit.comm

    parallelkit.comm._WORLD = None
    gc.collect()
