"""Training: configs, the loop, checkpoints, metrics, and starting the ranks.

``parallelkit train`` (see :mod:`parallelkit.cli`) parses a :class:`Config`, starts or joins
the ranks (:mod:`launch`) and calls :func:`run` on each.
"""

from parallelkit.train.config import Config, load
from parallelkit.train.trainer import run

__all__ = ["Config", "load", "run"]
