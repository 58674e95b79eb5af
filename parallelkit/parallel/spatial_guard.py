"""The spatial guard: every operation on a block of split images is exact, or it is refused.

Under spatial parallelism the leaf layers that read neighbouring pixels (convolution, pooling,
upsampling, BatchNorm statistics) are swapped for spatial ones. But the operations that decide
correctness also live in forward code that swapping never sees: ``x * gate`` in an SE block,
``x.mean((2, 3))``, ``torch.cat``, a parameter used directly, ``F.interpolate``. While a
:class:`~parallelkit.parallel.SpatialRegion` runs, this guard (a torch function mode) sees
every torch call, records which tensors are this rank's block of the split images, and for
each call that touches one applies a rule:

- inside the swapped layers (and SyncBatchNorm, keep_dense modules): nothing to check; their
  outputs are blocks when their inputs were;
- pointwise operations (activations, arithmetic, ``where``, dropout in eval): local, exact.
  A whole tensor meeting a block (an SE gate, a layer scale, a bias used directly) must be
  constant over H and W (size 1 there); each rank's gradient of it is its block's share,
  summed over the spatial group where it meets the blocks (``copy_to_group``) or, under
  ``pk.parallelize``, left as a share (:mod:`parallelkit.spatial.layout`);
- ``cat``/``split``/``chunk``/indexing along channels, reshapes that keep the last two
  dimensions, type and memory-format changes: local, exact;
- operations with a fetch geometry or a reduction of their own: functional convolution,
  pooling, interpolation and padding (the spatial layers' halo fetch), sums, means, maxima
  and minima over H and W, group and instance norms, dropout masks (each rule's docstring);
- anything else (other reductions over H or W, reshapes that merge them, padding computed
  from a block's own size, ...): a ``ValueError`` naming the operation, the module and the
  way out (``keep_dense=[...]``). Every rank runs the same code on the same shapes of blocks,
  so every rank raises at the same operation, and none waits in a collective.

docs/parallelism.md has the table of every rule.

The region's output, any nesting of tuples, lists and dicts, is gathered where it is split
and returned as is where it is whole.

Legend: a *block* is this rank's (N, C, h, w) part of split images; a *whole* tensor is the same
on every rank of the spatial group. ``hw`` is where a block's H and W dimensions are, counted
from the end: (-2, -1) for (N, C, H, W), (-3, -2) after ConvNeXt's permute to (N, H, W, C).
Channels-last blocks take pointwise operations, ``F.layer_norm`` and ``F.linear`` over the
channels (weights' gradients summed); swapped layers and BatchNorm want (N, C, H, W) blocks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

import parallelkit.functional as pkf
from parallelkit.comm import Communicator, tensor_split_sizes
from parallelkit.geometry import starts
from parallelkit.nn import spatial_parallel as sp
from parallelkit.nn import spatial_pooling as spool
from parallelkit.nn.batchnorm_subclass import _SyncSubclass
from parallelkit.nn.sync_batchnorm import SyncBatchNorm
from parallelkit.spatial import layout
from parallelkit.spatial.grid import SpatialGrid, gather, grid_of, scatter

# Layers that handle blocks themselves (and whole inputs); modules with a true class attribute
# ``ends_spatial_region`` (global pooling, keep_dense modules) also take blocks, return whole.
_SPATIAL = (
    sp.SpatialParallelConv2d,
    sp.SpatialConvTranspose2d,
    spool.SpatialMaxPool2d,
    spool.SpatialAvgPool2d,
    spool.SpatialUpsample,
)
_NORMS = (SyncBatchNorm, _SyncSubclass)
Size = tuple[int, int]


def _words(text: str) -> list[str]:
    return text.split()


_POINTWISE_NAMES = _words(
    """
abs absolute acos add addcdiv addcmul asin atan atan2 ceil clamp clamp_max clamp_min clip cos
cosh div divide elu erf erfc exp exp2 expm1 floor floor_divide fmod frac gelu hardshrink
hardsigmoid hardswish hardtanh leaky_relu lerp log log10 log1p log2 logical_and logical_not
logical_or logit masked_fill maximum minimum mish mul multiply nan_to_num neg negative pow
reciprocal relu relu6 remainder round rrelu rsqrt selu sigmoid sign silu sin sinh
softplus softshrink sqrt square sub subtract tan tanh tanhshrink threshold true_divide trunc
where xlogy eq ne lt le gt ge celu logsigmoid
"""
)
_DUNDERS = _words(
    """
add radd iadd sub rsub isub mul rmul imul truediv rtruediv itruediv div rdiv idiv pow rpow
ipow neg pos abs floordiv rfloordiv mod and or xor invert eq ne lt le gt ge
"""
)
_LOCAL_NAMES = _words(
    """
contiguous clone detach detach_ float double half bfloat16 long int bool to type type_as
requires_grad_ cpu cuda retain_grad zero_ fill_ copy_ sigmoid_ tanh_ relu_ clamp_ __deepcopy__
"""
)
_METADATA_NAMES = _words(
    """
