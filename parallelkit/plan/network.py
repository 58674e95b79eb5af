"""The network model of the planner: a message costs ``latency + bytes / bandwidth``.

The figures come from one of three places: a short probe between two local ranks on this
machine (:func:`probe`: gloo all-reduces of a small and a large tensor), the command line
(``--latency`` in microseconds, ``--bandwidth`` in GB/s), or a preset for an interconnect not
at hand (:data:`PRESETS`). Collectives are costed as ring algorithms over that link
(:meth:`Network.all_reduce` and friends), which is what NCCL and gloo run for large tensors;
for small ones the latency term dominates either way.

Local ranks share the machine's cores with the computation (gloo's threads copy the bytes),
so a probed network says ``shares_cores``: its messages slow down like the compute when ranks
outnumber cores. A preset describes a fabric with its own engines and does not.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Network:
    """One link: ``latency_s`` per message step, ``bandwidth_Bps`` bytes per second."""

    latency_s: float
    bandwidth_Bps: float
    name: str = "given"
    shares_cores: bool = False

    def message(self, nbytes: float) -> float:
        """Seconds for one point-to-point message of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of a tensor of ``nbytes``: 2(p-1) steps of nbytes/p each."""
        if ranks <= 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return steps * self.latency_s + steps * nbytes / ranks / self.bandwidth_Bps

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """Ring all-gather (or reduce-scatter) whose whole result is ``nbytes``."""
        if ranks <= 1:
            return 0.0
        steps = ranks - 1
        return steps * self.latency_s + steps * nbytes / ranks / self.bandwidth_Bps

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Figures per direction per device, the order of magnitude a plan needs; sources:
# - NVLink 4 (H100 SXM): 900 GB/s total bidirectional per GPU = 450 GB/s per direction
#   (NVIDIA H100 datasheet); NCCL's small-message latency within a node is a few us.
# - NVLink 3 (A100 SXM): 600 GB/s total bidirectional per GPU = 300 GB/s per direction
#   (NVIDIA A100 datasheet).
# - InfiniBand NDR: 400 Gb/s = 50 GB/s per port; HDR: 200 Gb/s = 25 GB/s (NVIDIA/Mellanox
#   ConnectX-7 / ConnectX-6 product briefs); ~2 us MPI latency (vendor ping-pong figures).
# - TPU v4 ICI: 2,400 Gb/s per chip over 6 links (Google Cloud TPU v4 documentation; Jouppi
#   et al., ISCA 2023) = 50 GB/s per link; collectives over ICI start in a few us.
# - TPU v5e ICI: 1,600 Gb/s per chip over 4 links (Google Cloud TPU v5e documentation)
#   = 50 GB/s per link.
# - 100 Gb Ethernet: 12.5 GB/s, ~10 us with RDMA (RoCE).
PRESETS: dict[str, Network] = {
    "nvlink4": Network(5e-6, 450e9, "nvlink4"),
    "nvlink3": Network(5e-6, 300e9, "nvlink3"),
    "ib-ndr": Network(2e-6, 50e9, "ib-ndr"),
    "ib-hdr": Network(2e-6, 25e9, "ib-hdr"),
    "tpu-v4-ici": Network(5e-6, 50e9, "tpu-v4-ici"),
    "tpu-v5e-ici": Network(5e-6, 50e9, "tpu-v5e-ici"),
    "ethernet-100g": Network(10e-6, 12.5e9, "ethernet-100g"),
}


def given(latency_us: float, bandwidth_GBps: float) -> Network:
    """A network from command-line figures (microseconds, GB/s = 1e9 bytes/s)."""
    if latency_us < 0 or bandwidth_GBps <= 0:
        raise ValueError(
            f"network: latency must be >= 0 us and bandwidth > 0 GB/s, got {latency_us} us "
            f"and {bandwidth_GBps} GB/s"
        )
    return Network(latency_us * 1e-6, bandwidth_GBps * 1e9, "given")


# ---------------------------------------------------------------------------- the probe
SMALL, LARGE = 1 << 10, 16 << 20  # bytes: latency-bound, bandwidth-bound
REPEATS = 5


def _probe_ranks(comm, small: int, large: int, repeats: int) -> tuple[float, float]:
    """On each of 2 ranks: median seconds of an all-reduce of ``small`` and ``large`` bytes."""
    import statistics

    import torch

    out = []
    for nbytes in (small, large):
        t = torch.ones(nbytes // 4)
        comm.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out[0], out[1]


def probe(small: int = SMALL, large: int = LARGE, repeats: int = REPEATS) -> Network:
    """Measure this machine's link between two local gloo ranks (a few seconds).

    A 2-rank ring all-reduce is 2 steps of half the tensor each: ``t = 2 a + S / b``. The small
    tensor gives ``a``, the large one ``b`` once ``2 a`` is taken off.
    """
    from parallelkit.local_ranks import Ranks

    with Ranks(2, "gloo") as ranks:
        results = ranks.run(_probe_ranks, small, large, repeats, timeout=120)
    t_small = max(r[0] for r in results)
    t_large = max(r[1] for r in results)
    return from_timings(t_small, t_large, small, large)


def from_timings(t_small: float, t_large: float, small: int, large: int) -> Network:
    """The network whose 2-rank all-reduces of ``small`` and ``large`` bytes take these times."""
    latency = max(t_small - small / 2 / 1e9, 1e-6) / 2
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    return Network(latency, bandwidth, "probe (2 local gloo ranks)", shares_cores=True)
