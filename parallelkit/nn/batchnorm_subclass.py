"""BatchNorm subclasses made synchronous with all their own behaviour kept.

A subclass of ``nn.BatchNorm2d`` often does more than normalize: timm's ``BatchNormAct2d``
also applies an activation and drop path, in its own ``forward``. Replacing it by a
:class:`~parallelkit.nn.SyncBatchNorm` would drop that behaviour. Instead its class becomes a
synchronous subclass of itself whose ``forward`` is the original one, run while every
``F.batch_norm`` it calls goes to :func:`~parallelkit.nn.sync_batch_norm` over the given ranks
(a torch function mode sees the call). The module keeps its tree, its parameters and buffers,
and its state_dict keys; ``to_dense`` gives back the original class.

A subclass whose training forward never calls ``F.batch_norm`` (it normalizes some other way)
cannot be synchronized this way: it raises a ``ValueError`` on every rank at its first
training forward, rather than normalizing each rank's slice alone.

:func:`convert_sync_batchnorm` lives here, above :mod:`parallelkit.nn.sync_batchnorm`, because
it chooses between the two ways: a plain BatchNorm becomes a ``SyncBatchNorm``, a subclass a
synchronous subclass of itself.
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from parallelkit.comm import Communicator, world
from parallelkit.nn.sync_batchnorm import SyncBatchNorm, sync_batch_norm


class _BatchNormToSync(TorchFunctionMode):
    """Sends every ``F.batch_norm`` call to :func:`sync_batch_norm`; counts the calls."""

    def __init__(self, comm: Communicator, grad_comm: Communicator | None) -> None:
        super().__init__()
        self.comm, self.grad_comm, self.calls = comm, grad_comm, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.batch_norm:
            self.calls += 1
            return sync_batch_norm(*args, **kwargs, comm=self.comm, grad_comm=self.grad_comm)
        return func(*args, **kwargs)


class _SyncSubclass:
    """Mixed in front of a BatchNorm subclass by :func:`sync_subclass`."""

    _pk_comm: Communicator | None
    _pk_grad_comm: Communicator | None
    _pk_dense_class: type[nn.Module]
    takes_blocks = "norm"  # parallelkit.spatial.blocks

    def communicators(self) -> tuple[Communicator | None, Communicator | None]:
        """(statistics, parameter-gradient) communicators, for ``use_communicators``."""
        return self._pk_comm, self._pk_grad_comm

    def use_communicators(self, comm: Communicator | None, grad_comm: Communicator | None) -> None:
        self._pk_comm, self._pk_grad_comm = comm, grad_comm

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        comm = self._pk_comm if self._pk_comm is not None else world()
        mode = _BatchNormToSync(comm, self._pk_grad_comm)
        with mode:
            out = self._pk_dense_class.forward(self, *args, **kwargs)
        if self.training and mode.calls == 0:
            raise ValueError(
                f"parallelize: {self._pk_dense_class.__qualname__} is a BatchNorm subclass whose "
                "forward does not call F.batch_norm, so its statistics cannot be synchronized "
                "over the ranks; keep it out of the parallel region (keep_dense=[...]) or "
                "replace it by a BatchNorm that does"
            )
        return out

    def to_dense(self) -> nn.Module:
        """The same module as its original class (sharing parameters and buffers)."""
        dense = copy.copy(self)
        dense.__class__ = self._pk_dense_class
        for name in ("_pk_comm", "_pk_grad_comm", "_pk_dense_class"):
            dense.__dict__.pop(name, None)
        return dense


def sync_subclass(
    module: _BatchNorm,
    comm: Communicator | None,
    grad_comm: Communicator | None = None,
) -> nn.Module:
    """``module`` (a BatchNorm subclass) with batch statistics over ``comm`` (None: the world
    communicator of ``pk.init()``, looked up at the first forward), in place.

    ``grad_comm`` sums its parameter-gradient shares over the ranks that hold blocks of the
    same images (spatial parallelism), as :class:`~parallelkit.nn.SyncBatchNorm` does.
    """
    dense_class = type(module)
    module.__class__ = type(f"Sync{dense_class.__name__}", (_SyncSubclass, dense_class), {})
    module._pk_comm, module._pk_grad_comm = comm, grad_comm
    module._pk_dense_class = dense_class
    return module


def is_plain_batchnorm(module: nn.Module) -> bool:
    """torch's BatchNorm1d/2d/3d or SyncBatchNorm, or ours: normalizing is all they do."""
    plain = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, SyncBatchNorm)
    return type(module) in plain


def convert_sync_batchnorm(module: nn.Module, comm: Communicator | None = None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` (and torch's ``SyncBatchNorm``) by a SyncBatchNorm.

    Parameters (the same tensors), buffers and training mode are kept. Returns ``module``
    itself converted in place, or the new layer if ``module`` is a batch norm. Other
    subclasses of BatchNorm (timm's ``BatchNormAct2d``) keep their class and behaviour and
    synchronize their ``F.batch_norm`` calls (:func:`sync_subclass`).
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if not is_plain_batchnorm(module):
            return sync_subclass(module, comm)
        return SyncBatchNorm.from_dense(module, comm)
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, comm)
        if converted is not child:
            setattr(module, name, converted)
    return module
