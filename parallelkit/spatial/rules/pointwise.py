"""Pointwise rules: operations that read each pixel alone run on the block as they are.

A whole tensor may meet a block here (an SE gate, a layer scale, a parameter used directly) if
it is constant over the spatial dimensions (size 1 there), or of the whole samples' size there
(it is then cut to the block); its gradient is then each rank's share of the dense one, summed
where it meets the blocks (``record.replicated``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

from parallelkit.spatial.rules.forms import cut_whole, to_form
from parallelkit.spatial.rules.registry import (
    Call,
    Guard,
    channels_first,
    ops,
    rule,
    standard,
    whole_shape,
)

_POINTWISE = """
abs absolute acos add addcdiv addcmul asin atan atan2 ceil clamp clamp_max clamp_min clip cos
cosh div divide elu erf erfc exp exp2 expm1 floor floor_divide fmod frac gelu hardshrink
hardsigmoid hardswish hardtanh leaky_relu lerp log log10 log1p log2 logical_and logical_not
logical_or logit masked_fill maximum minimum mish mul multiply nan_to_num neg negative pow
reciprocal relu relu6 remainder round rrelu rsqrt selu sigmoid sign silu sin sinh
softplus softshrink sqrt square sub subtract tan tanh tanhshrink threshold true_divide trunc
where xlogy eq ne lt le gt ge celu logsigmoid isnan isinf isfinite signbit sgn
"""
_DUNDERS = """
add radd iadd sub rsub isub mul rmul imul truediv rtruediv itruediv div rdiv idiv pow rpow
ipow neg pos abs floordiv rfloordiv mod and or xor invert eq ne lt le gt ge
"""
_LOCAL = """
contiguous clone detach detach_ float double half bfloat16 long int bool to type type_as
requires_grad_ cpu cuda retain_grad zero_ fill_ copy_ __deepcopy__
"""


@rule(
    *ops(_POINTWISE, torch, Tensor, F, torch.special, inplace=True),
    *ops(" ".join(f"__{n}__" for n in _DUNDERS.split()), Tensor),
    prefix=True,
)
def pointwise(g: Guard, call: Call) -> Any:
    """Local. Blocks of another layout than the first (N, C, *spatial) one are moved to it
    first, an all-to-all (``forms.to_form``: MAnet adds a map that a reshape scrambled to the
    map it came from); a whole tensor must have size 1 or the whole
    samples' size in each spatial dimension, and is then cut to the block."""
    first = call.blocks[0]
    if len(call.blocks) > 1:
        form = g.form(first)
        if any(g.form(b) != form for b in call.blocks):
            call = _one_layout(g, call)
            first = call.blocks[0]
            return g.marked(_run(g, call), g.places(first), g.size_of(first), g.folds(first))
        shape, dims = first.shape, g.places(first)
        if any(b.shape != shape for b in call.blocks) and len(
            sizes := {tuple(b.shape[d] for d in dims) for b in call.blocks}
        ) > 1:  # one shape (the common case) cannot differ in the spatial sizes
            raise g.refuse(call.name, f"its blocks have different sizes {sorted(sizes)}")
    return g.marked(_run(g, call), g.places(first))


def _run(g: Guard, call: Call) -> Any:
    """The call on blocks of one layout, whole tensors among its arguments cut to them."""
    if call.bare:  # the common case (x * y, relu(x)): nothing to cut
        return call.run()

    def replicate(t: Any) -> Any:
        if not isinstance(t, Tensor) or g.is_split(t):
            return t
        return cut_whole(g, t, call.blocks[0], call.name)

    args, kwargs = tree_map(replicate, (call.args, call.kwargs))
    return call.func(*args, **kwargs)


