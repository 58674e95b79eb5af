"""Communicators: move tensors between ranks, one small class per backend.

``init()`` is the factory. It imports a backend's library only when that backend is chosen, so
``mpi4py`` (or ``torch_xla``) need not be installed to use the others.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from parallelkit.comm import launcher
from parallelkit.comm.base import CommError, Communicator, Op, Work
from parallelkit.comm.settings import DEFAULT_TIMEOUT_S

BACKENDS = ("auto", "gloo", "nccl", "mpi", "xla", "local")

_WORLD: Communicator | None = None


def detect_backend() -> str:
    """What ``init("auto")`` picks, from the launcher's environment variables
    (:mod:`parallelkit.comm.launcher`).

    A PJRT device configured (``PJRT_DEVICE`` set, as on a Cloud TPU VM or under
    ``torch_xla.launch``) with torch_xla installed -> xla; torchrun -> nccl when CUDA is
    available, else gloo; an ``srun`` step -> nccl on GPU nodes, else mpi; mpiexec -> mpi;
    otherwise (a plain process, the batch script of ``sbatch`` included) one local process.
    """
    if os.environ.get("PJRT_DEVICE") and importlib.util.find_spec("torch_xla") is not None:
        return "xla"
    name = launcher.detect().name
    if name == "torchrun" or (name == "srun" and torch.cuda.is_available()):
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "mpi" if name in ("srun", "mpiexec") else "local"


def init(
    backend: str = "auto",
    *,
    timeout: float | None = None,
    debug: bool | None = None,
    device: torch.device | str | None = None,
) -> Communicator:
    """The world communicator of this job.

    backend: "auto" | "gloo" | "nccl" | "mpi" | "xla" | "local". gloo/nccl read the torchrun
    variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR defaulting to 127.0.0.1, MASTER_PORT);
    mpi works under mpiexec/srun; xla in each replica under torch_xla.launch / xmp.spawn (one
    per XLA device); "local" is one process.
    timeout: seconds before a stuck collective raises (torch) or aborts the job (MPI); default
        ``PARALLELKIT_TIMEOUT`` or 1800.
    debug: check before each collective that all ranks agree (default ``PARALLELKIT_DEBUG``).
    device: where data tensors must live; collectives refuse others with a ValueError. Default:
        ``cuda:LOCAL_RANK`` under NCCL, the XLA device under XLA, any device otherwise (gloo and
        MPI stage device tensors through host memory).
    """
    global _WORLD
    _WORLD = _create(backend, timeout, debug, device)
    return _WORLD


def world() -> Communicator:
    """The communicator the last ``init()`` returned: what ``comm=None`` means in layers."""
    if _WORLD is None:
        raise ValueError("no world communicator: call pk.init() first, or pass comm= explicitly")
    return _WORLD


def _create(
    backend: str, timeout: float | None, debug: bool | None, device: torch.device | str | None
) -> Communicator:
    if backend not in BACKENDS:
        raise ValueError(f"pk.init: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = detect_backend()
    if backend in ("gloo", "nccl"):
        from parallelkit.comm.torch_dist import TorchCommunicator

        return TorchCommunicator.init(backend, timeout=timeout, debug=debug, device=device)
    if backend == "mpi":
        from parallelkit.comm.mpi import MPICommunicator

        return MPICommunicator.init(timeout=timeout, debug=debug, device=device)
    if backend == "xla":
        from parallelkit.comm.xla import XlaCommunicator

        return XlaCommunicator.init(timeout=timeout, debug=debug)
    from parallelkit.comm.local import LocalCommunicator

    return LocalCommunicator(timeout=timeout, debug=debug, device=device)


__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "CommError",
    "Communicator",
    "Op",
    "Work",
    "detect_backend",
    "init",
    "world",
]
