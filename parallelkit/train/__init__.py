"""Training: ``parallelkit train`` and ``parallelkit predict``, in rooms that import downward.

From the ground up:

- :mod:`~parallelkit.train.schema` and :mod:`~parallelkit.train.keys`: the config's shape,
  one dataclass per section, and every key with its default.
- :mod:`~parallelkit.train.ranks`: starting the ranks or joining a launcher's job, supervising
  them, stopping them together, and where each one trains.
- :mod:`~parallelkit.train.store`: what a run keeps on disk (the run directory, checkpoints,
  files written whole or not at all).
- :mod:`~parallelkit.train.tasks`: what is trained (classification, GAN, segmentation), with
  their losses, metrics and optimizers.
- :mod:`~parallelkit.train.config`: a run's :class:`Config`, read and checked against the tasks
  (it sits above them because each task carries its own defaults and checks).
- :mod:`~parallelkit.train.loop`: the training loop on every rank, its checks before the start,
  its monitor and plots.
- :mod:`~parallelkit.train.predict`: a trained run applied to whole samples.

``parallelkit train`` (see :mod:`parallelkit.cli`) parses a :class:`Config`, starts or joins
the ranks (:mod:`~parallelkit.train.ranks.launch`) and calls :func:`run` on each.
"""

from parallelkit.train.config import Config, load
from parallelkit.train.loop.trainer import run

__all__ = ["Config", "load", "run"]
