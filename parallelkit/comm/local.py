"""The size-1 communicator: one process, no communication.

With one rank every collective is a copy. The base class already takes that fast path for any
size-1 group; the primitives below say the same for completeness.
"""

from __future__ import annotations

import torch

from parallelkit.comm.base import Communicator, DoneWork, Op, Work
from parallelkit.comm.settings import env_debug, env_timeout, resolve_device


class LocalCommunicator(Communicator):
    """A group of one rank (``pk.init("local")``): what single-device code runs on."""

    def __init__(
        self,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.rank, self.size, self.backend = 0, 1, "local"
        self.device = resolve_device(device)
        self.timeout = env_timeout() if timeout is None else timeout
        self.debug = env_debug() if debug is None else debug

    def _all_reduce(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(t)

    def _all_reduce_async(self, t: torch.Tensor, op: Op, out: torch.Tensor) -> Work:
        return DoneWork(out.copy_(t))

    def _all_gather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> torch.Tensor:
        return out.copy_(t)

    def _reduce_scatter(
        self, t: torch.Tensor, sizes: list[int], op: Op, out: torch.Tensor
    ) -> torch.Tensor:
        return out.copy_(t)

    def _broadcast(self, out: torch.Tensor, src: int) -> torch.Tensor:
        return out

    def _reduce(self, t: torch.Tensor, dst: int, op: Op, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(t)

    def _exchange(self, send: list, recv: list) -> None:
        assert not send and not recv, "a single rank only exchanges with itself"

    def _barrier(self) -> None:
        pass

    def _split(self, color: int, key: int) -> LocalCommunicator:
        return LocalCommunicator(timeout=self.timeout, debug=self.debug, device=self.device)

    def _host_all_gather(self, row: list[int]) -> list[list[int]]:
        return [row]
