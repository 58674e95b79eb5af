"""Where a rank trains and what it measures there: the device asked for, the communicator's
device, the peak memory, and the XLA specifics of a step. Training and prediction share them."""

from __future__ import annotations

import torch

from parallelkit.comm import Communicator, launcher


def requested_device(name: str) -> torch.device | None:
    """``parallel.device`` as the device this rank trains on; None leaves it to the backend.

    cuda: the GPU of this rank's local rank under any launcher (torchrun's LOCAL_RANK,
    srun's SLURM_LOCALID, mpiexec's), modulo the GPUs there are, so several ranks may share one.
    """
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device=cuda: torch sees no CUDA device on this machine")
        local_rank = launcher.detect().local_rank
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return None


def device_for(comm: Communicator) -> torch.device:
    """Where this rank trains: the communicator's declared device (NCCL: its GPU, chosen by
    LOCAL_RANK; XLA: its XLA device), else the CPU."""
    return comm.device if comm.device is not None else torch.device("cpu")


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory: device memory on GPUs, the peak resident set on CPUs.

    Linux's VmHWM where there is one: ``ru_maxrss`` keeps the maximum across ``execve``, so a
    rank that the launcher started (a fork of it until the exec) would report at least the
    launcher's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def on_device(loader, device: torch.device):
    """XLA: batches move to the device in a background thread (MpDeviceLoader), so the step
    graph never waits for a host copy. Elsewhere the loop moves each batch itself."""
    if device.type != "xla":
        return loader
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    return MpDeviceLoader(loader, device)


def end_of_step(device: torch.device) -> None:
    """Cut the lazy XLA graph after each step, so that every step is the same graph."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()
