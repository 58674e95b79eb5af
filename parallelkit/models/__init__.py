"""Models written against plain torch.nn, taking layer types as arguments; no parallelism."""

from parallelkit.models.dcgan import Discriminator, Generator
from parallelkit.models.resnet import BasicBlock, ResNet, resnet18

__all__ = ["BasicBlock", "Discriminator", "Generator", "ResNet", "resnet18"]
