"""parallelkit: data- and model-parallel training of convolutional networks.

    import parallelkit as pk
    comm = pk.init()              # torchrun -> gloo/nccl, mpiexec -> mpi, else one local rank
    y = comm.all_reduce(x)        # every backend offers the same MPI-named operations

See docs/ and ../shared/DESIGN.md for the layers built on the communicators.
"""

from parallelkit import functional
from parallelkit.comm import CommError, Communicator, init

__version__ = "0.1.0"

__all__ = ["CommError", "Communicator", "__version__", "functional", "init"]
