"""The planner's view of a network: its leaf layers in call order, with shapes, FLOPs and
parameters, found by one forward pass on the meta device (no memory, no compute).

The cost model (:mod:`parallelkit.plan.cost`) never looks at modules, only at these records,
so it is pure and its tests need no torch model at all. A record holds what the parallel
layers' costs depend on: per-sample input and output shapes, the sliding window of a
convolution or pooling layer along each spatial dimension (for the halo geometry), the channel
counts (for the channel-parallel collectives) and whether the layer lies inside the spatial
region (before the first global pooling or fully connected layer: where
``pk.parallelize(..., "spatial")`` keeps activations split).

Samples have 1, 2 or 3 spatial dimensions, as in the rest of parallelkit: a signal (C, L), an
image (C, H, W), a volume (C, D, H, W). Convolutions, transposed convolutions, pooling,
BatchNorm and adaptive pooling are recorded alike for each (``Conv1d``/``2d``/``3d``, ...).

Names a model may have (``build``):

    resnet18 | resnet34 | resnet50     parallelkit.models, ``stem`` "imagenet" or "cifar"
    unet                               parallelkit.models' U-Net (per-pixel logits)
    dcgan                              the GAN task's generator and discriminator (a step:
                                       generator once, discriminator three times)
    torchvision:NAME | timm:NAME       a zoo network, when that library imports here
    monai:NAME | smp:ARCH              built as ``model.name`` builds them for ``parallelkit
                                       train`` (:mod:`parallelkit.models.zoo`; MONAI's are 3-D),
                                       with ``kwargs`` as its ``model.kwargs``

Legend: per-sample shapes ``(C, *spatial)``, e.g. ``(C, H, W)`` or ``(C, D, H, W)``, and
``(F,)`` after flattening; ``flops`` are multiply-adds x 2 of the forward pass for one sample;
``params`` counts scalars.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallelkit import models
from parallelkit.geometry import conv_padding, pair

Shape = tuple[int, ...]
NORMS = (nn.modules.batchnorm._BatchNorm,)  # SyncBatchNorm: statistics over data x spatial
# Statistics of each sample over its spatial dimensions (and a group of channels): all-reduced
# over the spatial group only (parallelkit/spatial/rules/norms.py).
SAMPLE_NORMS = (nn.modules.instancenorm._InstanceNorm, nn.GroupNorm)
CONVS = (nn.modules.conv._ConvNd,)  # Conv1d/2d/3d, and the transposed ones (``.transposed``)
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
POOLS = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
GLOBAL_POOLS = (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)


@dataclass(frozen=True)
class Layer:
    """One leaf module call: what it computes per image and what it holds."""

    name: str
    kind: str  # conv | convT | norm | sample_norm | pool | act | global_pool | linear | other
    in_shape: Shape  # (C, *spatial) or (F,) per sample
    out_shape: Shape
    flops: float  # forward, one sample
    params: int
    tensors: int = 0  # parameter tensors (one all-reduce each where they are summed)
    # per spatial dimension, D H W order: (kernel, stride, pad_lo, pad_hi, dilation)
    window: tuple[tuple[int, int, int, int, int], ...] = ()
    groups: int = 1
    inplace: bool = False
    spatial: bool = True  # inside the spatial region (activations split by depth/rows/cols)
    module: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    @property
    def in_numel(self) -> int:
        return math.prod(self.in_shape)

    @property
    def dims(self) -> int:
        """Spatial dimensions of its output: 1 (L), 2 (H, W) or 3 (D, H, W); 0 for (F,)."""
        return len(self.out_shape) - 1


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
    output_shape: Shape = ()  # of the model's output (its "out" where it returns a dict)

    @property
    def per_pixel(self) -> bool:
        """Whether it predicts per pixel (voxel): an output with the input's spatial size,
        scored against labels of that size (segmentation), not one label per sample."""
        return len(self.input_shape) > 1 and self.output_shape[1:] == self.input_shape[1:]


def _conv_window(m: nn.Module, dims: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """(kernel, stride, pad_lo, pad_hi, dilation) per spatial dimension of a convolution or
    pooling layer acting on samples of ``dims`` spatial dimensions."""
    k, s = pair(m.kernel_size, dims), pair(m.stride or m.kernel_size, dims)
    d = pair(getattr(m, "dilation", 1), dims)
    pads = conv_padding(m.padding, k, d)  # ints, or "same" / "valid" (stride 1)
    return tuple((k[i], s[i], pads[i][0], pads[i][1], d[i]) for i in range(dims))


def _record(name: str, m: nn.Module, x: torch.Tensor, y: torch.Tensor, spatial: bool) -> Layer:
    """A Layer from one call of leaf ``m`` on ``x`` (batch 1) giving ``y``."""
    ins, outs = tuple(x.shape[1:]), tuple(y.shape[1:])
    dims = x.dim() - 2  # spatial dimensions of (N, C, *spatial)
    own = list(m.parameters(recurse=False))
    params = sum(p.numel() for p in own)
    out_n = math.prod(outs)
    kind, flops, window, groups = "other", float(out_n), (), 1
    if isinstance(m, CONVS) and m.transposed:
        kind, groups, window = "convT", m.groups, _conv_window(m, dims)
        flops = 2.0 * math.prod(ins) * (m.out_channels // m.groups) * math.prod(m.kernel_size)
    elif isinstance(m, CONVS):
        kind, groups, window = "conv", m.groups, _conv_window(m, dims)
        flops = 2.0 * out_n * (m.in_channels // m.groups) * math.prod(m.kernel_size)
    elif isinstance(m, NORMS):
        kind, flops = "norm", 4.0 * out_n
    elif isinstance(m, SAMPLE_NORMS):
        kind, flops = "sample_norm", 4.0 * out_n
    elif isinstance(m, POOLS):
        kind, window = "pool", _conv_window(m, dims)
        flops = float(out_n * math.prod(pair(m.kernel_size, dims)))
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
            split = state["spatial"] and 3 <= out.dim() <= 5  # (N, C, L) to (N, C, D, H, W)
            layer = _record(mod_name, m, args[0], out, split)
            layers.append(_with_module(layer, real[mod_name]))

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in meta.named_modules()
        if not list(m.children()) and n
    ]
    try:
        with torch.no_grad():
            out = meta(torch.empty((1, *input_shape), device="meta"))
    except RuntimeError as e:  # a shape the network does not take (a 2-D network, a volume)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        shape = tuple(input_shape)
        raise ValueError(
            f"{name} does not run on samples of shape {shape} (C, *spatial): {why}"
        ) from e
    finally:
        for h in handles:
            h.remove()
    params = sum(p.numel() for p in model.parameters())
    return Net(
        name, tuple(layers), params, model=model, input_shape=tuple(input_shape),
        output_shape=_output_shape(out), **net,
    )  # fmt: skip


def _output_shape(out: Any) -> Shape:
    """Per-sample shape of a model's output: a tensor, or the ``"out"`` of a dict
    (torchvision's segmentation models); () for anything else."""
    if isinstance(out, Mapping):
        out = out.get("out")
    return tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else ()


def _with_module(layer: Layer, module: nn.Module) -> Layer:
    return Layer(**{**layer.__dict__, "module": module})


def _to_meta(model: nn.Module) -> nn.Module:
    import copy

    meta = copy.deepcopy(model)
    return meta.to("meta")


# ---------------------------------------------------------------------------- models by name
BUILTIN = ("resnet18", "resnet34", "resnet50", "unet", "dcgan")
ZOO_PREFIXES = ("torchvision:", "timm:")
MODELS_ZOO_PREFIXES = ("monai:", "smp:")  # built by parallelkit.models.zoo, as training does


def sample_shape(size: int | Sequence[int], dims: int = 2) -> Shape:
    """A sample's spatial size: ``size`` along each of ``dims`` dimensions (a square image, a
    cube), or ``size`` itself when it lists every side (``(D, H, W)``)."""
    if isinstance(size, int):
        return (size,) * dims
    return tuple(int(v) for v in size)


def default_dims(name: str, kwargs: Mapping[str, Any] | None = None) -> int:
    """The spatial dimensions model ``name`` takes unless told: 3 for MONAI's networks
    (``spatial_dims=3`` unless ``kwargs`` sets it), 2 for every other."""
    if name.startswith("monai:"):
        return int((kwargs or {}).get("spatial_dims", 3))
    return 2


def build(
    name: str,
    image_size: int | Sequence[int],
    classes: int = 10,
    stem: str = "imagenet",
    channels: int = 3,
    *,
    dims: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> list[Net]:
    """The networks a training step of model ``name`` runs, walked at ``image_size``: a side
    (repeated over ``dims`` spatial dimensions, by default :func:`default_dims`) or every side
    (``(H, W)``, ``(D, H, W)``). ``kwargs`` go to the model's constructor (``model.kwargs``).

    Raises ValueError for an unknown name, and for a zoo name whose library does not import
    here (saying which library and how to get it).
    """
    kwargs = dict(kwargs or {})
    size = sample_shape(image_size, default_dims(name, kwargs) if dims is None else dims)
    shape = (channels, *size)
    if name == "dcgan":
        g = models.create("dcgan_generator", nc=channels, image_size=size[-1])
        d = models.create("dcgan_discriminator", nc=channels, image_size=size[-1])
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
        return [walk(_zoo(name, classes, kwargs), shape, name)]
    if name.startswith(MODELS_ZOO_PREFIXES):
        return [walk(_models_zoo(name, classes, channels, kwargs), shape, name)]
    if name in BUILTIN:
        extra = {"stem": stem} if name.startswith("resnet") else {}
        model = models.create(name, num_classes=classes, in_channels=channels, **extra, **kwargs)
        return [walk(model, shape, name)]
    raise ValueError(
        f"unknown model {name!r}; built-in models: {', '.join(BUILTIN)}, or a zoo network as "
        "torchvision:NAME, timm:NAME, monai:NAME or smp:ARCH"
    )


def _zoo(name: str, classes: int, kwargs: Mapping[str, Any]) -> nn.Module:
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
            return lib.create_model(model, num_classes=classes, **kwargs)
        return lib.get_model(model, weights=None, num_classes=classes, **kwargs)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"model {name!r}: {library} has no such model ({e})") from e


def _models_zoo(name: str, classes: int, channels: int, kwargs: Mapping[str, Any]) -> nn.Module:
    """A MONAI or smp network as ``parallelkit train``'s ``model.name`` builds it, untrained.

    Its errors (a library missing, a required argument unset) are the config's, which speak
    of ``model.kwargs``: here that is ``--model-kwargs``.
    """
    try:
        return models.create(name, num_classes=classes, in_channels=channels, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e).removeprefix("config: ")) from e