size dim ndimension numel nelement element_size is_contiguous is_floating_point
is_complex get_device data_ptr stride storage_offset __len__ __repr__ __format__ __hash__
register_hook
"""
)
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "std", "var", "prod", "logsumexp",
               "norm", "softmax", "log_softmax", "argmax", "argmin", "all", "any")  # fmt: skip
_RESHAPES = (
    "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
)  # fmt: skip
_PERMUTES = ("permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis")
_SPLITS = ("split", "chunk", "tensor_split", "unbind", "split_with_sizes")
_DROPOUTS = (
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout,
)  # fmt: skip


def _functions(names: list[str], *owners: Any) -> set[Callable]:
    found = set()
    for name in names:
        for owner in owners:
            for variant in (name, f"{name}_"):
                if (fn := getattr(owner, variant, None)) is not None:
                    found.add(fn)
    return found


_POINTWISE = _functions(_POINTWISE_NAMES, torch, Tensor, F, torch.special) | {
    getattr(Tensor, f"__{name}__") for name in _DUNDERS if hasattr(Tensor, f"__{name}__")
}
_LOCAL = {getattr(Tensor, n) for n in _LOCAL_NAMES if hasattr(Tensor, n)}
_METADATA = {getattr(Tensor, n) for n in _METADATA_NAMES if hasattr(Tensor, n)}
_NAMED = {
    fn: kind
    for kind, names in (
        ("reshape", _RESHAPES),
        ("permute", _PERMUTES),
        ("split", _SPLITS),
        ("reduce", _REDUCTIONS),
    )
    for owner in (torch, Tensor, F)
    for name in names
    if (fn := getattr(owner, name, None)) is not None
}


class SpatialGuard(TorchFunctionMode):
    """Follows blocks of split images through one forward of ``model`` (see the module
    docstring); ``comm`` is the spatial group, over which whole tensors' gradients are summed."""

    def __init__(
        self,
        model: nn.Module,
        comm: Communicator,
        grid: SpatialGrid | None = None,
        whole_comm: Communicator | None = None,
        shares: bool = False,
    ) -> None:
        super().__init__()
        self.comm, self._grid, self.whole_comm = comm, grid, whole_comm
        self.shares = shares  # whole tensors' gradients: shares or full (spatial.layout)
        self._layers: dict[tuple, nn.Module] = {}  # spatial layers made for functional calls
        self._restore: dict[int, tuple[Any, Any]] = {}
        self._warned: set[Callable] = set()
        self.names = {m: name for name, m in model.named_modules()}
        # id -> (the block, where its H and W are, the whole images' (H, W) if known)
        self._blocks: dict[int, tuple[weakref.ref, tuple[int, int], Size | None]] = {}
        self._size_now: Size | None = None  # the whole size of the call being ruled on
        self._sized: dict[int, weakref.ref] = {}  # blocks whose H or W forward code read
        self._read_sizes: set[tuple[Size, Size | None]] = set()  # their (h, w), whole (H, W)
        self._stack: list[tuple[nn.Module, bool, bool, Size | None] | None] = []
        self._trusted = 0
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ the record
    def is_split(self, t: Any) -> bool:
        entry = self._blocks.get(id(t)) if isinstance(t, Tensor) else None
        return entry is not None and entry[0]() is t

    def hw(self, t: Tensor) -> tuple[int, int]:
        """Where block ``t``'s H and W are, counted from the end."""
        return self._blocks[id(t)][1]

    def size_of(self, t: Tensor) -> Size | None:
        """The whole images' (H, W) of block ``t``, if known: it travels from the region's
        input through every rule and layer, so spatial layers need no size all-gather."""
        return self._blocks[id(t)][2] if self.is_split(t) else None

    def mark(self, *tensors: Any, hw: tuple[int, int] = (-2, -1), size: Size | None = None) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, Tensor) and t.dim() >= -min(hw):
                self._blocks[id(t)] = (weakref.ref(t), hw, size)

    # ------------------------------------------------------------------ entering and leaving
    def __enter__(self) -> SpatialGuard:
        self._hooks = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._leave_module),
        ]
        layout.push(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        layout.pop()
        for hook in self._hooks:
            hook.remove()

    def _enter_module(self, module: nn.Module, args: tuple) -> None:
        if self._trusted or module not in self.names:
            self._stack.append(None)
            return
        ends = getattr(module, "ends_spatial_region", False)
        trusted = ends or isinstance(module, (*_SPATIAL, *_NORMS))
        blocks = self._blocks_in(args, {})
        split_in = bool(blocks)
        if trusted and any(self.hw(b) != (-2, -1) for b in blocks):
            raise self._refuse(type(module).__name__, "it wants (N, C, H, W) blocks", module)
        if trusted and isinstance(module, _NORMS) and not split_in and self.comm.size > 1:
            self._normalize_whole(module)
        self._trusted += trusted
        size = self.size_of(blocks[0]) if blocks else None
        self._stack.append((module, trusted, split_in and not ends, size))

    def _leave_module(self, module: nn.Module, args: tuple, out: Any) -> None:
        entry = self._stack.pop()
        if entry is None:
            return
        _, trusted, blocks_out, size = entry
        if id(module) in self._restore:
            _set_comms(module, *self._restore.pop(id(module)))
        if trusted:
            self._trusted -= 1
            if blocks_out:  # a spatial layer's output size from its geometry; norms keep it
                self.mark(out, size=_out_size(module, size))

    @property
    def grid(self) -> SpatialGrid:
        if self._grid is None:
            self._grid = grid_of(self.comm)
        return self._grid

    def _normalize_whole(self, module: nn.Module) -> None:
        """BatchNorm on a whole tensor (DeepLab's pooled branch): every rank of the spatial
        group holds the same samples, so statistics go over the data group only, and each
        rank's parameter gradient is already the dense one (or, under shares, a share of it)."""
        if self.whole_comm is None:
            raise self._refuse(
                "BatchNorm", "its input is whole (not a block) and this region has no data "
                "group to normalize it over", module,
            )  # fmt: skip
        self._restore[id(module)] = _comms(module)
        _set_comms(module, self.whole_comm, None)

    # ------------------------------------------------------------------ the rules
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self._trusted:
            return func(*args, **kwargs)
        blocks = self._blocks_in(args, kwargs)
        if not blocks and func is F.interpolate:
            resized = self._whole_to_block(args, kwargs)
            return resized if resized is not None else func(*args, **kwargs)
        if func is Tensor.size and blocks:
            self._note_sized(func, args, kwargs)
        if not blocks or func in _METADATA:
            return func(*args, **kwargs)
        before, self._size_now = self._size_now, self.size_of(blocks[0])
        try:
            return self._rule(func, args, kwargs, blocks)
        finally:
            self._size_now = before

    def _rule(self, func, args: tuple, kwargs: dict, blocks: list[Tensor]) -> Any:  # type: ignore[no-untyped-def]
        """The rule for ``func`` touching ``blocks``; its outputs that are blocks are marked
        with the whole size of the first (unless the rule changes it)."""
        hw = self.hw(blocks[0])
        if func in _POINTWISE:
            return self._pointwise(func, args, kwargs, blocks)
        if func in _LOCAL:
            return self._marked(func(*args, **kwargs), hw)
        if func in (F.layer_norm, F.linear):
            return self._over_channels(func, args, kwargs, hw)
        if func in _DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func is F.interpolate:
            return self._interpolate(args, kwargs)
        if func in (F.max_pool2d, F.avg_pool2d):
            return self._pool(func, args, kwargs)
        if func is F.group_norm:
            return self._group_norm(*args, **kwargs)
        if func is F.instance_norm and _arg(args, kwargs, 1, "running_mean") is None:
            x = args[0]
            weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
            eps = kwargs.get("eps", args[7] if len(args) > 7 else 1e-5)
            return self._group_norm(x, x.shape[1], weight, bias, eps)
        if func is F.pad:
            return self._pad(args, kwargs)
        if func in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
            return self._adaptive_pool(func, args, kwargs)
        if getattr(func, "__name__", "") == "__get__":
            return self._property(func, args, kwargs)
        if func in (torch.cat, torch.concat, torch.concatenate, torch.stack):
            return self._cat(func, args, kwargs, blocks)
        if func is Tensor.__getitem__:
            return self._getitem(func, args, kwargs)
        if func in (F.conv2d, torch.conv2d):
            return self._conv(func, args, kwargs)
        if func in (F.prelu, torch.prelu):  # the weight broadcasts over channels
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            self._nchw(func, x)
            return self._marked(func(x, self._summed(weight)))
        kind = _NAMED.get(func)
        if kind is not None:
            return getattr(self, f"_{kind}")(func, args, kwargs)
        raise self._refuse(_name(func), "it has no exact rule for blocks of split images")

    def _blocks_in(self, args: tuple, kwargs: dict) -> list[Tensor]:
        """The blocks among the arguments (tensors, and tensors in lists and tuples: what
        torch functions take), without flattening the arguments on every call."""
        found = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                if self.is_split(a):
                    found.append(a)
            elif isinstance(a, list | tuple):
                found += [t for t in a if self.is_split(t)]
        return found

    def _marked(self, out: Any, hw: tuple[int, int] = (-2, -1), size: Size | None = None) -> Any:
        self.mark(out, hw=hw, size=size or self._size_now)
        return out

    def _nchw(self, func, x: Tensor) -> None:
        if self.hw(x) != (-2, -1):
            raise self._refuse(_name(func), "this rule wants an (N, C, H, W) block")

    def _summed(self, t: Any) -> Any:
        """A whole tensor acting on blocks: identity forward, gradient summed over the group
        (where gradients are shares, nothing to do: ``layout.replicated``)."""
        if isinstance(t, Tensor) and t.requires_grad and not self.is_split(t):
            return layout.replicated(t, self.comm)
        return t

    def _pointwise(self, func, args, kwargs, blocks: list[Tensor]) -> Any:
        hw = self.hw(blocks[0])
        sizes = {tuple(b.shape[d] for d in hw) for b in blocks}
        if len(sizes) > 1 or any(self.hw(b) != hw for b in blocks):
            raise self._refuse(_name(func), f"its blocks have different layouts {sorted(sizes)}")

        def replicate(t: Any) -> Any:
            if not isinstance(t, Tensor) or self.is_split(t):
                return t
            if any(t.dim() >= -d and t.shape[d] != 1 for d in hw):
                raise self._refuse(
                    _name(func), f"a whole tensor of shape {tuple(t.shape)} varies over H or W"
                )
            return self._summed(t)

        args, kwargs = tree_map(replicate, (args, kwargs))
        return self._marked(func(*args, **kwargs), hw)

    def _over_channels(self, func, args, kwargs, hw: tuple[int, int]) -> Any:
        """F.layer_norm over trailing dimensions, F.linear on the last one: local where those
        are not H or W (ConvNeXt's channels-last blocks), the weights' gradients summed."""
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        if func is F.linear:
            names = ("input", "weight", "bias")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        reach = len(call["normalized_shape"]) if func is F.layer_norm else 1
        if -reach > max(hw):
            call = {k: self._summed(v) if k in ("weight", "bias") else v for k, v in call.items()}
            return self._marked(func(**call), hw)
        if func is F.layer_norm and hw == (-2, -1):
            return self._layer_norm_hw(call, reach)
        raise self._refuse(_name(func), "it acts over H or W (permute the channels last first)")

    def _layer_norm_hw(self, call: dict, reach: int) -> Tensor:
        """LayerNorm over (C,) H and W (a WGAN-GP critic's ``nn.LayerNorm([C, H, W])``): the
        statistics written out as means of the whole images, and the affine parameters,
        shaped for the whole images, cut to this rank's block (each rank's gradient of them
        is zero outside its block, so the shares add up to the dense gradient)."""
        x, shape = call["input"], tuple(call["normalized_shape"])
        h, w = self._size_now or self.grid.global_size(x, "F.layer_norm")
        if shape[-2:] != (h, w):
            raise self._refuse(
                "F.layer_norm", f"its normalized_shape {shape} does not end in the whole "
                f"images' {(h, w)}",
            )  # fmt: skip
        dims = list(range(x.dim() - reach, x.dim()))
        with self._rules():
            centred = x - x.mean(dims, keepdim=True)
            var = centred.square().mean(dims, keepdim=True)
        y = centred / torch.sqrt(var + call.get("eps", 1e-5))
        rows, cols = self.grid.block(h, w)
        if (weight := call.get("weight")) is not None:
            y = y * self._summed(weight)[..., rows, cols]
        if (bias := call.get("bias")) is not None:
            y = y + self._summed(bias)[..., rows, cols]
        return self._marked(y)

    def _dropout(self, func, args, kwargs) -> Any:
        """Dropout's mask drawn for the whole images from this rank's generator, then cut to
        the block: the dense model's mask when every rank's generator is in the same state
        (ranks seeded alike). It costs one whole-image noise tensor per call, transiently."""
        x = args[0]
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        if not training or p == 0:
            return self._marked(func(*args, **kwargs), self.hw(x))
        self._nchw(func, x)
        if func not in (F.dropout, F.dropout2d, torch.dropout) or not 0 < p < 1:
            raise self._refuse(_name(func), "only dropout and dropout2d draw masks exactly")
        inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
        h, w = self.grid.global_size(x, "dropout")
        rows, cols = self.grid.block(h, w)
        whole = (*x.shape[:2], 1, 1) if func is F.dropout2d else (*x.shape[:2], h, w)
        noise = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
        noise = noise if func is F.dropout2d else noise[..., rows, cols]
        return self._marked(x.mul_(noise) if inplace else x * noise)

    def _group_norm(self, x: Tensor, num_groups: int, weight=None, bias=None, eps=1e-5) -> Any:
        """GroupNorm (and InstanceNorm) over blocks, written out in operations that have
        rules here: the means over H and W are all-reduced (whole), and the whole statistics
        meeting the blocks have their gradients summed. smp's FPN decoder needs it."""
        self._nchw(F.group_norm, x)
        n, c = x.shape[:2]
        with self._rules():
            xg = x.reshape(n, num_groups, c // num_groups, *x.shape[2:])
            mean = xg.mean((2, 3, 4), keepdim=True)
            centred = xg - mean
            var = centred.square().mean((2, 3, 4), keepdim=True)
            y = (centred / torch.sqrt(var + eps)).reshape(x.shape)
            if weight is not None:
                y = y * weight.view(1, c, 1, 1)
            if bias is not None:
                y = y + bias.view(1, c, 1, 1)
        return y

    @contextlib.contextmanager
    def _rules(self) -> Any:
        """This guard's rules again, for operations written out inside a rule (the handler
        runs with the mode popped); the hooks and the record stay as they are."""
        TorchFunctionMode.__enter__(self)
        try:
            yield
        finally:
            TorchFunctionMode.__exit__(self, None, None, None)

    def _pool(self, func, args, kwargs) -> Any:
        """Functional max and average pooling: the spatial layers' halo fetch, cached by
        arguments."""
        x = args[0]
        self._nchw(func, x)
        if func is F.max_pool2d:
            names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        else:
            names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                     "divisor_override")  # fmt: skip
        call = {**dict(zip(names, args[1:], strict=False)), **kwargs}
        if call.get("return_indices"):
            raise self._refuse(_name(func), "return_indices has no exact rule")
        if call.pop("ceil_mode", False):  # its last windows' geometry: not covered
            return self._gathered(func, args, kwargs)
        call.pop("return_indices", None)
        key = (func, *sorted((k, str(v)) for k, v in call.items()))
        if key not in self._layers:
            cls = spool.SpatialMaxPool2d if func is F.max_pool2d else spool.SpatialAvgPool2d
            self._layers[key] = cls(**call, comm=self.comm, grid=self.grid)
        layer = self._layers[key]
        return self._marked(layer(x), size=_out_size(layer, self._size_now))

    def _pad(self, args, kwargs) -> Any:
        """``F.pad`` over H and W (and any leading dimensions): the padded images' blocks in
        tensor_split layout, each rank fetching the rows of its new block with ``gather_rows``.
        With a constant (negative pads crop), one fetch per dimension; reflect, replicate and
        circular read mirrored or wrapped rows: the low pad, the image and the high pad are
        three fetches of contiguous rows, each put in order locally.

        Padding must not come from a block's own size: forward code that read a block's H or W
        (``x.shape``, ``x.size()``) and then pads it (padding to a multiple of a patch size,
        a U-Net padding to its skip connection's size) would pad for the block, not for the
        whole image, so that is refused; timm's "same" modules are the exception, whose
        padding the guard computes from the whole size (:meth:`_same_pads`)."""
        names = ("input", "pad", "mode", "value")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        x, pad = call["input"], list(call["pad"])
        mode, value = call.get("mode", "constant"), call.get("value") or 0.0
        self._nchw(F.pad, x)
        if mode not in ("constant", "reflect", "replicate", "circular"):
            raise self._refuse("F.pad", f"mode={mode!r} has no rule")
        h_w = self._size_now or self.grid.global_size(x, "F.pad")
        lo_w, hi_w, lo_h, hi_h = [*pad, 0, 0, 0, 0][:4]
        if self._was_sized(x):  # even with zero pads here: other ranks' may not be
            lo_w, hi_w, lo_h, hi_h = self._same_pads(x, h_w, [lo_w, hi_w, lo_h, hi_h])
        rest = pad[4:]
        if mode != "constant" and (rest or min(pad[:4]) < 0):
            raise self._refuse("F.pad", f"mode={mode!r} with pads {pad} (only H and W, >= 0)")
        y = x
        for dim, (n, lo, hi) in ((2, (h_w[0], lo_h, hi_h)), (3, (h_w[1], lo_w, hi_w))):
            if mode == "constant":
                comm, parts, _ = self.grid.axis(dim - 2)
                new = tensor_split_sizes(n + lo + hi, parts)
                want = [(a - lo, a - lo + m) for a, m in zip(starts(new), new, strict=True)]
                y = pkf.gather_rows(y, comm, dim, tensor_split_sizes(n, parts), want, value)
            elif lo or hi:
                y = self._wrap_pad(y, dim, n, lo, hi, mode)
        if rest:  # leading dimensions: local
            y = F.pad(y, [0, 0, 0, 0, *rest], value=value)
        size = (h_w[0] + lo_h + hi_h, h_w[1] + lo_w + hi_w)
        return self._marked(y, size=size)

    def _wrap_pad(self, x: Tensor, dim: int, n: int, lo: int, hi: int, mode: str) -> Tensor:
        """This rank's block of the whole images padded along ``dim`` by ``lo`` and ``hi``
        rows in a non-constant ``mode``. Every rank takes part in all three fetches (an empty
        range where its block has no such rows), and keeps each in its graph, so that the
        backward's exchanges meet on every rank."""
        if (mode == "reflect" and max(lo, hi) >= n) or max(lo, hi) > n:
            raise ValueError(
                f"spatial parallelism: F.pad mode={mode!r} of {max(lo, hi)} rows needs more "
                f"rows than the image's {n}"
            )
        comm, parts, rank = self.grid.axis(dim - 2)
        new = tensor_split_sizes(n + lo + hi, parts)
        pieces = []
        for part in range(3):  # the low pad, the image, the high pad
            want, mine = [], []
            for r, (a, m) in enumerate(zip(starts(new), new, strict=True)):
                first, stop = ((a, min(a + m, lo)), (max(a, lo), min(a + m, lo + n)),
                               (max(a, lo + n), a + m))[part]  # fmt: skip
                rows = [_source_row(i - lo, n, mode) for i in range(first, stop)]
                want.append((min(rows), max(rows) + 1) if rows else (0, 0))
                mine = rows if r == rank else mine
            got = pkf.gather_rows(x, comm, dim, tensor_split_sizes(n, parts), want)
            if mine != list(range(want[rank][0], want[rank][1])):  # mirrored or repeated
                order = torch.tensor([i - want[rank][0] for i in mine], device=x.device)
                got = got.index_select(dim, order.long())
            pieces.append(got)
        return torch.cat(pieces, dim)

    def _was_sized(self, t: Tensor) -> bool:
        ref = self._sized.get(id(t))
        return ref is not None and ref() is t

    def _note_sized(self, func, args: tuple, kwargs: dict) -> None:
        """Remember the blocks whose H or W forward code read (``x.shape``, ``x.size()``,
        ``x.size(2)``): padding computed from them would be the block's (see :meth:`_pad`)."""
        x = args[0]
        if not self.is_split(x):
            return
        dim = _arg(args, kwargs, 1, "dim") if func is Tensor.size and (
            len(args) > 1 or "dim" in kwargs) else None  # fmt: skip
        if dim is None or dim % x.dim() - x.dim() in self.hw(x):
            self._sized[id(x)] = weakref.ref(x)
            h, w = self.hw(x)
            self._read_sizes.add(((x.shape[h], x.shape[w]), self.size_of(x)))

    def _same_pads(self, x: Tensor, size: Size, pads: list[int]) -> list[int]:
        """The padding of TensorFlow's "same" for the whole images, where ``x`` is the input
        of one of timm's "same" modules (``Conv2dSame``, ``MaxPool2dSame``, ...) whose
        ``pad_same`` just padded it for the block's size; any other padding computed after
        reading a block's size is refused."""
        module = next((e[0] for e in reversed(self._stack) if e is not None), None)
        geometry = _tf_same_geometry(module)
        if geometry is not None:
            block = [_same_pad(n, *g) for n, g in zip(x.shape[-2:], geometry, strict=True)]
            if pads == [*block[1], *block[0]]:
                whole = [_same_pad(n, *g) for n, g in zip(size, geometry, strict=True)]
                return [*whole[1], *whole[0]]
        raise self._refuse(
            "F.pad", "the forward code read this block's height or width before padding it, so "
            "its padding may be computed for the block instead of the whole image (padding to "
            "a multiple of a patch size, to a skip connection's size)",
        )  # fmt: skip

    def _gathered(self, func, args, kwargs) -> Any:
        """An operation the blocks cannot do alone, run on the gathered whole images and cut
        back into blocks: exact, but every rank holds this layer's whole input and output
        for a moment, so it warns once per operation (pooling with ceil_mode=True,
        interpolation with align_corners=True or by a non-integer factor)."""
        x = args[0]
        self._nchw(func, x)
        if func not in self._warned:
            self._warned.add(func)
            warnings.warn(
                f"spatial parallelism: {_name(func)} with these arguments runs on the whole "
                "images, gathered on every rank (exact, but this layer's activations are not "
                "split)",
                stacklevel=2,
            )
        y = func(gather(x, self.comm, self.grid), *args[1:], **kwargs)
        return self._marked(scatter(y, self.comm, self.grid), size=(y.shape[-2], y.shape[-1]))

    def _adaptive_pool(self, func, args, kwargs) -> Any:
        """Global average (max) pooling is a mean (maximum) over H and W; other sizes pool the
        whole images."""
        self._nchw(func, args[0])
        if _all(_arg(args, kwargs, 1, "output_size"), 1):
            if func is F.adaptive_avg_pool2d:
                return self._mean_hw(args[0], keepdim=True)
            if not kwargs.get("return_indices", args[2] if len(args) > 2 else False):
                return self._extreme(args[0], [2, 3], largest=True)
        return self._on_whole_images(func, args, kwargs)

    def _on_whole_images(self, func, args, kwargs) -> Any:
        """Adaptive pooling to a fixed size (VGG's 7x7, PSPNet's pyramid): the blocks are
        gathered into the whole images (one all-gather of this feature map) and pooled; the
        result is whole."""
        x = args[0]
        self._nchw(func, x)
        return func(gather(x, self.comm, self.grid), *args[1:], **kwargs)

    def _whole_to_block(self, args, kwargs) -> Any | None:
        """``F.interpolate`` of a whole tensor to a ``size=`` read from a block's shape
        (DeepLab's and PSPNet's pooled branches, resized to the feature map beside them to be
        concatenated with it): interpolated to the whole images' size, then cut to this
        rank's block. None when the sizes asked are not such blocks on every rank."""
        names = ("input", "size", "scale_factor", "mode", "align_corners")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        x, size = call["input"], call.get("size")
        if size is None or not isinstance(x, Tensor) or x.dim() != 4:
            return None
        whole_size = self._whole_of_read(tuple(int(v) for v in _pair(size)))
        if whole_size is None:
            return None
        whole = F.interpolate(**{**call, "size": whole_size})
        # Cut with scatter, whose backward gives the whole input its gradient in the region's
        # convention (spatial.layout).
        return self._marked(
            scatter(whole, self.comm, self.grid), size=(whole.shape[-2], whole.shape[-1])
        )

    def _whole_of_read(self, asked: Size) -> Size | None:
        """The whole images' (H, W) that a size asked on blocks stands for: that of the blocks
        whose shape the forward code read and found to be ``asked`` (a U-Net's
        ``size=skip.shape[-2:]``). Every rank must find one, and the same; None where no rank
        found any (a size of the code's own); refused otherwise. One host all-gather, so every
        rank decides alike."""
        wholes = {whole for hw, whole in self._read_sizes if hw == asked}
        found = 0 if not wholes else 1 if len(wholes) == 1 and None not in wholes else 2
        table = self.comm.all_gather_ints([found, *(next(iter(wholes)) if found == 1 else (0, 0))])
        if not any(row[0] for row in table):
            return None
        if any(row != table[0] for row in table) or table[0][0] != 1:
            raise self._refuse(
                "F.interpolate", f"the size {asked} asked is not the shape of blocks of one "
                "whole size read beside it on every rank (give scale_factor= instead)",
            )  # fmt: skip
        return table[0][1], table[0][2]

    def _interpolate(self, args, kwargs) -> Any:
        """Upsampling by an integer factor, nearest or bilinear without align_corners: the
        spatial upsampling layer's fetch. Given as ``scale_factor=`` or as a ``size=`` read
        from a block's shape (a U-Net's skip connection's), which stands for that block's
        whole size (:meth:`_whole_of_read`). Other modes, align_corners and other factors run
        on the gathered whole images, to the whole size asked."""
        names = ("input", "size", "scale_factor", "mode", "align_corners")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        x, mode = call["input"], call.get("mode", "nearest")
        self._nchw(F.interpolate, x)
        whole_out = None
        if call.get("size") is not None:
            asked = tuple(int(v) for v in _pair(call["size"]))
            if (whole_out := self._whole_of_read(asked)) is None:
                raise self._refuse(
                    "F.interpolate", f"the size {asked} asked is not the shape of a block read "
                    "beside it: a size the forward code wrote or computed may be the whole "
                    "image's or the block's (give scale_factor= instead)",
                )  # fmt: skip
            h, w = self._size_now or self.grid.global_size(x, "F.interpolate")
            factors = (whole_out[0] / max(h, 1), whole_out[1] / max(w, 1))
        else:
            factors = _pair(call["scale_factor"])
        covered = mode in ("nearest", "bilinear") and not call.get("align_corners")
        integer = len(set(factors)) == 1 and int(factors[0]) == factors[0] and factors[0] >= 1
        if not covered or call.get("antialias") or not integer:
            if whole_out is None:
                return self._gathered(F.interpolate, args, kwargs)
            rest = {k: v for k, v in call.items() if k != "input"}
            return self._gathered(F.interpolate, (x,), {**rest, "size": whole_out})
        key = (int(factors[0]), mode)
        if key not in self._layers:
            self._layers[key] = spool.SpatialUpsample(*key, comm=self.comm, grid=self.grid)
        layer = self._layers[key]
        return self._marked(layer(x), size=_out_size(layer, self._size_now))

    def _property(self, func, args, kwargs) -> Any:
        name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in ("T", "mT", "H", "mH"):
            raise self._refuse(f"Tensor.{name}", "it moves H and W")
        if name == "shape":
            self._note_sized(func, args, kwargs)
        out = func(*args, **kwargs)
        return self._marked(out, self.hw(args[0])) if name == "data" else out

    def _cat(self, func, args, kwargs, blocks: list[Tensor]) -> Any:
        tensors = args[0] if args else kwargs["tensors"]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        hw = self.hw(blocks[0])
        same = all(self.is_split(t) and self.hw(t) == hw for t in tensors)
        ndim = tensors[0].dim() + (func is torch.stack)  # stack adds a dimension
        if (
            same
            and dim % ndim - ndim not in hw
            and (func is not torch.stack or dim % ndim - ndim < min(hw))
        ):
            return self._marked(func(*args, **kwargs), hw)
        raise self._refuse(_name(func), "it joins blocks with whole tensors, or along H or W")

    def _getitem(self, func, args, kwargs) -> Any:
        x, index = args[0], args[1]
        entries = index if isinstance(index, tuple) else (index,)
        simple = all(
            e is None or isinstance(e, int | slice) or (isinstance(e, Tensor) and e.dim() <= 1)
            for e in entries
        )
        reached = sum(e is not None for e in entries)  # the leading dimensions indexed
        hw = self.hw(x)
        if simple and reached <= x.dim() + min(hw):
            return self._marked(func(*args, **kwargs), hw)
        raise self._refuse("indexing", f"the index {index!r} reaches H or W")

    def _conv(self, func, args, kwargs) -> Any:
        """``F.conv2d`` in forward code (a Conv2d subclass, timm's "same" and weight-
        standardized convolutions, ``padding_mode`` other than zeros after its ``F.pad``):
        the spatial convolution's halo fetch or edge path with the call's weight, which is
        whole (a parameter, or computed from one). A 1x1 convolution with stride 1 and no
        padding is pointwise."""
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        x, weight = call["input"], call["weight"]
        if not self.is_split(x) or self.is_split(weight) or self.is_split(call.get("bias")):
            raise self._refuse(_name(func), "its weight is a block of split images")
        self._nchw(func, x)
        stride, padding = call.get("stride", 1), call.get("padding", 0)
        dilation, groups = call.get("dilation", 1), call.get("groups", 1)
        weight, bias = self._summed(weight), self._summed(call.get("bias"))
        if (
            tuple(weight.shape[-2:]) == (1, 1)
            and _all(stride, 1)
            and (padding == "valid" or _all(padding, 0))
        ):
            return self._marked(func(x, weight, bias, 1, 0, dilation, groups))
        if padding == "same" and not _all(stride, 1):  # as torch says it
            raise ValueError("padding='same' is not supported for strided convolutions")
        windows = sp.conv_windows(weight.shape[-2:], stride, padding, dilation)
        size = self._size_now or self.grid.global_size(x, _name(func))
        out = sp.conv2d_blocks(x, weight, bias, windows, groups, self.grid, size)
        return self._marked(out, size=(windows[0].out_size(size[0]), windows[1].out_size(size[1])))

    def _reshape(self, func, args, kwargs) -> Any:
        x, out = args[0], func(*args, **kwargs)
        hw = self.hw(x)
        k = -min(hw)  # the dimensions from H on must come out unchanged
        if isinstance(out, Tensor) and out.dim() >= k and out.shape[-k:] == x.shape[-k:]:
            return self._marked(out, hw)  # only the leading dimensions were regrouped
        raise self._refuse(_name(func), f"{tuple(x.shape)} -> {_shape(out)} merges H or W")

    def _permute(self, func, args, kwargs) -> Any:
        x, out = args[0], func(*args, **kwargs)
        probe = torch.empty((1,) * x.dim(), device="meta").as_strided(
            x.shape, tuple(range(1, x.dim() + 1))
        )  # strides 1..n tell which input dimension lands where
        moved = func(probe, *args[1:], **kwargs).stride()
        h, w = (x.dim() + d + 1 for d in self.hw(x))  # the strides H and W had
        if h in moved and w in moved:
            return self._marked(out, (moved.index(h) - out.dim(), moved.index(w) - out.dim()))
        raise self._refuse(_name(func), "it moves H or W out of the last two dimensions")

    def _split(self, func, args, kwargs) -> Any:
        x = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if func in (Tensor.unbind, torch.unbind):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        hw = self.hw(x)
        if dim % x.dim() - x.dim() < min(hw):  # before H and W: they keep their places
            return self._marked(func(*args, **kwargs), hw)
        raise self._refuse(_name(func), "it cuts along H or W")

    def _reduce(self, func, args, kwargs) -> Any:
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        name = getattr(func, "__name__", "")
        if name in ("max", "min") and (isinstance(dim, Tensor) or "other" in kwargs):
            return self._pointwise(func, args, kwargs, self._blocks_in(args, kwargs))
        dims = (
            {d % x.dim() for d in (dim if isinstance(dim, tuple | list) else (dim,))}
            if dim is not None
            else set(range(x.dim()))
        )
        hw = {x.dim() + d for d in self.hw(x)}
        if dim is not None and not dims & hw:  # over channels or the batch: local
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if getattr(func, "__name__", "") in ("softmax", "log_softmax"):
                keepdim = True  # these keep every dimension
            # Dimensions dropped after H (channels-last) move H and W towards the end.
            shift = 0 if keepdim else sum(d > min(hw) for d in dims)
            out = func(*args, **kwargs)
            return self._marked(out, tuple(d + shift for d in self.hw(x)))  # type: ignore[arg-type]
        nchw = self.hw(x) == (-2, -1)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if name in ("sum", "mean") and nchw and hw <= dims and not self._extra(args, kwargs, 2):
            other = sorted(dims - hw)
            y = self._mean_hw(x, keepdim=True) if name == "mean" else self._sum_hw(x)
            if other:
                y = getattr(y, name)(other, keepdim=True)
            return y if keepdim else y.squeeze(sorted(dims))
        if name in ("var", "std") and nchw and hw <= dims:
            return self._variance(x, sorted(dims), name == "std", args, kwargs)
        extreme = name in ("amax", "amin") or (name in ("max", "min") and dim is None)
        if extreme and nchw and hw <= dims and not self._extra(args, kwargs, 2):
            y = self._extreme(x, sorted(dims), largest=name.endswith("max"))
            return y if keepdim else y.squeeze(sorted(dims))
        raise self._refuse(
            _name(func), "it reduces over H or W (only sum, mean, var, std, amax and amin over "
            "both are exact here)",
        )  # fmt: skip

    def _extreme(self, x: Tensor, dims: list[int], largest: bool) -> Tensor:
        """The whole images' maximum (minimum) over ``dims`` (H, W and maybe more), kept as
        size-1 dimensions, the same on every rank. Its value is the all-reduced extreme; its
        gradient goes, as torch's does, in equal parts to every place that holds it, on
        whichever rank: the sum of those places over their all-reduced count, which has that
        gradient and the same value, is added as a zero."""
        op = "max" if largest else "min"
        with torch.no_grad():
            if x.numel():
                local = x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True)
            else:  # an empty block holds no extreme
                shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
                local = x.new_full(shape, -math.inf if largest else math.inf)
            whole = self.comm.all_reduce(local.contiguous(), op)
        if not x.is_floating_point():  # no gradient to route
            return whole
        at = x == whole
        total = layout.summed(
            torch.cat([torch.where(at, x, 0).sum(dims).flatten(), at.sum(dims).flatten().to(x)]),
            self.comm,
        )
        half = total.numel() // 2
        spread = (total[:half] / total[half:]).view(whole.shape)
        return whole + (spread - spread.detach())

    def _variance(self, x: Tensor, dims: list[int], std: bool, args, kwargs) -> Tensor:
        """``var``/``std`` over H, W (and maybe more) of the whole images, written out as
        means with rules here (AdaIN-style normalization in forward code); whole."""
        unbiased = kwargs.get("unbiased", args[2] if len(args) > 2 else True)
        correction = kwargs.get("correction", 1 if unbiased else 0)
        keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
        h, w = self._size_now or self.grid.global_size(x, "var")
        n = h * w * math.prod(x.shape[d] for d in dims if d < x.dim() - 2)
        with self._rules():
            mean = x.mean(dims, keepdim=True)
            var = (x - mean).square().mean(dims, keepdim=True)
        var = var * (n / (n - correction) if n != correction else math.inf)
        y = var.sqrt() if std else var
        return y if keepdim else y.squeeze(dims)

    def _extra(self, args: tuple, kwargs: dict, named: int) -> bool:
        """Arguments beyond (input, dim, keepdim): dtype=, out=, ..."""
        return len(args) > named + 1 or bool(set(kwargs) - {"dim", "keepdim"})

    def _sum_hw(self, x: Tensor) -> Tensor:
        """The whole images' sums over H and W (N, C, 1, 1), the same on every rank
        (``layout.summed``: its backward follows the region's gradient convention)."""
        return layout.summed(x.sum((-2, -1), keepdim=True), self.comm)

    def _mean_hw(self, x: Tensor, keepdim: bool) -> Tensor:
        count = x.new_full((1,) * x.dim(), float(x.shape[-2] * x.shape[-1]))
        total = layout.summed(
            torch.cat([x.sum((-2, -1), keepdim=True).flatten(), count.flatten()]), self.comm
        )
        mean = (total[:-1] / total[-1]).view(*x.shape[:-2], 1, 1)
        return mean if keepdim else mean.squeeze((-2, -1))

    def _refuse(self, op: str, why: str, module: nn.Module | None = None) -> ValueError:
        if module is None:
            module = next((e[0] for e in reversed(self._stack) if e is not None), None)
        path = self.names.get(module, "") if module is not None else ""
        where = f"in {path!r} ({type(module).__name__})" if path else "in the model's forward"
        way_out = (
            f"pass keep_dense=[{path!r}] to run that module on whole images"
            if path
            else "pass keep_dense=[...] naming the module that does it"
        )
        return ValueError(
            f"spatial parallelism: {op} {where} touches a block of split images, and {why}; "
            f"{way_out}, or use the data or channel strategy"
        )


