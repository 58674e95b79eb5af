"""U-Net (Ronneberger et al., 2015) written against plain torch.nn, with no parallelism in it.

Why it is here: segmentation with ``parallelkit train train.task=segment`` should work with
what installs with the package, without segmentation_models_pytorch. It is the built-in model
of that task (``models.create("unet", num_classes=4)``).

Layout: an encoder of stages (two 3x3 conv-norm-act each), every later stage after a 2x2 max
pool; a decoder that upsamples by a 2x2 stride-2 transposed convolution, concatenates the
encoder's features of that size (the skip connection) and applies two 3x3 conv-norm-act; a
1x1 convolution to the class logits. Padding keeps sizes, so the logits have the input's
height and width; each side must divide by ``2 ** (len(widths) - 1)``.

Layer types are arguments, as in :mod:`parallelkit.models.resnet`; ``pk.parallelize`` swaps
every layer here for its spatial or channel-parallel version (conv, max pool, transposed conv,
BatchNorm), and the concatenation along channels is exact on blocks.

    N C H W    -> stage 0 (widths[0], H) -> pool -> stage 1 (widths[1], H/2) -> ...
    logits     N num_classes H W
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.models.registry import register
from parallelkit.models.resnet import Layer


class DoubleConv(nn.Sequential):
    """Two 3x3 convolutions, each followed by a norm and an activation."""

    def __init__(
        self, in_channels: int, channels: int, norm_layer: Layer, act_layer: Layer
    ) -> None:
        super().__init__(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            act_layer(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            act_layer(),
        )


class UNet(nn.Module):
    """Encoder stages of ``widths``, a mirrored decoder, 1x1 logits; see the module doc."""

    def __init__(
        self,
        num_classes: int = 2,
        in_channels: int = 3,
        widths: Sequence[int] = (16, 32, 64, 128),
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
    ) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError(f"UNet: widths={tuple(widths)} needs at least two stages")
        self.down = nn.ModuleList()
        previous = in_channels
        for i, width in enumerate(widths):
            pool = [nn.MaxPool2d(2)] if i else []
            self.down.append(
                nn.Sequential(*pool, DoubleConv(previous, width, norm_layer, act_layer))
            )
            previous = width
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for width in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(previous, width, 2, stride=2))
            self.merge.append(DoubleConv(2 * width, width, norm_layer, act_layer))
            previous = width
        self.head = nn.Conv2d(previous, num_classes, 1)
        self.factor = 2 ** (len(widths) - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
        skips.pop()  # the deepest stage feeds the decoder directly
        for up, merge in zip(self.up, self.merge, strict=True):
            x = merge(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


@register("unet")
def unet(
    num_classes: int = 2,
    in_channels: int = 3,
    widths: Sequence[int] = (16, 32, 64, 128),
    norm_layer: Layer = nn.BatchNorm2d,
    act_layer: Layer = nn.ReLU,
) -> UNet:
    """A U-Net with 4 stages (3 poolings): inputs divisible by 8."""
    return UNet(num_classes, in_channels, widths, norm_layer, act_layer)
