"""U-Net (Ronneberger et al., 2015) written against plain torch.nn, with no parallelism in it;
1-, 2- or 3-D (Cicek et al., 2016) by ``spatial_dims``.

Why it is here: segmentation with ``parallelkit train train.task=segment`` should work with
what installs with the package, without segmentation_models_pytorch or MONAI. It is the
built-in model of that task (``models.create("unet", num_classes=4)``); on volumes
``model.kwargs={spatial_dims: 3}`` makes it 3-D (``spatial_dims`` as in MONAI's networks), and
the benchmarks build their 3-D U-Net here too.

Layout: an encoder of stages (two 3x3 conv-norm-act each), every later stage after a 2x2 max
pool; a decoder that upsamples by a 2x2 stride-2 transposed convolution, concatenates the
encoder's features of that size (the skip connection) and applies two 3x3 conv-norm-act; a
1x1 convolution to the class logits. Kernels are that size along every spatial dimension
(3x3x3 on volumes). Padding keeps sizes, so the logits have the input's spatial size; each
side must divide by ``2 ** (len(widths) - 1)``.

Layer types are arguments, as in :mod:`parallelkit.models.resnet` (the norm defaults to the
BatchNorm of ``spatial_dims``); ``pk.parallelize`` swaps every layer here for its spatial or
channel-parallel version (conv, max pool, transposed conv, BatchNorm), and the concatenation
along channels is exact on blocks.

    N C *S     -> stage 0 (widths[0], S) -> pool -> stage 1 (widths[1], S/2) -> ...
    logits     N num_classes *S          (S: L, or H W, or D H W)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallelkit.models.registry import register
from parallelkit.models.resnet import Layer

# The layers of each number of spatial dimensions: (N, C, L), (N, C, H, W), (N, C, D, H, W).
CONVS: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
UPS: dict[int, type[nn.Module]] = {
    1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d,
}  # fmt: skip
POOLS: dict[int, type[nn.Module]] = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
NORMS: dict[int, type[nn.Module]] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _check_dims(spatial_dims: int) -> None:
    if spatial_dims not in CONVS:
        raise ValueError(f"UNet: spatial_dims={spatial_dims!r}; a U-Net here is 1-, 2- or 3-D")


class DoubleConv(nn.Sequential):
    """Two 3x3 convolutions (3, 3x3x3 by ``spatial_dims``), each followed by a norm and an
    activation."""

    def __init__(
        self,
        in_channels: int,
        channels: int,
        norm_layer: Layer,
        act_layer: Layer,
        spatial_dims: int = 2,
    ) -> None:
        _check_dims(spatial_dims)
        conv = CONVS[spatial_dims]
        super().__init__(
            conv(in_channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            act_layer(),
            conv(channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            act_layer(),
        )


class UNet(nn.Module):
    """Encoder stages of ``widths``, a mirrored decoder, 1x1 logits; see the module doc.

    ``spatial_dims`` (1, 2 or 3) picks the convolutions, poolings and transposed convolutions
    of signals, images or volumes; ``norm_layer`` defaults to the BatchNorm of as many.
    """

    def __init__(
        self,
        num_classes: int = 2,
        in_channels: int = 3,
        widths: Sequence[int] = (16, 32, 64, 128),
        norm_layer: Layer | None = None,
        act_layer: Layer = nn.ReLU,
        spatial_dims: int = 2,
    ) -> None:
        super().__init__()
        _check_dims(spatial_dims)
        if len(widths) < 2:
            raise ValueError(f"UNet: widths={tuple(widths)} needs at least two stages")
        norm = NORMS[spatial_dims] if norm_layer is None else norm_layer
        conv, up, pool = CONVS[spatial_dims], UPS[spatial_dims], POOLS[spatial_dims]
        self.down = nn.ModuleList()
        previous = in_channels
        for i, width in enumerate(widths):
            first = [pool(2)] if i else []
            self.down.append(
                nn.Sequential(*first, DoubleConv(previous, width, norm, act_layer, spatial_dims))
            )
            previous = width
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for width in reversed(widths[:-1]):
            self.up.append(up(previous, width, 2, stride=2))
            self.merge.append(DoubleConv(2 * width, width, norm, act_layer, spatial_dims))
            previous = width
        self.head = conv(previous, num_classes, 1)
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
    norm_layer: Layer | None = None,
    act_layer: Layer = nn.ReLU,
    spatial_dims: int = 2,
) -> UNet:
    """A U-Net with 4 stages (3 poolings): inputs divisible by 8; 2-D unless ``spatial_dims``
    says 1 or 3."""
    return UNet(num_classes, in_channels, widths, norm_layer, act_layer, spatial_dims)
