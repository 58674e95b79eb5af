"""What one model library's modules need from the spatial rules, kept apart from the rules.

timm's "same" modules (``Conv2dSame``, ``MaxPool2dSame``, ``AvgPool2dSame``, ...) pad their
input in forward with ``pad_same``, computed from the input's own height and width: on a block
that is the block's padding, not the whole image's. :func:`same_pads` recognizes that padding
and gives TensorFlow's "same" padding of the whole images in its place.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from parallelkit.spatial.rules.registry import pair

_TF_SAME = ("Conv2dSame", "StdConv2dSame", "ScaledStdConv2dSame", "MaxPool2dSame", "AvgPool2dSame")


def tf_same_pad(n: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's "same" padding of ``n`` rows (timm's ``pad_same``): (before, after)."""
    total = max((math.ceil(n / stride) - 1) * stride + (kernel - 1) * dilation + 1 - n, 0)
    return total // 2, total - total // 2


def tf_same_geometry(module: nn.Module | None) -> list[tuple[int, int, int]] | None:
    """(kernel, stride, dilation) along H and W of one of timm's "same" modules, whose
    forward pads its input with ``pad_same`` for the input's size, else None."""
    kind = type(module)
    if module is None or kind.__name__ not in _TF_SAME or not kind.__module__.startswith("timm"):
        return None
    weight = getattr(module, "weight", None)
    kernel = tuple(weight.shape[-2:]) if isinstance(weight, Tensor) else module.kernel_size
    dilation = getattr(module, "dilation", 1)
    return list(zip(pair(kernel), pair(module.stride), pair(dilation), strict=True))


def same_pads(
    module: nn.Module | None, block: tuple[int, int], whole: tuple[int, int], pads: list[int]
) -> list[int] | None:
    """F.pad's (left, right, top, bottom) for the whole images where ``pads`` is ``pad_same``'s
    padding of a ``block`` (h, w) inside one of timm's "same" modules; None otherwise."""
    geometry = tf_same_geometry(module)
    if geometry is None:
        return None
    mine = [tf_same_pad(n, *g) for n, g in zip(block, geometry, strict=True)]
    if pads != [*mine[1], *mine[0]]:
        return None
    new = [tf_same_pad(n, *g) for n, g in zip(whole, geometry, strict=True)]
    return [*new[1], *new[0]]
