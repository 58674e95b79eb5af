"""ResNet (He et al., 2016) written against plain torch.nn, with no parallelism in it.

Layer types are arguments (``norm_layer=``, ``act_layer=``), as in timm, so a synchronized or
parallel layer drops in; ``pk.parallelize`` swaps layers in an unchanged model. ``resnet18()``
is the ImageNet layout: 7x7 stride-2 stem, 3x3 stride-2 max pool, four stages of basic blocks
(stride-2 downsampling with a 1x1 projection), global average pool, linear classifier.
``stem="cifar"`` uses a 3x3 stride-1 stem without pooling, for 32x32 inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

Layer = Callable[..., nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection; a 1x1 projection when the shape changes."""

    def __init__(
        self,
        in_channels: int,
        channels: int,
        stride: int = 1,
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(channels)
        self.act1 = act_layer()
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(channels)
        self.act2 = act_layer()
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), norm_layer(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act2(y + shortcut)


class ResNet(nn.Module):
    """A ResNet of basic blocks: ``depths`` blocks per stage, ``widths`` channels per stage."""

    def __init__(
        self,
        depths: Sequence[int] = (2, 2, 2, 2),
        widths: Sequence[int] = (64, 128, 256, 512),
        num_classes: int = 1000,
        in_channels: int = 3,
        stem: str = "imagenet",
        norm_layer: Layer = nn.BatchNorm2d,
        act_layer: Layer = nn.ReLU,
    ) -> None:
        super().__init__()
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"ResNet: stem must be 'imagenet' or 'cifar', got {stem!r}")
        w0 = widths[0]
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, w0, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, w0, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = norm_layer(w0)
        self.act1 = act_layer()
        stages, c = [], w0
        for i, (depth, width) in enumerate(zip(depths, widths, strict=True)):
            blocks = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(BasicBlock(c, width, stride, norm_layer, act_layer))
                c = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W) -> logits (N, K)
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(**kwargs) -> ResNet:
    """ResNet-18: two basic blocks per stage, widths 64-512 (override with ``widths=``)."""
    return ResNet((2, 2, 2, 2), **kwargs)
