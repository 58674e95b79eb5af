"""The planner's view of a network: its leaf layers in call order, with shapes, FLOPs and
parameters, found by one forward pass on the meta device (no memory, no compute).

The cost model (:mod:`parallelkit.plan.cost`) never looks at modules, only at these records,
so it is pure and its tests need no torch model at all. A record holds what the parallel
layers' costs depend on: per-image input and output shapes (C, H, W), the sliding window of
a convolution or pooling layer (for the halo geometry), the channel counts (for the
channel-parallel collectives) and whether the layer lies inside the spatial region (before the
first global pooling or fully connected layer: where ``pk.parallelize(..., "spatial")`` keeps
activations split).

Names a model may have (``build``):

    resnet18 | resnet34 | resnet50     parallelkit.models, ``stem`` "imagenet" or "cifar"
    dcgan                              the GAN task's generator and discriminator (a step:
                                       generator once, discriminator three times)
    torchvision:NAME | timm:NAME       a zoo network, when that library imports here

Legend: per-image shapes ``(C, H, W)``; ``flops`` are multiply-adds x 2 of the forward pass for
one image; ``params`` counts scalars.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallelkit import models
from parallelkit.geometry import conv_padding, pair

Shape = tuple[int, ...]
NORMS = (nn.modules.batchnorm._BatchNorm,)
ELEMENTWISE = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.SiLU,
    nn.GELU,
    nn.Hardswish,
    nn.ReLU6,
    nn.Identity,
    nn.Dropout,
)
POOLS = (nn.MaxPool2d, nn.AvgPool2d)
GLOBAL_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


@dataclass(frozen=True)
class Layer:
    """One leaf module call: what it computes per image and what it holds."""

    name: str
    kind: str  # conv | convT | norm | pool | act | global_pool | linear | other
    in_shape: Shape  # (C, H, W) or (F,) per image
    out_shape: Shape
    flops: float  # forward, one image
    params: int
    tensors: int = 0  # parameter tensors (one all-reduce each where they are summed)
    window: tuple[tuple[int, int, int, int, int], ...] = ()  # per dim (k, s, pad_lo, pad_hi, d)
    groups: int = 1
    inplace: bool = False
    spatial: bool = True  # inside the spatial region (activations split by rows/cols)
    module: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    @property
    def in_numel(self) -> int:
        return math.prod(self.in_shape)


@dataclass(frozen=True)
class Net:
    """One network of a workload: its layers, parameter count, and how often a step runs it.

    ``passes``: forward+backward passes per training step; ``grad_passes``: of those, how many
    compute parameter gradients (the GAN's generator step runs the discriminator without).
    ``input_grad``: whether the first layer's input needs a gradient (a generator's fake
    images do, through the discriminator; data does not).
    """

    name: str
    layers: tuple[Layer, ...]
    params: int
    passes: int = 1
    grad_passes: int = 1
    keep_dense: tuple[str, ...] = ()
    input_grad: bool = False
    model: nn.Module | None = field(default=None, compare=False, repr=False)
    input_shape: Shape = ()


def _conv_window(m: nn.Conv2d | nn.ConvTranspose2d | nn.MaxPool2d | nn.AvgPool2d):
    k, s = pair(m.kernel_size), pair(m.stride or m.kernel_size)
    d = pair(getattr(m, "dilation", 1))
    pads = conv_padding(m.padding, k, d)  # ints, or "same" / "valid" (stride 1)
    return tuple((k[i], s[i], pads[i][0], pads[i][1], d[i]) for i in range(2))


def _record(name: str, m: nn.Module, x: torch.Tensor, y: torch.Tensor, spatial: bool) -> Layer:
    """A Layer from one call of leaf ``m`` on ``x`` (batch 1) giving ``y``."""
    ins, outs = tuple(x.shape[1:]), tuple(y.shape[1:])
    own = list(m.parameters(recurse=False))
    params = sum(p.numel() for p in own)
    out_n = math.prod(outs)
    kind, flops, window, groups = "other", float(out_n), (), 1
    if isinstance(m, nn.Conv2d):
        kind, groups, window = "conv", m.groups, _conv_window(m)
        flops = 2.0 * out_n * (m.in_channels // m.groups) * math.prod(m.kernel_size)
    elif isinstance(m, nn.ConvTranspose2d):
        kind, groups, window = "convT", m.groups, _conv_window(m)
        flops = 2.0 * math.prod(ins) * (m.out_channels // m.groups) * math.prod(m.kernel_size)
    elif isinstance(m, NORMS):
        kind, flops = "norm", 4.0 * out_n
    elif isinstance(m, POOLS):
        kind, window = "pool", _conv_window(m)
        flops = float(out_n * math.prod(pair(m.kernel_size)))
    elif isinstance(m, GLOBAL_POOLS):
        kind, flops = "global_pool", float(math.prod(ins))
    elif isinstance(m, nn.Linear):
        kind, flops = "linear", 2.0 * m.in_features * m.out_features
    elif isinstance(m, ELEMENTWISE):
        kind = "act"
    inplace = bool(getattr(m, "inplace", False))
    return Layer(
        name, kind, ins, outs, flops, params, len(own), window, groups, inplace, spatial, m
    )


def walk(model: nn.Module, input_shape: Shape, name: str = "model", **net: Any) -> Net:
    """Run ``model`` once on a meta tensor of ``(1, *input_shape)`` and record its leaf calls.

    A copy of the model goes to the meta device, so nothing is allocated or computed; the
    records keep references to the real leaf modules (for timing them, see
    :mod:`parallelkit.plan.measure`). The spatial region ends at the first global pooling or
    fully connected layer, or at a module named in ``keep_dense``.
    """
    keep_dense = tuple(net.get("keep_dense", ()))
    real = dict(model.named_modules())
    meta = _to_meta(model)
    layers: list[Layer] = []
    state = {"spatial": True}

    def hook(mod_name: str):
        def record(m: nn.Module, args: tuple, out: Any) -> None:
            if (
                not args
                or not isinstance(args[0], torch.Tensor)
                or not isinstance(out, torch.Tensor)
            ):
                return
            if isinstance(m, (*GLOBAL_POOLS, nn.Linear)) or any(
                mod_name == k or mod_name.startswith(f"{k}.") for k in keep_dense
            ):
                state["spatial"] = False
            layer = _record(mod_name, m, args[0], out, state["spatial"] and out.dim() == 4)
            layers.append(_with_module(layer, real[mod_name]))

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in meta.named_modules()
        if not list(m.children()) and n
    ]
    try:
        with torch.no_grad():
            meta(torch.empty((1, *input_shape), device="meta"))
    finally:
        for h in handles:
            h.remove()
    params = sum(p.numel() for p in model.parameters())
    return Net(name, tuple(layers), params, model=model, input_shape=tuple(input_shape), **net)


def _with_module(layer: Layer, module: nn.Module) -> Layer:
    return Layer(**{**layer.__dict__, "module": module})


def _to_meta(model: nn.Module) -> nn.Module:
    import copy

    meta = copy.deepcopy(model)
    return meta.to("meta")


# ---------------------------------------------------------------------------- models by name
BUILTIN = ("resnet18", "resnet34", "resnet50", "dcgan")
ZOO_PREFIXES = ("torchvision:", "timm:")


def build(
    name: str, image_size: int, classes: int = 10, stem: str = "imagenet", channels: int = 3
) -> list[Net]:
    """The networks a training step of model ``name`` runs, walked at ``image_size``.

    Raises ValueError for an unknown name, and for a zoo name whose library does not import
    here (saying which library and how to get it).
    """
    shape = (channels, image_size, image_size)
    if name == "dcgan":
        g = models.create("dcgan_generator", nc=channels, image_size=image_size)
        d = models.create("dcgan_discriminator", nc=channels, image_size=image_size)
        return [
            walk(g, (100, 1, 1), "generator", passes=1, grad_passes=1),
            # D(real) and D(fake) for the discriminator's loss, D(fake) again for the
            # generator's, with the discriminator's parameters frozen.
            walk(
                d,
                shape,
                "discriminator",
                passes=3,
                grad_passes=2,
                keep_dense=("head",),
                input_grad=True,
            ),
        ]
    if name.startswith(ZOO_PREFIXES):
        return [walk(_zoo(name, classes), shape, name)]
    if name in BUILTIN:
        model = models.create(name, num_classes=classes, in_channels=channels, stem=stem)
        return [walk(model, shape, name)]
    raise ValueError(
        f"unknown model {name!r}; built-in models: {', '.join(BUILTIN)}, or a zoo network as "
        "torchvision:NAME or timm:NAME"
    )


def _zoo(name: str, classes: int) -> nn.Module:
    """A torchvision or timm network, untrained (no download)."""
    library, _, model = name.partition(":")
    module = "timm" if library == "timm" else "torchvision.models"
    try:
        lib = importlib.import_module(module)
    except Exception as e:  # ImportError, or torchvision built for another torch
        raise ValueError(
            f"model {name!r}: {library} does not import here ({type(e).__name__}: {e}); "
            "install it beside a matching torch (the zoo environment .venv-zoo: docs/zoo.md)"
        ) from e
    try:
        if library == "timm":
            return lib.create_model(model, num_classes=classes)
        return lib.get_model(model, weights=None, num_classes=classes)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"model {name!r}: {library} has no such model ({e})") from e
