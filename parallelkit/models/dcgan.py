"""DCGAN (Radford et al., 2016) generator and discriminator, plain torch.nn, no parallelism.

The generator maps noise (N, nz, 1, 1) to images (N, nc, S, S), S = 2 ** (stages + 2) for any
power of two S >= 8 (8 ... 1024 and beyond): a 4x4 transposed convolution from the single
pixel, then kernel-4 stride-2 padding-1 transposed convolutions that double the size, norm and
ReLU between, tanh at the end. The discriminator mirrors it with stride-2 convolutions and
LeakyReLU(0.2) (no norm after the first); its last 4x4 convolution (``head``) gives one logit
per image (use ``BCEWithLogitsLoss``). Under spatial parallelism the head sees a 4x4 image: run
it on the whole image (``parallelize(..., keep_dense=["head"])``).

Widths double at every stage away from the image, as in the paper (ngf = 64 at 64x64: 512 ->
256 -> 128 -> 64 -> 3), but stop at ``max_channels`` (default ``8 * ngf``, the paper's widest),
as StyleGAN caps them: uncapped, 1024x1024 would start from 8192 channels and hold 0.7 G
parameters in the generator alone. Every layout up to 64x64 is the paper's either way.

Layer types are arguments (``norm_layer``, ``act_layer``, ``conv_layer`` /
``conv_transpose_layer``); ``pk.parallelize`` replaces layers whose type is exactly
``nn.Conv2d`` / ``nn.ConvTranspose2d``, so those stay the defaults.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from parallelkit.models.registry import register
from parallelkit.models.resnet import Layer

LEAKY_RELU: Layer = partial(nn.LeakyReLU, 0.2)
"""The discriminator's default activation, the paper's LeakyReLU with slope 0.2."""


def _init(module: nn.Module) -> None:
    """The DCGAN paper's initialization: N(0, 0.02) weights, N(1, 0.02) norm scales."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


@register("dcgan_generator")
class Generator(nn.Module):
    """Noise (N, nz, 1, 1) -> images (N, nc, image_size, image_size) in [-1, 1].

    nz: noise channels. ngf: width of the last hidden stage (the one next to the image);
    stage k away from the image has ``min(ngf * 2**k, max_channels)`` channels.
    max_channels: the widest stage; None means ``8 * ngf``.
    """

    def __init__(
        self,
        nz: int = 100,
        ngf: int = 64,
        nc: int = 3,
        image_size: int = 64,
        norm_layer: Layer = nn.BatchNorm2d,
        *,
        max_channels: int | None = None,
        act_layer: Layer = nn.ReLU,
        conv_transpose_layer: Layer = nn.ConvTranspose2d,
    ) -> None:
        super().__init__()
        widths = _widths("Generator", image_size, "ngf", ngf, max_channels, nz=nz, nc=nc)[::-1]
        up = conv_transpose_layer
        c = widths[0]  # 4x4
        layers: list[nn.Module] = [up(nz, c, 4, 1, 0, bias=False), norm_layer(c), act_layer()]
        for w in widths[1:]:  # each doubles the size
            layers += [up(c, w, 4, 2, 1, bias=False), norm_layer(w), act_layer()]
            c = w
        layers += [up(c, nc, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)
        _init(self)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (N, nz, 1, 1) -> (N, nc, S, S)
        return self.main(z)


@register("dcgan_discriminator")
class Discriminator(nn.Module):
    """Images (N, nc, image_size, image_size) -> one logit per image (N,).

    ndf: width of the first stage (the one next to the image); stage k has
    ``min(ndf * 2**k, max_channels)`` channels. max_channels: None means ``8 * ndf``.
    """

    def __init__(
        self,
        ndf: int = 64,
        nc: int = 3,
        image_size: int = 64,
        norm_layer: Layer = nn.BatchNorm2d,
        *,
        max_channels: int | None = None,
        act_layer: Layer = LEAKY_RELU,
        conv_layer: Layer = nn.Conv2d,
    ) -> None:
        super().__init__()
        widths = _widths("Discriminator", image_size, "ndf", ndf, max_channels, nc=nc)
        c = widths[0]
        layers: list[nn.Module] = [conv_layer(nc, c, 4, 2, 1, bias=False), act_layer()]
        for w in widths[1:]:  # each halves the size
            layers += [conv_layer(c, w, 4, 2, 1, bias=False), norm_layer(w), act_layer()]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = conv_layer(c, 1, 4, 1, 0, bias=False)  # 4x4 -> 1x1
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, nc, S, S) -> logits (N,)
        return self.head(self.features(x)).flatten()


def _widths(
    who: str, image_size: int, base_name: str, base: int, max_channels: int | None, **sizes: int
) -> list[int]:
    """Stage widths from the image side (S/2, S/4, ..., 4 pixels): base, 2 base, ..., capped.

    Checks the arguments first, so a bad one fails with a ValueError naming it.
    """
    sizes = {base_name: base, **sizes, "image_size": image_size}
    if max_channels is not None:
        sizes["max_channels"] = max_channels
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"DCGAN {who}: {name} must be a positive integer, got {value!r}")
    if image_size < 8 or image_size & (image_size - 1):
        raise ValueError(
            f"DCGAN {who}: image_size must be a power of two >= 8 (8, 16, 32, ..., 1024), "
            f"got {image_size}"
        )
    cap = 8 * base if max_channels is None else max_channels
    if cap < base:
        raise ValueError(f"DCGAN {who}: max_channels={cap} is below {base_name}={base}")
    stages = image_size.bit_length() - 3  # 2 ** (stages + 2) == image_size
    return [min(base << k, cap) for k in range(stages)]