def _one_layout(g: Guard, call: Call) -> Call:
    """``call`` with every block in the layout of its first (N, C, *spatial) block (else its
    first): the others moved there (``forms.to_form``); refused where their whole shapes
    differ."""
    name = getattr(call.func, "__name__", "")
    in_place = name.endswith("_") or (name.startswith("__i") and name != "__invert__")
    if in_place:  # the layout of the block it writes
        like = call.args[0]
        if not g.is_split(like):
            raise g.refuse(call.name, "it writes into a whole tensor from blocks")
    else:
        like = next((b for b in call.blocks if not g.folds(b) and g.places(b) == standard(b)),
                    call.blocks[0])  # fmt: skip
    moved = {}
    for b in call.blocks:
        if g.form(b) != g.form(like):
            y = to_form(g, b, like)
            if y is None:
                raise g.refuse(call.name, "its blocks have different layouts and shapes "
                               f"{sorted({tuple(whole_shape(g, b)) for b in call.blocks})}")
            moved[id(b)] = y

    def swap(t: Any) -> Any:
        return moved.get(id(t), t) if isinstance(t, Tensor) else t

    args, kwargs = tree_map(swap, (call.args, call.kwargs))
    blocks = [like, *(swap(b) for b in call.blocks if b is not like)]
    return Call(call.func, args, kwargs, blocks, call.named)


@rule(*ops(_LOCAL, Tensor), torch.as_tensor, prefix=True)
def local(g: Guard, call: Call) -> Any:
    """Local: type, device and memory-format changes, copies, detaching; `torch.as_tensor`
    of a block (MONAI's HighResBlock wraps its branches in it). A whole tensor given a
    block's dtype and device (``grid.to(x)``, ``pos.type_as(x)``: MONAI's reference grids)
    stays whole; a block copied into a whole tensor is refused."""
    x = call.args[0]
    if not g.is_split(x):
        if call.func is Tensor.copy_:
            raise g.refuse(call.name, "it writes a block into a whole tensor")
        return call.run()
    return g.marked(call.run(), g.places(x))


@rule(F.prelu, torch.prelu, params="input, weight")
def prelu(g: Guard, call: Call) -> Tensor:
    """Local; the weight broadcasts over channels, its gradient summed."""
    channels_first(g, call, call["input"])
    return g.marked(call.func(call["input"], g.summed(call["weight"])))


def _size(args: tuple) -> tuple[int, ...] | None:
    """The size a factory was asked for (``zeros(2, 3)`` or ``zeros((2, 3))``), if plain ints."""
    size = args[0] if len(args) == 1 and isinstance(args[0], tuple | list) else args
    return tuple(size) if all(isinstance(n, int) for n in size) else None


@rule(*ops("zeros_like ones_like full_like empty_like", torch), prefix=True)
def constant_like(g: Guard, call: Call) -> Tensor:
    """Local: a constant block of the block's shape."""
    return g.marked(call.run(), g.places(call.blocks[0]))


@rule(*ops("new_zeros new_ones new_full new_empty", Tensor), prefix=True)
def new_constant(g: Guard, call: Call) -> Tensor:
    """Asked for the whole shape of the block it is called on (``x.new_zeros(x.shape)``):
    this rank's block of that constant; any other size: a whole tensor, as asked."""
    x, full = call.args[0], call.func is Tensor.new_full
    size = _size(call.args[1:2] if full else call.args[1:])
    if size is None or torch.Size(size) != whole_shape(g, x):
        return call.run()
    rest = call.args[2:] if full else ()
    return g.marked(call.func(x, x.shape, *rest, **call.kwargs), g.places(x))


@rule(*ops("zeros ones full empty", torch), whole=True)
def constant(g: Guard, call: Call) -> Tensor:
    """Asked for (N, C, *the whole size of a block whose shape the forward code read), as
    ``torch.zeros(n, c, *x.shape[2:])``: this rank's block of that constant (the same values
    wherever they are); any other size: a whole tensor, as asked."""
    full = call.func is torch.full
    size = _size(call.args[:1] if full else call.args)
    if size is None or len(size) < 3 or tuple(size[2:]) not in g.read_sizes:
        return call.run()
    block = tuple(s.stop - s.start for s in g.grid.block(*size[2:]))
    rest = call.args[1:] if full else ()
    return g.marked(call.func((*size[:2], *block), *rest, **call.kwargs), size=size[2:])
