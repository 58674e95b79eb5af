"""The checks a communicator's public operations run before a backend sees a tensor.

Each raises the same ``ValueError`` on every rank for a user's mistake (not a tensor, a dtype
no backend moves, a tensor on another device than the communicator's, an ``out=`` buffer
that does not fit, a rank or sizes that do not belong to the group, an unknown reduction),
instead of a backend's obscure failure or a hang. In debug mode one more check compares the
call across ranks (:mod:`parallelkit.comm.debug`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from parallelkit.comm.debug import check_call
from parallelkit.comm.dtypes import DTYPES

Op = Literal["sum", "mean", "max", "min"]
OPS: tuple[str, ...] = ("sum", "mean", "max", "min")


class ArgumentChecks:
    """The checks of :class:`~parallelkit.comm.base.Communicator`, which derives from this:
    they read its ``rank``, ``size``, ``backend``, ``device`` and ``debug``."""

    def _contiguous(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise ValueError(f"{name}: dtype {t.dtype} is not supported; use one of {supported}")
        self._check_device(t, name)
        return t.contiguous()

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        if self.device is not None and t.device != self.device:
            raise ValueError(
                f"{name}: this {self.backend} communicator moves tensors on {self.device}, got a "
                f"{tuple(t.shape)} tensor on {t.device}; move it with .to(comm.device) (small "
                "host metadata goes through comm.all_gather_ints)"
            )

    def _reduce_input(
        self, t: torch.Tensor, op: str, name: str, check: bool = True
    ) -> torch.Tensor:
        t = self._contiguous(t, name)
        _check_op(op, t.dtype, name)
        if check:
            self._debug_check(name, t, extra=OPS.index(op))
        return t

    def _output(
        self, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, name: str
    ) -> torch.Tensor:
        """``out`` checked against the result's shape, dtype and device, or a new buffer.

        The input itself as ``out`` (an in-place call: it is already a contiguous tensor of
        ``like``'s dtype and device) needs only its shape checked. Each tensor attribute read
        costs about 0.1 us, a part of a small message's time worth saving on every call.
        """
        if out is None:
            return like.new_empty(shape)
        if out is like and out.shape == shape:
            return out
        if (
            not isinstance(out, torch.Tensor)
            or out.shape != shape
            or out.dtype != like.dtype
            or out.device != like.device
            or not out.is_contiguous()
        ):
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else out
            raise ValueError(
                f"{name}: out must be a contiguous {tuple(shape)} {like.dtype} tensor on "
                f"{like.device}, got {got}"
            )
        return out

    def _check_rank(self, r: int, name: str, what: str) -> None:
        if not 0 <= int(r) < self.size:
            raise ValueError(f"{name}: {what}={r} is not a rank of this group of size {self.size}")

    def _check_sizes(self, sizes: Sequence[int], own: int, name: str, dim: int) -> list[int]:
        sizes = list(map(int, sizes))
        if len(sizes) != self.size or sizes[self.rank] != own or min(sizes) < 0:
            raise ValueError(
                f"{name}: sizes {sizes} must list {self.size} sizes along dim {dim}, "
                f"this rank's ({self.rank}) being {own}"
            )
        return sizes

    def _debug_check(
        self, name: str, t: torch.Tensor, masked_dim: int | None = None, extra: int = 0
    ) -> None:
        """In debug mode, raise on every rank unless all ranks call ``name`` alike."""
        if self.debug and self.size > 1:
            check_call(self, name, t, masked_dim, extra)


def _check_op(op: str, dtype: torch.dtype, name: str) -> None:
    if op not in OPS:
        raise ValueError(f"{name}: op must be one of {OPS}, got {op!r}")
    if op == "mean" and not dtype.is_floating_point:
        raise ValueError(f"{name}: op='mean' needs a floating-point tensor, got {dtype}")
