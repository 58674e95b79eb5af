"""SPMD on 4 XLA CPU devices: networks annotated by parallelkit.xla against torch on the CPU.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/spmd_cases.py OUT.json CASE...

CASE is ``network:grid``, e.g. ``resnet18:rows=4``, ``dcgan generator:data=2,rows=2`` or
``volume:depth=4`` (a small 3-D network on (N, C, D, H, W) volumes). For
each, the dense network trains on the CPU and a copy, ``pk.parallelize(..., backend=
"xla-spmd")``, on the XLA devices: the same whole batch, three SGD steps, float64. Written to
OUT.json per case: the largest relative error of outputs, losses, gradients (every step) and
of parameters and BatchNorm buffers (after every step); the compilation count after each
step; the sharding torch_xla records for the input and the first convolution's weight, and
the sharding annotations in the step's traced graph (how many, and their tile counts per
dimension) and its collective-permutes (none: the partitioner adds them). One process runs
all the cases given: starting torch_xla and SPMD costs seconds. With
``XLA_FLAGS=--xla_dump_to=DIR`` XLA writes the partitioned programs there.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # network_cases.py
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr

import parallelkit as pk

from network_cases import NETWORKS as IMAGES

STEPS = 3
BATCH = 4


def volume_net() -> nn.Module:
    """Conv3d, BatchNorm3d, MaxPool3d and a global average pool to 10 classes."""
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(4, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
        nn.Linear(8, 10),
    )  # fmt: skip


def _summed_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="sum")


NETWORKS = {**IMAGES, "volume": (volume_net, (2, 8, 8, 8), _summed_cross_entropy, ())}


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max(|expected|, 1e-3): relative, robust to tiny references."""
    got = got.detach().cpu().to(expected.dtype)
    scale = max(expected.detach().abs().max().item(), 1e-3)
    return (got - expected.detach()).abs().max().item() / scale


def run_case(case: str) -> dict:
    name, grid_text = case.split(":")
    grid = {k: int(v) for k, v in (part.split("=") for part in grid_text.split(","))}
    build, shape, loss_fn, _ = NETWORKS[name]
    torch.manual_seed(0)
    dense = build().double()
    device = torch_xla.device()
    model = pk.parallelize(copy.deepcopy(dense).to(device), grid, backend="xla-spmd")
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    errors = {"output": 0.0, "loss": 0.0, "grad": 0.0, "parameter": 0.0, "buffer": 0.0}
    compiles, annotations, traced_permutes, tiles = [], 0, 0, []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, *shape, generator=gen, dtype=torch.float64)
        target = torch.randint(0, 10, (BATCH,), generator=gen)
        opt_dense.zero_grad()
        out = dense(x)
        loss = loss_fn(out, target) / BATCH
        loss.backward()
        opt_dense.step()

        opt.zero_grad()
        x_xla = x.to(device)
        out_xla = model(x_xla)
        loss_xla = loss_fn(out_xla, target.to(device)) / BATCH
        if step == 0:  # the graph as traced, before XLA's partitioner
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss_xla])
            annotations = len(re.findall(r'custom_call_target="Sharding"', hlo))
            tiles = sorted(set(re.findall(r"sharding=\{devices=(\[[\d,]+\])", hlo)))
            traced_permutes = hlo.count("collective-permute(")
        loss_xla.backward()
        opt.step()
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)

        errors["output"] = max(errors["output"], rel_err(out_xla, out))
        errors["loss"] = max(errors["loss"], rel_err(loss_xla, loss))
        params = dict(model.module.named_parameters())
        for key, p in dense.named_parameters():
            errors["grad"] = max(errors["grad"], rel_err(params[key].grad, p.grad))
            errors["parameter"] = max(errors["parameter"], rel_err(params[key], p))
        buffers = dict(model.module.named_buffers())
        for key, b in dense.named_buffers():
            errors["buffer"] = max(errors["buffer"], rel_err(buffers[key], b.double()))
    convs = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Conv3d)
    first_conv = next(m for m in model.module.modules() if isinstance(m, convs))
    return {
        "errors": errors,
        "compiles": compiles,
        "input_sharding": torch_xla._XLAC._get_xla_sharding_spec(x_xla),
        "weight_sharding": torch_xla._XLAC._get_xla_sharding_spec(first_conv.weight),
        "annotations": annotations,
        "tiles": tiles,
        "traced_permutes": traced_permutes,
    }


if __name__ == "__main__":
    xr.use_spmd()  # before any tensor goes to the device
    out, cases = sys.argv[1], sys.argv[2:]
    results = {case: run_case(case) for case in cases}
    plain = torch.zeros(4, 4).to(torch_xla.device())  # negative control: never annotated
    results["unannotated"] = torch_xla._XLAC._get_xla_sharding_spec(plain)
    Path(out).write_text(json.dumps(results, indent=1))
