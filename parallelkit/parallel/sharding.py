"""Which parameters of a parallelized model are split over ranks, and over which group.

Why here: an optimizer that needs a whole weight's norm (LARS's trust ratio) must know which
weights ``pk.parallelize`` sharded; that is knowledge of the parallel layers, so it lives beside
them rather than in the training code that asks.
"""

from __future__ import annotations

from torch import nn

from parallelkit.comm import Communicator
from parallelkit.nn.channel_parallel import ChannelParallelConvNd
from parallelkit.nn.channel_transposed import ChannelParallelConvTransposeNd


def sharded_parameters(model: nn.Module) -> dict[nn.Parameter, Communicator]:
    """Weights split over a channel group, with that group (LARS needs their whole norm).

    Spatial parallelism splits activations, not weights: its parameters are whole on every
    rank and do not appear here.
    """
    kinds = ChannelParallelConvNd | ChannelParallelConvTransposeNd
    return {m.weight: m.comm for m in model.modules() if isinstance(m, kinds) and m.comm.size > 1}