def _out_size(layer: nn.Module, size: Size | None) -> Size | None:
    """A layer's output size for inputs of ``size``: its geometry, or the same size."""
    if size is None:
        return None
    return layer.out_size(size) if hasattr(layer, "out_size") else size


def _name(func: Callable) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if "<locals>" in name:  # F.max_pool2d and the like are made by boolean_dispatch
        name = getattr(func, "__name__", name)
    module = getattr(func, "__module__", None) or ""
    name = name.replace("_TensorBase.", "Tensor.").replace("TensorBase.", "Tensor.")
    name = name.replace("_VariableFunctionsClass.", "torch.")
    return f"{'F.' if module.endswith('functional') else ''}{name}"


def _pair(value: Any) -> tuple:
    return tuple(value) if isinstance(value, tuple | list) else (value, value)


def _comms(module: nn.Module) -> tuple[Any, Any]:
    if isinstance(module, SyncBatchNorm):
        return module.comm, module.grad_comm
    return module._pk_comm, module._pk_grad_comm


def _set_comms(module: nn.Module, comm: Any, grad_comm: Any) -> None:
    if isinstance(module, SyncBatchNorm):
        module.comm, module.grad_comm = comm, grad_comm
    else:
        module._pk_comm, module._pk_grad_comm = comm, grad_comm


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _all(value: Any, want: int) -> bool:
    return all(v == want for v in (value if isinstance(value, tuple | list) else (value,)))


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _source_row(i: int, n: int, mode: str) -> int:
    """The image row that padded row ``i`` (of ``n`` rows, counted from the first image row)
    repeats in F.pad's ``mode``."""
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i if i >= n else i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


def _same_pad(n: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's "same" padding of ``n`` rows (timm's ``pad_same``): (before, after)."""
    total = max((math.ceil(n / stride) - 1) * stride + (kernel - 1) * dilation + 1 - n, 0)
    return total // 2, total - total // 2


_TF_SAME = ("Conv2dSame", "StdConv2dSame", "ScaledStdConv2dSame", "MaxPool2dSame", "AvgPool2dSame")


def _tf_same_geometry(module: nn.Module | None) -> list[tuple[int, int, int]] | None:
    """(kernel, stride, dilation) along H and W of one of timm's "same" modules, whose
    forward pads its input with ``pad_same`` for the input's size, else None."""
    kind = type(module)
    if module is None or kind.__name__ not in _TF_SAME or not kind.__module__.startswith("timm"):
        return None
    weight = getattr(module, "weight", None)
    kernel = tuple(weight.shape[-2:]) if isinstance(weight, Tensor) else module.kernel_size
    return list(zip(_pair(kernel), _pair(module.stride),
                    _pair(getattr(module, "dilation", 1)), strict=True))  # fmt: skip
