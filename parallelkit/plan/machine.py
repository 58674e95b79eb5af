"""Where the ranks run, for the cost model: the cores they share, a rank's memory before and
beyond its tensors, and the memory of a rank's device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """Where the ranks run: ``cores`` they share (None: one device each, no sharing), the
    memory of a rank's process before any model (interpreter, torch, parallelkit), the
    memory a step takes beyond its tensors (see :func:`calibrate`), and the memory of a
    rank's device, when it has a limit the plan should check."""

    cores: float | None = None
    baseline_mib: float = 0.0
    # What a real step holds beyond the model's tensors (allocator caches, kernels'
    # workspaces): a 1-rank step's measured peak less this model's prediction for it.
    overhead_mib: float = 0.0
    # Cores that other processes keep busy meanwhile; they share the cores fairly (Linux's
    # scheduler), so each rank gets cores / (ranks + other_load) of one when oversubscribed.
    other_load: float = 0.0
    # Memory of one rank's device (None: not checked); a grid needing more is marked
    # as not fitting.
    device_mib: float | None = None

    def slowdown(self, ranks: int) -> float:
        """How much longer a rank's compute takes than on a core of its own."""
        if self.cores is None:
            return 1.0
        return max(1.0, (ranks + self.other_load) / self.cores)
