"""DCGAN (Radford et al., 2016) generator and discriminator, plain torch.nn, no parallelism.

The generator maps noise (N, nz, 1, 1) to images (N, nc, S, S) with S = 2 ** (stages + 2):
a 4x4 transposed convolution from the single pixel, then kernel-4 stride-2 padding-1
transposed convolutions that double the size, BatchNorm and ReLU between, tanh at the end.
The discriminator mirrors it with stride-2 convolutions and LeakyReLU(0.2); its last 4x4
convolution (``head``) gives one logit per image (use ``BCEWithLogitsLoss``). Under spatial
parallelism the head sees a 4x4 image: run it on the whole image (``parallelize(...,
keep_dense=["head"])``).
"""

from __future__ import annotations

import torch
from torch import nn

from parallelkit.models.resnet import Layer


def _init(module: nn.Module) -> None:
    """The DCGAN paper's initialization: N(0, 0.02) weights, N(1, 0.02) norm scales."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(
        self,
        nz: int = 100,
        ngf: int = 64,
        nc: int = 3,
        image_size: int = 64,
        norm_layer: Layer = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        stages = _stages(image_size)
        c = ngf * 2 ** (stages - 1)
        layers: list[nn.Module] = [
            nn.ConvTranspose2d(nz, c, 4, 1, 0, bias=False), norm_layer(c), nn.ReLU()
        ]  # fmt: skip
        for _ in range(stages - 1):
            layers += [
                nn.ConvTranspose2d(c, c // 2, 4, 2, 1, bias=False),
                norm_layer(c // 2),
                nn.ReLU(),
            ]
            c //= 2
        layers += [nn.ConvTranspose2d(c, nc, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)
        _init(self)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (N, nz, 1, 1) -> (N, nc, S, S)
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(
        self, ndf: int = 64, nc: int = 3, image_size: int = 64, norm_layer: Layer = nn.BatchNorm2d
    ) -> None:
        super().__init__()
        stages = _stages(image_size)
        layers: list[nn.Module] = [nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2)]
        c = ndf
        for _ in range(stages - 1):
            layers += [
                nn.Conv2d(c, c * 2, 4, 2, 1, bias=False),
                norm_layer(c * 2),
                nn.LeakyReLU(0.2),
            ]
            c *= 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Conv2d(c, 1, 4, 1, 0, bias=False)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, nc, S, S) -> logits (N,)
        return self.head(self.features(x)).flatten()


def _stages(image_size: int) -> int:
    stages = image_size.bit_length() - 3
    if image_size < 8 or 2 ** (stages + 2) != image_size:
        raise ValueError(f"DCGAN: image_size must be a power of two >= 8, got {image_size}")
    return stages
