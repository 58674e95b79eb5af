"""Compute profiles: seconds of forward + backward per image for every layer of a network.

Two sources, one shape (:class:`Profile`), so the cost model does not care which:

- :func:`measure`: each leaf layer timed on this process (one rank) at its real size, plus
  the rest of a step that no leaf holds (residual additions, the loss, Python) as the whole
  network's time less the layers', plus the optimizer's step per parameter. The real thing,
  a few seconds per network; what ``parallelkit plan`` does by default.
- :func:`from_flops`: FLOPs (forward x 3 for forward + backward) over a rate, for convolutions
  and fully connected layers, and bytes over a memory rate for the rest. For a machine not at
  hand (give its rate), and for tests, which must not time anything.

Times are per image: a layer's cost scales with the images a rank holds (and, under spatial
parallelism, with the share of the image; see :mod:`parallelkit.plan.cost`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from parallelkit.plan.walk import Layer, Net

DENSE_KINDS = ("conv", "convT", "linear")


@dataclass(frozen=True)
class Profile:
    """Per image: ``layer_s[i]`` for layer i of the net, ``other_s`` for the rest of a pass;
    ``optimizer_s_per_param``: one SGD-with-momentum step per parameter scalar."""

    layer_s: tuple[float, ...]
    other_s: float
    optimizer_s_per_param: float
    source: str


def from_flops(
    net: Net, flop_rate: float, byte_rate: float = 5e9, optimizer_s_per_param: float = 2e-9
) -> Profile:
    """A profile from counts: dense layers at ``flop_rate`` FLOP/s (forward x 3), the others
    moving their input and output 3 times (forward, backward) at ``byte_rate`` bytes/s."""
    times = []
    for layer in net.layers:
        if layer.kind in DENSE_KINDS:
            times.append(3 * layer.flops / flop_rate)
        else:
            times.append(3 * 4 * (layer.in_numel + layer.out_numel) / byte_rate)
    return Profile(tuple(times), 0.0, optimizer_s_per_param, f"FLOPs at {flop_rate:.3g}/s")


# ---------------------------------------------------------------------------- measuring
def _time(fn, repeats: int) -> float:
    """Least CPU seconds of this thread over ``repeats`` calls of ``fn`` after one warm-up.

    CPU time, not wall time: what the layer costs a core of its own, whatever other processes
    do meanwhile on a shared machine (the cost model adds the sharing of cores back:
    :class:`parallelkit.plan.cost.Machine`). One compute thread, as the ranks run.
    """
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def _layer_step(layer: Layer, batch: int, input_grad: bool):
    """A callable running ``layer``'s forward and backward on random data of its shape."""
    m = layer.module
    assert m is not None, f"layer {layer.name} has no module to time"
    x0 = torch.randn(batch, *layer.in_shape, requires_grad=input_grad)
    dy = torch.randn(batch, *layer.out_shape)
    has_grad = input_grad or any(p.requires_grad for p in m.parameters())

    def step() -> None:
        x = x0.clone() if layer.inplace else x0  # in place on a leaf that needs grad: refused
        y = m(x)
        if has_grad and y.requires_grad:
            y.backward(dy)

    return step


def measure(net: Net, batch: int, repeats: int = 2) -> Profile:
    """Time every layer of ``net`` and the whole network at ``batch`` images, on this process.

    Runs in training mode (BatchNorm on batch statistics), with one thread per rank as the
    training runs do when OMP_NUM_THREADS=1.
    """
    assert net.model is not None, "measure needs the network's module"
    model = net.model.train()
    layer_s = []
    for i, layer in enumerate(net.layers):
        s = _time(_layer_step(layer, batch, input_grad=i > 0), repeats)
        layer_s.append(s / batch)
    x = torch.randn(batch, *net.input_shape)

    def whole() -> None:
        model(x).float().sum().backward()

    whole_s = _time(whole, repeats) / batch
    other = max(0.0, whole_s - sum(layer_s))
    return Profile(tuple(layer_s), other, _optimizer_seconds(model), f"measured at batch {batch}")


def _optimizer_seconds(model: nn.Module) -> float:
    """Seconds per parameter scalar of one SGD step with momentum and weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=1e-9, momentum=0.9, weight_decay=5e-4)
    seconds = _time(opt.step, 2)
    model.zero_grad(set_to_none=True)
    return seconds / max(1, sum(p.numel() for p in params))


# ---------------------------------------------------------------------------- memory
_PEAK_CODE = """
import re, sys, torch
from parallelkit.plan.walk import build
torch.set_num_threads(1)
name, stem = sys.argv[1], sys.argv[4]
size, classes, batch = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
for net in build(name, size, classes, stem):
    model = net.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9, weight_decay=5e-4)
    for _ in range(2):
        outs = [model(torch.randn(batch, *net.input_shape)) for _ in range(min(net.passes, 2))]
        sum(o.float().sum() for o in outs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1)) / 1024)
"""


def peak_mib(name: str, image_size: int, classes: int, stem: str, batch: int) -> float:
    """Peak resident memory (MiB) of a fresh process that trains model ``name`` for two steps
    at ``batch`` images on one rank (VmHWM: Linux carries a parent's peak into a child's
    ru_maxrss, not its VmHWM)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [name, str(image_size), str(classes), stem, str(batch)]
    out = subprocess.run([sys.executable, "-c", _PEAK_CODE, *argv], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    return float(out.stdout)
