"""Every parallel layer at world size 1 on an XLA CPU device, against plain torch on the CPU.

Each case builds the dense torch layer on the CPU and the parallel one from a copy of it over
the XLA communicator, runs both forward and backward on the same input, and compares the
output, the input gradient, the parameter gradients and the BatchNorm running statistics.
float32, relative tolerance 1e-5. One rank takes the layers' size-1 paths, which must still be
lowered to XLA without host reads: the last test checks that no operation fell back to the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn

import parallelkit as pk
from parallelkit.nn import (
    ChannelParallelConv2d,
    ChannelParallelConvTranspose2d,
    ParallelConv2d,
    SpatialAvgPool2d,
    SpatialConvTranspose2d,
    SpatialGlobalAvgPool2d,
    SpatialMaxPool2d,
    SpatialParallelConv2d,
    SpatialUpsample,
    SyncBatchNorm,
    convert_sync_batchnorm,
)
from parallelkit.parallel import DataParallel

TOL = dict(rtol=1e-5, atol=1e-5)
# Backward kernels torch_xla 2.9 does not lower: they run on the host (ending the graph) but
# give the right numbers. Bilinear upsampling; average pooling with a divisor override, which
# SpatialAvgPool2d(count_include_pad=False) uses to count the real pixels of each window.
KNOWN_FALLBACKS = {"aten::upsample_bilinear2d_backward", "aten::avg_pool2d_backward"}


@pytest.fixture(scope="module")
def comm():
    return pk.init("xla")


def _from_dense(cls, *args):
    return lambda dense, comm: cls.from_dense(dense, comm, *args)


CASES = {
    "SyncBatchNorm": (lambda: nn.BatchNorm2d(3), _from_dense(SyncBatchNorm), (4, 3, 5, 6)),
    "SpatialParallelConv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
                              _from_dense(SpatialParallelConv2d), (2, 3, 9, 7)),
    "SpatialConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 2, 4, stride=2, padding=1),
                               _from_dense(SpatialConvTranspose2d), (2, 3, 5, 4)),
    "SpatialMaxPool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1),
                         _from_dense(SpatialMaxPool2d), (2, 3, 8, 7)),
    "SpatialAvgPool2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
                         _from_dense(SpatialAvgPool2d), (2, 3, 8, 7)),
    "SpatialUpsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
                        _from_dense(SpatialUpsample), (2, 3, 4, 5)),
    "SpatialGlobalAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(1),
                               lambda d, c: SpatialGlobalAvgPool2d(comm=c), (2, 3, 4, 5)),
    "ChannelParallelConv2d out": (lambda: nn.Conv2d(3, 4, 3, padding=1),
                                  lambda d, c: ChannelParallelConv2d.from_dense(d, c, split="out"),
                                  (2, 3, 6, 5)),
    "ChannelParallelConv2d in": (lambda: nn.Conv2d(3, 4, 3, padding=1),
                                 lambda d, c: ChannelParallelConv2d.from_dense(d, c, split="in"),
                                 (2, 3, 6, 5)),
    "ChannelParallelConvTranspose2d": (
        lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1),
        _from_dense(ChannelParallelConvTranspose2d), (2, 3, 4, 4)),
    "ParallelConv2d spatial": (lambda: nn.Conv2d(3, 4, 3, padding=1),
                               _from_dense(ParallelConv2d, "spatial"), (2, 3, 6, 5)),
    # As pk.parallelize(model, comm, "data") builds it: BatchNorm made SyncBatchNorm (plain
    # BatchNorm on XLA moves running_var towards the biased variance, see docs/tpu.md).
    "DataParallel": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
                     lambda d, c: DataParallel(convert_sync_batchnorm(d, c), c), (2, 3, 6, 5)),
}  # fmt: skip


def _param(layer: nn.Module, key: str) -> nn.Parameter:
    """The parallel layer's parameter for a dense name (wrappers add a path part)."""
    found = dict(layer.named_parameters())
    for prefix in ("", "module.", "conv."):
        if prefix + key in found:
            return found[prefix + key]
    raise AssertionError(f"no parameter {key} in {sorted(found)}")


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_torch(comm, name):
    make_dense, make_parallel, shape = CASES[name]
    torch.manual_seed(0)
    dense = make_dense()
    device = torch_xla.device()
    layer = make_parallel(copy.deepcopy(dense).to(device), comm)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x_dense, x_xla = x.clone().requires_grad_(), x.to(device).requires_grad_()
    y = dense(x_dense)
    y_xla = layer(x_xla)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * weights).sum().backward()
    (y_xla * weights.to(device)).sum().backward()
    torch_xla.sync()
    torch.testing.assert_close(y_xla.cpu(), y.detach(), **TOL, msg=f"{name}: output")
    torch.testing.assert_close(x_xla.grad.cpu(), x_dense.grad, **TOL, msg=f"{name}: input grad")
    for key, p in dense.named_parameters():
        grad = _param(layer, key).grad
        assert grad is not None, f"{name}: no gradient for {key}"
        torch.testing.assert_close(grad.cpu(), p.grad, **TOL, msg=f"{name}: {key} grad")
    # DataParallel's own buffers hide nn.Module's: read the running statistics inside it.
    buffers = dict(getattr(layer, "module", layer).named_buffers())
    for key, b in dense.named_buffers():
        torch.testing.assert_close(buffers[key].cpu(), b, **TOL, msg=f"{name}: {key}")


def test_no_cpu_fallback():
    """Every layer above was lowered to XLA (a fallback reads values on the host), but for
    the known gaps of torch_xla."""
    assert set(met.executed_fallback_ops()) <= KNOWN_FALLBACKS


def test_training_loop_one_graph_per_step(comm):
    """The data path of a TPU job at world size 1: MpDeviceLoader batches, a parallelized
    model, bf16 autocast on XLA, SGD. From the third step on nothing compiles anew (the step
    is one static graph), and the bf16 losses follow the float32 CPU ones to bf16 precision."""
    from torch.utils.data import DataLoader, TensorDataset

    from parallelkit.xla import device_loader

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))  # fmt: skip
    model = pk.parallelize(copy.deepcopy(dense).to(torch_xla.device()), comm, "data")
    data = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,)))
    loader = DataLoader(data, batch_size=4, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.1)
    compiles, losses, expected = [], [], []
    for (x, t), (x_cpu, t_cpu) in zip(device_loader(loader), loader, strict=True):
        assert x.device.type == "xla"
        opt.zero_grad()
        with torch.autocast("xla", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile"))
        losses.append(loss.item())
        opt_dense.zero_grad()
        reference = nn.functional.cross_entropy(dense(x_cpu), t_cpu)
        reference.backward()
        opt_dense.step()
        expected.append(reference.item())
    assert len(set(compiles[2:])) == 1, f"compilations after each step: {compiles}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=3e-2, atol=3e-2)
