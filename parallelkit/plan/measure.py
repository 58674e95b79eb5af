"""Compute profiles: seconds of forward + backward per image for every layer of a network.

Two sources, one shape (:class:`Profile`), so the cost model does not care which:

- :func:`measure`: each leaf layer timed on this process (one rank), plus the rest of a step
  that no leaf holds (residual additions, the loss, Python) as the whole network's time less
  the layers', plus the optimizer's step per parameter. What ``parallelkit plan`` does by
  default, at a reduced sample size (:func:`reduced_shape`: every side halved, images and
  volumes alike) whose times :func:`scaled` carries to the real size by the operation counts:
  a large image's or volume's profile in seconds, not minutes.
- :func:`from_flops`: FLOPs (forward x 3 for forward + backward) over a rate, for convolutions
  and fully connected layers, and bytes over a memory rate for the rest. For a machine not at
  hand (give its rate), and for tests, which must not time anything.

Times are per sample: a layer's cost scales with the samples a rank holds (and, under spatial
parallelism, with the share of the sample; see :mod:`parallelkit.plan.cost`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from parallelkit.plan.walk import Layer, Net, Shape

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
    :class:`parallelkit.plan.machine.Machine`). One compute thread, as the ranks run.
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


Clock = Callable[[Callable[[], None]], float]  # the cost of one call of a function


def measure(net: Net, batch: int, repeats: int = 2, clock: Clock | None = None) -> Profile:
    """Time every layer of ``net`` and the whole network at ``batch`` images, on this process.

    Runs in training mode (BatchNorm on batch statistics), with one thread per rank as the
    training runs do when OMP_NUM_THREADS=1. ``clock`` prices one call of a function (default:
    its least CPU seconds over ``repeats`` calls); tests pass a FLOP counter, never a timer.
    """
    assert net.model is not None, "measure needs the network's module"
    clock = clock or (lambda fn: _time(fn, repeats))
    model = net.model.train()
    layer_s = []
    for i, layer in enumerate(net.layers):
        s = clock(_layer_step(layer, batch, input_grad=i > 0))
        layer_s.append(s / batch)
    x = torch.randn(batch, *net.input_shape)

    def whole() -> None:
        model(x).float().sum().backward()

    whole_s = clock(whole) / batch
    other = max(0.0, whole_s - sum(layer_s))
    opt_s = _optimizer_seconds(model, clock)
    return Profile(tuple(layer_s), other, opt_s, f"measured at batch {batch}")


def _optimizer_seconds(model: nn.Module, clock: Clock) -> float:
    """Seconds per parameter scalar of one SGD step with momentum and weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=1e-9, momentum=0.9, weight_decay=5e-4)
    seconds = clock(opt.step)
    model.zero_grad(set_to_none=True)
    return seconds / max(1, sum(p.numel() for p in params))


# ---------------------------------------------------------------------------- reduced size
# Forward FLOPs (all the per-rank images) up to which a network is profiled at its real size;
# beyond, at a smaller one. Profiling runs about 6 forward + backward passes (each layer's
# and the whole network's, with warm-ups), at ~50 GFLOP/s on one core: about 4 s here for
# ResNet-50 at 256x256 (10.7 GFLOPs). Scaled, a profile is off by what the per-FLOP speed
# changes with the size; measured here: from 256 to 512, ResNet-18 and -50 came out 5-25%
# slow; from 256 to 1024, ResNet-50 22% fast (its large activations outgrow the caches);
# from 128 to 512, 35-70% slow (docs/parallelism.md). Hence no smaller budget.
PROFILE_FLOPS = 12e9
MIN_SIZE = 64  # smaller, the deepest feature maps of an ImageNet network shrink to a pixel


def reduced_shape(
    net: Net, size: Sequence[int], batch: int, budget: float = PROFILE_FLOPS
) -> Shape:
    """The spatial size to profile ``net`` (walked at ``size``) at: every side halved until
    ``batch`` samples cost at most ``budget`` forward FLOPs, but no side below ``MIN_SIZE``.
    Convolutions' counts fall with the number of pixels (voxels): 4x per halving of an
    image, 8x of a volume."""
    size = tuple(size)
    flops = batch * sum(layer.flops for layer in net.layers)
    while flops > budget and min(size) // 2 >= MIN_SIZE:
        size, flops = tuple(n // 2 for n in size), flops / 2 ** len(size)
    return size


def reduced_size(net: Net, image_size: int, batch: int, budget: float = PROFILE_FLOPS) -> int:
    """:func:`reduced_shape` of a square image (or a cube) of side ``image_size``: its side."""
    dims = max(1, len(net.input_shape) - 1)
    return reduced_shape(net, (image_size,) * dims, batch, budget)[0]


def operations(layer: Layer) -> float:
    """What a layer's time grows with: FLOPs for convolutions and fully connected layers,
    the elements it reads and writes for the rest (memory-bound)."""
    if layer.kind in DENSE_KINDS:
        return layer.flops
    return float(layer.in_numel + layer.out_numel)


def same_layers(full: Net, small: Net) -> bool:
    """Whether two walks of a network at two sizes call the same layers in the same order
    (false where the architecture depends on the image size, as DCGAN's does)."""
    return [(x.name, x.kind) for x in full.layers] == [(x.name, x.kind) for x in small.layers]


def scaled(prof: Profile, small: Net, full: Net) -> Profile:
    """``prof``, measured on ``small``, carried to ``full``: the same network walked at a larger
    size. Each layer's time grows by the ratio of its operation counts (:func:`operations`),
    the rest of a pass (residual additions, the loss) by the ratio of all activations; the
    optimizer's step does not depend on the size."""
    if not same_layers(full, small):
        raise ValueError(
            f"plan: {full.name} has different layers at {full.input_shape} and "
            f"{small.input_shape}; profile it at its real size"
        )
    layer_s = tuple(
        t * operations(f) / operations(s) if operations(s) else t
        for t, f, s in zip(prof.layer_s, full.layers, small.layers, strict=True)
    )
    acts = lambda net: sum(layer.out_numel for layer in net.layers)  # noqa: E731
    other = prof.other_s * acts(full) / max(1, acts(small))
    size = "x".join(map(str, small.input_shape[1:]))
    return replace(prof, layer_s=layer_s, other_s=other,
                   source=f"{prof.source} at {size}, scaled by operation counts")  # fmt: skip


# ---------------------------------------------------------------------------- memory
_PEAK_CODE = """
import json, re, sys, torch
from parallelkit.plan.walk import build
torch.set_num_threads(1)
name, size, classes, stem, batch, channels, kwargs = json.loads(sys.argv[1])
for net in build(name, size, classes, stem, channels, dims=len(size), kwargs=kwargs):
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


def peak_mib(
    name: str,
    image_size: int | Sequence[int],
    classes: int,
    stem: str,
    batch: int,
    *,
    channels: int = 3,
    kwargs: Mapping[str, Any] | None = None,
) -> float:
    """Peak resident memory (MiB) of a fresh process that trains model ``name`` for two steps
    at ``batch`` samples of ``image_size`` (a square image's side, or every side) on one rank
    (VmHWM: Linux carries a parent's peak into a child's ru_maxrss, not its VmHWM)."""
    import os
    import subprocess
    import sys

    size = [image_size] * 2 if isinstance(image_size, int) else [int(n) for n in image_size]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = json.dumps([name, size, classes, stem, batch, channels, dict(kwargs or {})])
    out = subprocess.run([sys.executable, "-c", _PEAK_CODE, argv], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    return float(out.stdout)
