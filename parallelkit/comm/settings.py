"""A communicator's settings, as ``pk.init`` and every backend read them: the timeout of a
stuck collective and debug mode (from the environment unless given), and the device its data
tensors must live on, resolved to the index its tensors report.
"""

from __future__ import annotations

import os

import torch

DEFAULT_TIMEOUT_S = 1800.0
"""Collectives that have not finished after this many seconds raise (torch) or abort (MPI)."""


def env_timeout() -> float:
    """Timeout from ``PARALLELKIT_TIMEOUT`` (seconds), else :data:`DEFAULT_TIMEOUT_S`."""
    return float(os.environ.get("PARALLELKIT_TIMEOUT", DEFAULT_TIMEOUT_S))


def env_debug() -> bool:
    """Debug mode from ``PARALLELKIT_DEBUG`` (any of 1/true/yes)."""
    return os.environ.get("PARALLELKIT_DEBUG", "").lower() in ("1", "true", "yes")


def resolve_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as its tensors report it, index included (``"cuda"`` -> ``cuda:0``)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.index is not None or device.type == "cpu":
        return device
    return torch.empty(0, device=device).device
