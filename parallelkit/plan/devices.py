"""Compute presets: the accelerators a run is planned for, from their datasheets.

``parallelkit plan --device h100-sxm`` plans a cluster from any machine: compute is counted
(FLOPs at the device's bf16 rate, the memory-bound layers' bytes at its memory bandwidth,
:func:`parallelkit.plan.measure.from_flops`), each rank has a device of its own, a grid whose
memory per rank exceeds the device's is marked as not fitting, and unless a network is given
the device's usual interconnect is taken (a preset of :mod:`parallelkit.plan.network`).

Rates are datasheet peaks (dense, without sparsity): a step takes at least the time they
give, and real convolutions reach a fraction of the peak. Memory is the datasheet size; the
CUDA context or the runtime takes some of it before the model.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    """One accelerator: peak bf16 FLOP/s, memory bandwidth (bytes/s), memory size (bytes),
    and the name of the network preset its ranks usually talk over."""

    name: str
    flop_rate: float
    byte_rate: float
    memory_bytes: float
    link: str

    @property
    def memory_mib(self) -> float:
        return self.memory_bytes / (1 << 20)


# Sources (each a vendor's datasheet or documentation page):
# - NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BFLOAT16 Tensor Core 312 TFLOPS
#   (624 with sparsity), GPU memory bandwidth 2,039 GB/s, 80GB HBM2e; NVLink 600 GB/s.
# - NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BFLOAT16 Tensor Core 1,979 TFLOPS with
#   sparsity = 989 dense, 3.35 TB/s, 80GB HBM3; NVLink 900 GB/s.
# - Google Cloud TPU documentation, "TPU v4": per chip 275 TFLOP/s bf16, 32 GiB HBM2 at
#   1,200 GB/s; ICI 2,400 Gbps over 6 links.
# - Google Cloud TPU documentation, "TPU v5e": per chip 197 TFLOP/s bf16, 16 GiB HBM2 at
#   819 GB/s; ICI 1,600 Gbps over 4 links.
DEVICES: dict[str, Device] = {
    "a100-80gb": Device("a100-80gb", 312e12, 2.039e12, 80e9, "nvlink3"),
    "h100-sxm": Device("h100-sxm", 989e12, 3.35e12, 80e9, "nvlink4"),
    "tpu-v4": Device("tpu-v4", 275e12, 1.2e12, 32 * GiB, "tpu-v4-ici"),
    "tpu-v5e": Device("tpu-v5e", 197e12, 819e9, 16 * GiB, "tpu-v5e-ici"),
}
