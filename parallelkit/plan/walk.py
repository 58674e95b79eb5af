"""The planner's view of a network: its leaf layers in call order, with shapes, FLOPs and
parameters, found by one forward pass on the meta device (no memory, no compute).

The cost model (:mod:`parallelkit.plan.cost`) never looks at modules, only at these records,
so it is pure and its tests need no torch model at all. A record holds what the parallel
layers' costs depend on: per-sample input and output shapes, the sliding window of a
convolution or pooling layer along each spatial dimension (for the halo geometry), the channel
counts (for the channel-parallel collectives) and whether the layer lies inside the spatial
region (before the first global pooling or fully connected layer on whole features: where
``pk.parallelize(..., "spatial")`` keeps activations split).

Token mixing (:class:`Mixing`): the calls that mix the tokens of a split sample, which the
spatial strategy makes exact with collectives (``parallelkit/spatial/rules/tokens.py``), are
recorded beside the layers, seen as functions while the forward runs (a torch function mode):
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
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from parallelkit import models
from parallelkit.geometry import conv_padding, per_dim
from parallelkit.models import imported
from parallelkit.models.zoo import is_zoo_name

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
class Mixing:
    """One token-mixing call in the spatial region and what its collectives move, per sample.

    ``kind`` and ``numel`` (whole tensors, one sample):

        attention  self-attention by ``scaled_dot_product_attention`` (queries, keys and values
                   of the same tokens): the head all-to-all or the ring, as the number of
                   ranks decides; numel (q, k, v, output)
        gather     keys or values (of another map, or of the explicit ``q @ k^T``, ``@ v``)
                   all-gathered whole; numel of each gathered tensor
        reduce     a contraction over tokens, a linear map over the token axis or an
                   ``AvgPool1d`` over the flattened tokens: its small result all-reduced;
                   numel (result,)
        fetch      rows another rank holds read in place of this rank's own: a ``flip`` along
                   a spatial dimension (the mirrored rows), a ``grid_sample`` (the rows its
                   coordinates reach, counted as one block: a smooth warp reads mostly its
                   own, a rotation another rank's); numel (the tensor read,)
        axis       a whole square matrix over one spatial dimension of a map (BAT's ``p @ x``,
                   a ``Linear`` along W): each rank's partial map reduce-scattered along
                   it forward, all-gathered backward; numel (the map,)
        move       a view or reshape that cuts the map's dimensions into groups of ``groups``
                   rows (Swin's window partition, a space-to-depth) or merges them back:
                   where a rank's block is not whole groups, rows move to a neighbour first;
                   numel (the tensor,)

    ``tokens``: the map flattened into the queries' (attention) or the gathered tensors' token
    dimension, whose block a rank holds. ``heads``: the attention's heads; ``masked``: a mask,
    causal masking or grouped keys/values, which the head all-to-all does not take.
    """

    name: str  # the module it ran in
    kind: str  # attention | gather | reduce | fetch | axis | move
    tokens: Shape
    numel: tuple[int, ...]
    heads: int = 0
    masked: bool = False
    groups: Shape = ()  # move: the group size along each of the map's dimensions (1: uncut)
    along: Shape = ()  # fetch, axis: the map's dimensions read across (0 for its first)


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
    seen = _Mixings([name], len(input_shape) - 1)
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
MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
RESHAPES = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
FLIPS = (torch.flip, torch.Tensor.flip)
ROW_READS = (*FLIPS, torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod,
             F.grid_sample)  # fmt: skip


CLASS_TOKENS = 8
"""The most whole tokens before a map's tokens that the walk reads as class tokens."""


def _arg(args: tuple, kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


class _Mixings(TorchFunctionMode):
    """Records the token-mixing calls of the spatial region while the walk's forward runs
    (see the module docstring): what each moves under ``parallelkit/spatial/rules/tokens.py``'s
    rules. A call is handled as a whole (its inner calls are not seen): nn.MultiheadAttention
    is one record, as its rule writes it out."""

    def __init__(self, names: list[str], dims: int) -> None:
        super().__init__()
        self.names = names  # the modules running, innermost last
        self.dims = dims  # the samples' spatial dimensions
        self.maps: dict[int, Shape] = {}  # the region's feature maps by their token count
        self.records: list[Mixing] = []
        self.spatial = True

    def enter(self, name: str) -> None:
        self.names.append(name)

    def leave(self) -> None:
        self.names.pop()

    def add_map(self, size: Sequence[int]) -> None:
        if size and math.prod(size) > 1:
            self.maps.setdefault(math.prod(size), tuple(size))

    def _is_map(self, shape: Sequence[int]) -> bool:
        """Whether ``shape`` ends with one of the region's maps of 2 or 3 dimensions (a signal's
        L is its token dimension as it is)."""
        return any(len(m) > 1 and tuple(shape[-len(m) :]) == m for m in self.maps.values())

    def token_map(self, shape: Sequence[int]) -> Shape:
        """The map flattened into a dimension of per-sample ``shape``; () for none or a map."""
        if not self.spatial or self._is_map(shape) or tuple(shape[1:]) in self.maps.values():
            return ()
        return next((self.maps[n] for n in shape if n in self.maps), ())

    def tokens_at(self, t: Any, dim: int) -> Shape | None:
        """The map whose tokens tensor ``t`` holds in dimension ``dim``, if it does, maybe
        after a few class tokens (a class token, a distillation token, register tokens)."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or self._is_map(t.shape):
            return None
        n = t.shape[dim]
        return next((self.maps[n - p] for p in range(CLASS_TOKENS + 1) if n - p in self.maps),
                    None)  # fmt: skip

    def add(self, kind: str, tokens: Shape, *tensors: torch.Tensor, **more: Any) -> None:
        numel = tuple(t.numel() for t in tensors)  # batch 1: one sample
        self.records.append(Mixing(self.names[-1], kind, tokens, numel, **more))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.spatial and self.maps:
            if func is F.scaled_dot_product_attention:
                self._attention(args, kwargs, out)
            elif func is F.multi_head_attention_forward:
                self._multihead(args, kwargs, out)
            elif func in MATMULS and len(args) == 2:
                self._product(*args, out)
            elif func is F.linear:
                self._linear(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), out)
            elif func in RESHAPES and isinstance(args[0], torch.Tensor):
                self._regroup(args[0], out)
            elif func in ROW_READS:
                self._rows(func, args, kwargs)
        return out

    def _rows(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A flip, a running sum or product along a spatial dimension, or a ``grid_sample`` of
        a map (N, C, *spatial): the rows each rank reads of the others' blocks."""
        x = _arg(args, kwargs, 0, "input")
        if not isinstance(x, torch.Tensor) or x.dim() != self.dims + 2:
            return
        spatial = range(2, x.dim())
        if func is F.grid_sample:
            self.add("fetch", tuple(x.shape[2:]), x, along=tuple(range(self.dims)))
        elif func in FLIPS:
            dims = _arg(args, kwargs, 1, "dims")
            dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
            if along := tuple(sorted({d % x.dim() - 2 for d in dims if d % x.dim() in spatial})):
                self.add("fetch", tuple(x.shape[2:]), x, along=along)
        elif (d := _arg(args, kwargs, 1, "dim")) is not None and d % x.dim() in spatial:
            self.add("reduce", tuple(x.shape[2:]), x.select(d, 0))  # each block's last row

    def _regroup(self, x: torch.Tensor, out: Any) -> None:
        """A reshape that cuts a map's dimensions into (groups, rows of a group), or merges
        such groups back into the map: the rows ``parallelkit/spatial/rules/views.py`` moves
        between neighbours where blocks are not whole groups. Seen where the map itself is
        in the tensor (a padded map of another size is not)."""
        if not isinstance(out, torch.Tensor) or out.shape == x.shape:
            return
        for whole, cut in ((x.shape, out.shape), (out.shape, x.shape)):
            for m in self.maps.values():
                if len(m) > 1 and (groups := _groups(tuple(whole), tuple(cut), m)):
                    self.add("move", m, x, groups=groups)
                    return

    def _attention(self, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """The rule's choice: self-attention (queries, keys and values of one map, alike)
        goes by heads or around the ring; split keys of another map are gathered."""
        q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        mask, causal = _arg(args, kwargs, 3, "attn_mask"), _arg(args, kwargs, 5, "is_causal")
        gqa = kwargs.get("enable_gqa", False)
        tq, tk = self.tokens_at(q, -2), self.tokens_at(k, -2)
        if tk is None:  # whole keys and values: the queries' rows stay local
            return
        if tq == tk and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and not gqa:
            heads = q.shape[-3] if q.dim() >= 3 else 0
            masked = mask is not None or bool(causal)
            self.add("attention", tq, q, k, v, out, heads=heads, masked=masked)
        else:
            self.add("gather", tk, k, v)

    def _multihead(self, args: tuple, kwargs: dict, out: Any) -> None:
        """nn.MultiheadAttention on (L, N, E): by ``scaled_dot_product_attention`` where no
        weights are asked for, else by the explicit pattern (keys and values gathered)."""
        q, k, v = args[:3]
        tq, tk = self.tokens_at(q.transpose(0, 1), -2), self.tokens_at(k.transpose(0, 1), -2)
        if tk is None:
            return
        if kwargs.get("need_weights", True) or tq != tk:
            self.add("gather", tk, k, v)  # their projections: as many elements
            return
        masked = kwargs.get("attn_mask") is not None or kwargs.get("is_causal", False)
        y = out[0] if isinstance(out, tuple) else out
        self.add("attention", tq, q, k, v, y, heads=args[4], masked=masked)

    def _product(self, x: Any, w: Any, out: Any) -> None:
        """``x @ w`` as ``tokens.matmul`` reads it: scores and ``attn @ v`` gather ``w``;
        a contraction over tokens, or a map over them, all-reduces its result."""
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return
        if self._along_one(w, x, out, -2) or self._along_one(x, w, out, -1):
            return
        if min(x.dim(), w.dim()) < 2:
            return
        rows, cols = self.tokens_at(x, -2), self.tokens_at(x, -1)
        w_tokens = self.tokens_at(w, -2) or self.tokens_at(w, -1)
        if rows and w_tokens:  # q @ k^T, attn @ v
            self.add("gather", w_tokens, w)
        elif cols:
            self.add("reduce", cols, out)  # k^T @ v, a whole (L, M) map over the tokens
        elif rows is None and cols is None and (t := self.tokens_at(w, -2)):
            self.add("reduce", t, out)  # a whole (M, L) matrix times a block

    def _linear(self, x: Any, weight: Any, out: Any) -> None:
        """``F.linear`` over the token axis (MLP-Mixer's token mixing): its output all-reduced.
        Over (N, F) it is the fully connected layer that ends the region (gathered there)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or weight.dim() != 2:
            return
        if (t := self.tokens_at(x, -1)) and weight.shape[1] == x.shape[-1]:
            self.add("reduce", t, out)
        else:
            self._along_one(x, weight, out, -1)

    def _along_one(self, x: Any, w: Any, out: Any, d: int) -> bool:
        """A whole square matrix over one spatial dimension ``d`` (-2: ``w @ x``, -1: ``x @ w``)
        of a map (N, C, *spatial), to a map of the same shape (BAT's bilinear transform,
        sMLP's ``Linear`` along W): each rank's partial map reduce-scattered along it."""
        if not isinstance(x, torch.Tensor) or x.dim() != self.dims + 2 or self.dims < 2:
            return False
        n = x.shape[d]
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or w.shape[-2:] != (n, n):
            return False
        size, i = tuple(x.shape[2:]), self.dims + d
        known = self.maps.values()
        if size not in known and size[::-1] in known:  # a transposed image: H last
            size, i = size[::-1], self.dims - 1 - i
        elif size not in known:  # not a map of the region (attention's (N, h, L, d))
            return False
        self.add("axis", size, out, along=(i,))
        return True


def _groups(whole: Shape, cut: Shape, m: Shape) -> Shape | None:
    """The group size along each dimension of map ``m`` where shape ``whole`` holds ``m`` and
    shape ``cut`` holds, at the same place, each of its sizes whole or as (groups, rows), at
    least one cut; None otherwise."""
    k = len(m)
    for i in range(len(whole) - k + 1):
        if tuple(whole[i : i + k]) != m:
            continue
        lead = math.prod(whole[:i])
        for j in range(len(cut)):
            if math.prod(cut[:j]) == lead and (groups := _cut_at(cut, j, m)):
                return groups
    return None


def _cut_at(cut: Shape, j: int, m: Shape) -> Shape | None:
    """The group sizes where ``cut`` holds map ``m`` from place ``j`` on, each size whole or
    as (groups, rows), at least one of them in more than one group; None otherwise.

    A size as (1, rows) is one window along that dimension, as the rules read it only beside
    a real partition (Swin's ``view(B, 2, 7, 1, 7, C)``); alone it is a dimension of one put
    before the map (``view(n, 1, h, w)`` of an (n, h, w) map, the walk's batch of one), which
    moves nothing."""
    groups, partition = [], False
    for n in m:
        if j < len(cut) and cut[j] == n:
            groups.append(1)
            j += 1
        elif j + 1 < len(cut) and cut[j] * cut[j + 1] == n and cut[j] < n:
            groups.append(cut[j + 1])
            partition = partition or cut[j] > 1
            j += 2
        else:
            return None
    return tuple(groups) if partition else None


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
