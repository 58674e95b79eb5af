"""The log interval: the losses of the steps since the last log line, and their one reduction.

Why sums over an interval: reading a loss on the host waits for the device and, reduced over
ranks, for every rank. So each step only adds its loss tensors to device sums; every
``log_every`` steps one all-reduce (mean over the data group) turns the sums into the numbers
that are logged. That is the loop's only host synchronisation.
"""

from __future__ import annotations

import time

import torch

from parallelkit.comm import Communicator


class LogInterval:
    """Sums of per-step losses since the last :meth:`reduce`, with the steps' timing."""

    def __init__(self, data_comm: Communicator, batch_size: int) -> None:
        self.comm, self.batch_size = data_comm, batch_size
        self.sums: dict[str, torch.Tensor] = {}
        self.steps, self.start = 0, time.perf_counter()

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        """One step's losses (0-dim device tensors); no synchronisation."""
        self.steps += 1
        for k, v in losses.items():
            self.sums[k] = self.sums.get(k, 0) + v.float()

    def reduce(self) -> tuple[dict[str, float], float]:
        """(mean of each loss over the interval's steps and the data group, global images/s);
        collective over the data group. Starts a new interval."""
        names = sorted(self.sums)
        means = self.comm.all_reduce(torch.stack([self.sums[k] for k in names]), "mean")
        rate = self.steps * self.batch_size / (time.perf_counter() - self.start)
        out = {k: v / self.steps for k, v in zip(names, means.tolist(), strict=True)}
        self.sums.clear()
        self.steps, self.start = 0, time.perf_counter()
        return out, rate
