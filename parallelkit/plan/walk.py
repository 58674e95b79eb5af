"""The planner's view of a network: its leaf layers in call order, with shapes, FLOPs and
parameters, found by one forward pass on the meta device (no memory, no compute).

The cost model (:mod:`parallelkit.plan.cost`) never looks at modules, only at these records,
so it is pure and its tests need no torch model at all. A record holds what the parallel
layers' costs depend on: per-sample input and output shapes, the sliding window of a
convolution or pooling layer along each spatial dimension (for the halo geometry), the channel
counts (for the channel-parallel collectives) and whether the layer lies inside the spatial
region (before the first global pooling or fully connected layer on whole features: where
``pk.parallelize(..., "spatial")`` keeps activations split).

Token mixing (:mod:`parallelkit.plan.mixing`): the calls that mix the tokens of a split
sample, which the spatial strategy makes exact with collectives
(``parallelkit/spatial/rules/tokens.py``), are recorded beside the layers, seen as
functions while the forward runs (a torch function mode):
``F.scaled_dot_product_attention``, ``nn.MultiheadAttention`` (its
``F.multi_head_attention_forward``), ``@``/``matmul``/``bmm`` and ``F.linear`` (a ``Linear``'s
too) over tokens. A *token dimension* is one whose size is a flattened feature map of the
region (H x W, D x H x W, a signal's L) in a tensor that is not that map itself. The walk sees
shapes only, not the spatial guard's layouts: a token count that happens to equal another
dimension's size is read as tokens; a square (L x L) product is read with its rows as the
queries; a count up to ``CLASS_TOKENS`` more than a map's is that map's tokens after class
tokens; ``einsum``, window attention (tokens in the batch) and keys of a count no map of the
region has (a text context: whole, no collective) are not recorded. Beside token mixing, the
calls on a map of the sample's dimensions (N, C, *spatial) that read rows of other ranks:
``flip`` and ``grid_sample`` (a block of rows fetched), ``cumsum``/``cumprod`` along a spatial
dimension (each block's last row gathered). Their compute is not a
leaf's: a profile has it in the rest of a pass (``Profile.other_s``; counted, it is left out).

Samples have 1, 2 or 3 spatial dimensions, as in the rest of parallelkit: a signal (C, L), an
image (C, H, W), a volume (C, D, H, W). Convolutions, transposed convolutions, pooling,
BatchNorm and adaptive pooling are recorded alike for each (``Conv1d``/``2d``/``3d``, ...).

Names a model may have (``build``):

    resnet18 | resnet34 | resnet50     parallelkit.models, ``stem`` "imagenet" or "cifar"
    unet                               parallelkit.models' U-Net (per-pixel logits; 1-, 2- or
                                       3-D by ``kwargs={"spatial_dims": 3}``)
    dcgan                              the GAN task's generator and discriminator, each run as
                                       often as the task's training step runs it (a step:
                                       generator once, discriminator three times)
    torchvision:NAME | timm:NAME       another library's network, built as ``model.name``
    monai:NAME | smp:ARCH              builds it for ``parallelkit train``
                                       (:func:`parallelkit.models.create`; MONAI's are 3-D),
                                       with ``kwargs`` as its ``model.kwargs``

Legend: per-sample shapes ``(C, *spatial)``, e.g. ``(C, H, W)`` or ``(C, D, H, W)``, and
``(F,)`` after flattening; ``flops`` are multiply-adds x 2 of the forward pass for one sample;
``params`` counts scalars.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from parallelkit import models
from parallelkit.geometry import conv_padding, per_dim
from parallelkit.models import imported
from parallelkit.models.zoo import is_zoo_name
from parallelkit.plan.mixing import Mixing, Mixings

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
    # The map (D, H, W) flattened into one dimension of its output, where that is tokens
    # (``(L, C)``, ``(h, L, d)``): a rank holds its block of that map, not of ``out_shape``.
    tokens: Shape = ()
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
    mixing: tuple[Mixing, ...] = ()  # token-mixing calls in the spatial region, in call order

    @property
    def per_pixel(self) -> bool:
        """Whether it predicts per pixel (voxel): an output with the input's spatial size,
        scored against labels of that size (segmentation), not one label per sample."""
        return len(self.input_shape) > 1 and self.output_shape[1:] == self.input_shape[1:]


def _conv_window(m: nn.Module, dims: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """(kernel, stride, pad_lo, pad_hi, dilation) per spatial dimension of a convolution or
    pooling layer acting on samples of ``dims`` spatial dimensions."""
    k, s = per_dim(m.kernel_size, dims), per_dim(m.stride or m.kernel_size, dims)
    d = per_dim(getattr(m, "dilation", 1), dims)
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
        flops = float(out_n * math.prod(per_dim(m.kernel_size, dims)))
    elif isinstance(m, GLOBAL_POOLS):
        kind, flops = "global_pool", float(math.prod(ins))
    elif isinstance(m, nn.Linear):
        # per row: every token's (or the one feature vector's) in x out multiply-adds
        kind, flops = "linear", 2.0 * m.in_features * out_n
    elif isinstance(m, ELEMENTWISE):
        kind = "act"
    inplace = bool(getattr(m, "inplace", False))
    return Layer(
        name, kind, ins, outs, flops, params, len(own), window, groups, inplace, spatial, (), m
    )


def walk(model: nn.Module, input_shape: Shape, name: str = "model", **net: Any) -> Net:
    """Run ``model`` once on a meta tensor of ``(1, *input_shape)`` and record its leaf calls.

    A copy of the model goes to the meta device, so nothing is allocated or computed; the
    records keep references to the real leaf modules (for timing them, see
    :mod:`parallelkit.plan.measure`). The spatial region ends at the first global pooling or
    fully connected layer on whole features ``(N, F)``, or at a module named in ``keep_dense``;
    the token-mixing calls inside it are the net's ``mixing``.
    """
    keep_dense = tuple(net.get("keep_dense", ()))
    real = dict(model.named_modules())
    meta = _to_meta(model)
    layers: list[Layer] = []
    seen = Mixings([name], len(input_shape) - 1)
    seen.add_map(tuple(input_shape[1:]))

    def hook(mod_name: str):
        def record(m: nn.Module, args: tuple, out: Any) -> None:
            if (
                not args
                or not isinstance(args[0], torch.Tensor)
                or not isinstance(out, torch.Tensor)
            ):
                return
            # a Linear on (N, F) is on whole features; on (N, ..., F) it maps each token's
            # features and the block stays split (a transformer's or ConvNeXt's MLP)
            dense = isinstance(m, GLOBAL_POOLS) or (isinstance(m, nn.Linear) and out.dim() == 2)
            if dense or any(mod_name == k or mod_name.startswith(f"{k}.") for k in keep_dense):
                seen.spatial = False  # the region ends
            split = seen.spatial and 3 <= out.dim() <= 5  # (N, C, L) to (N, C, D, H, W)
            layer = _record(mod_name, m, args[0], out, split)
            tokens = seen.tokens_at(args[0], -1) if isinstance(m, nn.AvgPool1d) else None
            if split and tokens and len(tokens) > 1:  # over a map's flattened tokens (Next-ViT)
                seen.add("reduce", tokens, out)  # its small result all-reduced, whole
                layer = replace(layer, kind="other", window=(), tokens=tokens)
            elif split and layer.kind in MAP_KINDS:
                seen.add_map(layer.in_shape[1:])
                seen.add_map(layer.out_shape[1:])
            elif split and (layer.kind == "linear" or out.dim() != len(input_shape) + 1):
                layer = replace(layer, tokens=seen.token_map(out.shape[1:]))  # not (N, C, *map)
            layers.append(_with_module(layer, real[mod_name]))

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in meta.named_modules()
        if not list(m.children()) and n
    ]
    for n, m in meta.named_modules():  # the module a token-mixing call runs in
        handles.append(m.register_forward_pre_hook(lambda *_, n=n: seen.enter(n or name)))
        handles.append(m.register_forward_hook(lambda *_: seen.leave()))
    try:
        with torch.no_grad(), seen:
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
        output_shape=_output_shape(out), mixing=tuple(seen.records), **net,
    )  # fmt: skip


MAP_KINDS = ("conv", "convT", "norm", "sample_norm", "pool")  # (C, *spatial) in and out
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


def sample_shape(size: int | Sequence[int], dims: int = 2) -> Shape:
    """A sample's spatial size: ``size`` along each of ``dims`` dimensions (a square image, a
    cube), or ``size`` itself when it lists every side (``(D, H, W)``)."""
    if isinstance(size, int):
        return (size,) * dims
    return tuple(int(v) for v in size)


def default_dims(name: str, kwargs: Mapping[str, Any] | None = None) -> int:
    """The spatial dimensions model ``name`` takes unless told: ``spatial_dims`` where
    ``kwargs`` sets it (MONAI's networks, the built-in U-Net), 3 for MONAI's networks
    otherwise, 2 for every other."""
    if "spatial_dims" in (kwargs or {}):
        return int(kwargs["spatial_dims"])
    return 3 if name.startswith("monai:") else 2


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
        return _gan(channels, size)
    if is_zoo_name(name):
        return [walk(_zoo(name, classes, channels, kwargs), shape, name)]
    if imported.is_import_path(name):  # the user's own, as train builds it (model.name)
        model = models.create(name, num_classes=classes, in_channels=channels, **kwargs)
        return [walk(model, shape, name)]
    if name in BUILTIN:
        extra = {"stem": stem} if name.startswith("resnet") else {}
        model = models.create(name, num_classes=classes, in_channels=channels, **extra, **kwargs)
        return [walk(model, shape, name)]
    raise ValueError(
        f"unknown model {name!r}; built-in models: {', '.join(BUILTIN)}, a zoo network as "
        "torchvision:NAME, timm:NAME, monai:NAME or smp:ARCH, or your own as package.module:Class"
    )


def _zoo(name: str, classes: int, channels: int, kwargs: Mapping[str, Any]) -> nn.Module:
    """Another library's network as ``parallelkit train``'s ``model.name`` builds it, untrained.

    Its errors (a library missing, an unknown name, a required argument unset) are the
    config's, which speak of ``model.kwargs``: here that is ``--model-kwargs``.
    """
    try:
        return models.create(name, num_classes=classes, in_channels=channels, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e).removeprefix("config: ")) from e


# ---------------------------------------------------------------------------- the GAN step
def _gan(channels: int, size: Shape) -> list[Net]:
    """The GAN task's generator and discriminator walked, each with the passes the task's
    training step (:meth:`parallelkit.train.tasks.Gan.step`) runs it for: counted by running
    that step on the meta device (:func:`gan_step_calls`), so the plan follows the step."""
    g = models.create("dcgan_generator", nc=channels, image_size=size[-1])
    d = models.create("dcgan_discriminator", nc=channels, image_size=size[-1])
    nz = g.main[0].in_channels  # the noise (N, nz, 1, 1)
    g_calls, d_calls = gan_step_calls(g, d, (channels, *size), nz)
    return [
        walk(g, (nz, 1, 1), "generator", **g_calls),
        # The 4x4 -> 1x1 head runs on the whole image, as the task parallelizes it
        # (keep_dense=("head",): see parallelkit.models.dcgan).
        walk(d, (channels, *size), "discriminator", keep_dense=("head",), **d_calls),
    ]


def gan_step_calls(
    generator: nn.Module, discriminator: nn.Module, image: Shape, nz: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """How one step of :meth:`parallelkit.train.tasks.Gan.step` runs each network, as
    :class:`Net` fields: ``passes`` (calls), ``grad_passes`` (calls with its parameters
    trainable: those compute their gradients) and ``input_grad`` (whether a call's input
    needs a gradient, as the generator's fakes do through the discriminator).

    Why run the step rather than write the counts down: they are the step's code (the
    discriminator on real and detached fake images, then on the fakes again with its
    parameters frozen), and a change there should change the plan. Meta copies of the
    networks, batch 1: nothing is allocated or computed, no optimizer steps.
    """
    from parallelkit.train.tasks import Gan

    task = _GanTask(_to_meta(generator), _to_meta(discriminator), nz)
    calls = [_Calls(), _Calls()]
    hooks = [
        net.register_forward_pre_hook(count.record)
        for net, count in zip((task.generator, task.discriminator), calls, strict=True)
    ]
    try:
        Gan.step(task, torch.empty((1, *image), device="meta"), None, 0)  # type: ignore[arg-type]
    finally:
        for h in hooks:
            h.remove()
    return calls[0].as_net_fields(), calls[1].as_net_fields()


@dataclass
class _Calls:
    """The calls of one network during a step, counted by a forward pre-hook."""

    passes: int = 0
    grad_passes: int = 0
    input_grad: bool = False

    def record(self, module: nn.Module, args: tuple) -> None:
        self.passes += 1
        self.grad_passes += any(p.requires_grad for p in module.parameters())
        first = args[0] if args else None
        self.input_grad |= isinstance(first, torch.Tensor) and first.requires_grad

    def as_net_fields(self) -> dict[str, Any]:
        return {
            "passes": self.passes, "grad_passes": self.grad_passes, "input_grad": self.input_grad,
        }  # fmt: skip


class _GanTask:
    """What :meth:`parallelkit.train.tasks.Gan.step` reads of its task, with nothing behind
    it: the networks, meta noise, no mixed precision and no optimizer."""

    def __init__(self, generator: nn.Module, discriminator: nn.Module, nz: int) -> None:
        self.generator, self.discriminator, self.nz = generator, discriminator, nz
        self.autocast = contextlib.nullcontext()

    def noise(self, step: int, n_local: int) -> torch.Tensor:
        return torch.empty((n_local, self.nz, 1, 1), device="meta")

    def update(self, name: str) -> None:
        """The optimizer step: none here."""
