"""ResNet (He et al., 2016) written against plain torch.nn, with no parallelism in it.

Layer types are arguments (``norm_layer=``, ``act_layer=``, ``conv_layer=``), as in timm, so a
synchronized or otherwise custom layer drops in; ``pk.parallelize`` swaps layers in an
unchanged model (it replaces layers whose type is exactly ``nn.Conv2d``, which is why that is
the default and why a custom ``conv_layer`` is left as it is).

Layout, as torchvision's: a stem, stages of residual blocks (the first stage at stride 1, each
later one halving the size in its first block, with a strided 1x1 projection on the shortcut
wherever the shape changes), global average pool, linear classifier.

==========  ===========================================================================
stem        ``"imagenet"``: 7x7 stride-2 convolution and 3x3 stride-2 max pool (224x224
            inputs, /32 overall); ``"cifar"``: one 3x3 stride-1 convolution, no pool (32x32
            inputs, /8 overall)
BasicBlock  3x3 -> 3x3, ``expansion = 1`` (ResNet-18/34)
Bottleneck  1x1 -> 3x3 -> 1x1, ``expansion = 4``, the stride on the 3x3 ("v1.5", as
            torchvision and timm; the original paper strides the first 1x1)
==========  ===========================================================================

``widths`` are the blocks' inner widths; a stage outputs ``width * block.expansion`` channels.
Module names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv1``, ``downsample.0``,
``fc``), and with the ImageNet stem and 1000 classes the parameter counts are torchvision's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from parallelkit.models.registry import register

Layer = Callable[..., nn.Module]
"""A layer type: a class or factory called like the torch layer it replaces."""


def _shortcut(
    in_channels: int, out_channels: int, stride: int, norm_layer: Layer, conv_layer: Layer
) -> nn.Module | None:
    """The 1x1 projection (conv + norm) a block's shortcut needs when the shape changes."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        conv_layer(in_channels, out_channels, 1, stride, bias=False), norm_layer(out_channels)
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection; a 1x1 projection when the shape changes.

    ``channels`` is the output width (``expansion = 1``); ``stride`` is on the first conv.
    """

    expansion = 1

    def __init__(
        self,
        in_channels: int,
        channels: int,
        stride: int = 1,
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
        conv_layer: Layer = nn.Conv2d,
    ) -> None:
        super().__init__()
        self.conv1 = conv_layer(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(channels)
        self.act1 = act_layer()
        self.conv2 = conv_layer(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(channels)
        self.act2 = act_layer()
        self.downsample = _shortcut(in_channels, channels, stride, norm_layer, conv_layer)

    def zero_init_last(self) -> None:
        """Zero the last norm's scale, so the block starts as the identity (Goyal et al.)."""
        if getattr(self.bn2, "weight", None) is not None:
            nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act2(y + shortcut)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 -> 1x1 expand by 4, and a residual connection (ResNet-50 and deeper).

    ``channels`` is the inner width; the block outputs ``4 * channels``. The stride sits on the
    3x3 convolution ("v1.5"): a strided 1x1 would skip three quarters of its input pixels.
    """

    expansion = 4

    def __init__(
        self,
        in_channels: int,
        channels: int,
        stride: int = 1,
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
        conv_layer: Layer = nn.Conv2d,
    ) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = conv_layer(in_channels, channels, 1, bias=False)
        self.bn1 = norm_layer(channels)
        self.act1 = act_layer()
        self.conv2 = conv_layer(channels, channels, 3, stride, 1, bias=False)
        self.bn2 = norm_layer(channels)
        self.act2 = act_layer()
        self.conv3 = conv_layer(channels, out_channels, 1, bias=False)
        self.bn3 = norm_layer(out_channels)
        self.act3 = act_layer()
        self.downsample = _shortcut(in_channels, out_channels, stride, norm_layer, conv_layer)

    def zero_init_last(self) -> None:
        """Zero the last norm's scale, so the block starts as the identity (Goyal et al.)."""
        if getattr(self.bn3, "weight", None) is not None:
            nn.init.zeros_(self.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.act1(self.bn1(self.conv1(x)))  # (N, width, H, W)
        y = self.act2(self.bn2(self.conv2(y)))  # (N, width, H/s, W/s)
        y = self.bn3(self.conv3(y))  # (N, 4 width, H/s, W/s)
        return self.act3(y + shortcut)


class ResNet(nn.Module):
    """A ResNet: ``depths[i]`` blocks of type ``block`` in stage i, of inner width ``widths[i]``.

    depths, widths: one entry per stage (any number of stages; torchvision's have four).
    num_classes, in_channels: classifier outputs and image channels.
    stem: "imagenet" or "cifar" (see the module docstring).
    norm_layer, act_layer, conv_layer: layer types, called as ``norm_layer(channels)``,
        ``act_layer()`` and like ``nn.Conv2d(in, out, kernel, stride, padding, bias=False)``.
    block: the residual block class: ``BasicBlock``, ``Bottleneck``, or one built the same way
        (constructor ``(in_channels, channels, stride, norm_layer=, act_layer=, conv_layer=)``,
        class attribute ``expansion``, optionally ``zero_init_last()``).
    zero_init_residual: start every block as the identity by zeroing its last norm's scale,
        which helps large-batch training (off by default, like torchvision).
    """

    def __init__(
        self,
        depths: Sequence[int] = (2, 2, 2, 2),
        widths: Sequence[int] = (64, 128, 256, 512),
        num_classes: int = 1000,
        in_channels: int = 3,
        stem: str = "imagenet",
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
        *,
        block: type[nn.Module] = BasicBlock,
        conv_layer: Layer = nn.Conv2d,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        _check_args(depths, widths, num_classes, in_channels, stem, block)
        w0 = widths[0]
        if stem == "imagenet":
            self.conv1 = conv_layer(in_channels, w0, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = conv_layer(in_channels, w0, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = norm_layer(w0)
        self.act1 = act_layer()
        self.stage_names: tuple[str, ...] = tuple(f"layer{i + 1}" for i in range(len(depths)))
        layers = dict(norm_layer=norm_layer, act_layer=act_layer, conv_layer=conv_layer)
        c = w0
        for i, (depth, width) in enumerate(zip(depths, widths, strict=True)):
            blocks = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(c, width, stride, **layers))
                c = width * block.expansion
            self.add_module(self.stage_names[i], nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if hasattr(m, "zero_init_last"):
                    m.zero_init_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W) -> logits (N, K)
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        # By name, not a cached list: parallelize(keep_dense=["layer4"]) may replace a stage.
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _check_args(
    depths: Sequence[int],
    widths: Sequence[int],
    num_classes: int,
    in_channels: int,
    stem: str,
    block: type[nn.Module],
) -> None:
    if stem not in ("imagenet", "cifar"):
        raise ValueError(f"ResNet: stem must be 'imagenet' or 'cifar', got {stem!r}")
    if len(depths) == 0 or len(depths) != len(widths):
        raise ValueError(
            f"ResNet: depths and widths need one entry per stage, got depths={tuple(depths)} "
            f"and widths={tuple(widths)}"
        )
    for what, values in (("depths", depths), ("widths", widths)):
        if not all(_is_positive_int(v) for v in values):
            raise ValueError(f"ResNet: {what} must be positive integers, got {tuple(values)}")
    for what, value in (("num_classes", num_classes), ("in_channels", in_channels)):
        if not _is_positive_int(value):
            raise ValueError(f"ResNet: {what} must be a positive integer, got {value!r}")
    expansion = getattr(block, "expansion", None)
    if not isinstance(expansion, int) or expansion < 1:
        raise ValueError(
            f"ResNet: block {getattr(block, '__name__', block)!r} needs an integer class "
            f"attribute 'expansion' >= 1 (output channels = width * expansion), got {expansion!r}"
        )


def _is_positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@register("resnet18")
def resnet18(**kwargs: Any) -> ResNet:
    """ResNet-18: 2-2-2-2 basic blocks, widths 64-512 (override with ``widths=``).

    Keyword arguments go to :class:`ResNet` (``num_classes``, ``stem``, ``norm_layer``, ...).
    """
    return ResNet((2, 2, 2, 2), **kwargs)


@register("resnet34")
def resnet34(**kwargs: Any) -> ResNet:
    """ResNet-34: 3-4-6-3 basic blocks, widths 64-512; 21.8 M parameters at 1000 classes."""
    return ResNet((3, 4, 6, 3), **kwargs)


@register("resnet50")
def resnet50(**kwargs: Any) -> ResNet:
    """ResNet-50 (v1.5): 3-4-6-3 bottleneck blocks, inner widths 64-512, outputs 256-2048;
    25.6 M parameters at 1000 classes."""
    return ResNet((3, 4, 6, 3), block=Bottleneck, **kwargs)
