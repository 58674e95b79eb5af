"""Models written against plain torch.nn, taking layer types as arguments; no parallelism.

Build one by name with :func:`create` (names: :func:`list_models`):

==========================  ===============================================================
``"resnet18"``              :func:`resnet18`: BasicBlock 2-2-2-2, 11.7 M parameters
``"resnet34"``              :func:`resnet34`: BasicBlock 3-4-6-3, 21.8 M parameters
``"resnet50"``              :func:`resnet50`: Bottleneck 3-4-6-3, 25.6 M parameters
``"dcgan_generator"``       :class:`Generator`: noise -> image, 8x8 to 1024x1024
``"dcgan_discriminator"``   :class:`Discriminator`: image -> logit, 8x8 to 1024x1024
``"unet"``                  :class:`UNet`: image -> per-pixel logits (segmentation);
                            signals and volumes too (``spatial_dims=1`` or ``3``)
``"torchvision:NAME"``      another library's model, random weights (:mod:`.zoo`); also
``"timm:NAME"``, ``"smp:ARCH"``
==========================  ===============================================================

(parameter counts for the ImageNet stem and 1000 classes, equal to torchvision's.)
"""

from parallelkit.models.dcgan import Discriminator, Generator
from parallelkit.models.registry import create, list_models, register
from parallelkit.models.resnet import (
    BasicBlock,
    Bottleneck,
    Layer,
    ResNet,
    resnet18,
    resnet34,
    resnet50,
)
from parallelkit.models.unet import UNet, unet

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "Discriminator",
    "Generator",
    "Layer",
    "ResNet",
    "UNet",
    "create",
    "list_models",
    "register",
    "resnet18",
    "resnet34",
    "resnet50",
    "unet",
]
