"""parallelkit: data- and model-parallel training of convolutional networks.

    import parallelkit as pk
    comm = pk.init()              # torchrun -> gloo/nccl, mpiexec -> mpi, else one local rank
    y = comm.all_reduce(x)        # every backend offers the same MPI-named operations
    model = pk.parallelize(model, comm, "spatial")   # or "data", "channel", a pk.Grid
    dense = pk.to_dense(model)    # the original architecture with the current weights
    pk.predict(model, sample, grid, output)   # a whole sample, each rank its block (inference)

See docs/ for the layers built on the communicators.
"""

from parallelkit import functional, spatial
from parallelkit.comm import CommError, Communicator, init
from parallelkit.inference import Predictor, predict
from parallelkit.parallel import DataParallel, Grid, parallelize, to_dense

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "Communicator",
    "DataParallel",
    "Grid",
    "Predictor",
    "__version__",
    "functional",
    "init",
    "parallelize",
    "predict",
    "spatial",
    "to_dense",
]
