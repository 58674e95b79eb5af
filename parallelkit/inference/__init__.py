"""Whole-sample inference: a trained model applied to samples of any size, split over ranks.

    from parallelkit.inference import Predictor, predict
    predictor = Predictor(model, grid, normalize=(mean, std))
    predictor(SampleReader("slide.ome.zarr"), output)   # each rank reads, runs, writes its block

:mod:`~parallelkit.inference.predictor` runs the model on blocks (exact: the dense model's
output on the whole sample); :mod:`~parallelkit.inference.outputs` writes each rank's block of
the class map and softmax into zarr/OME-Zarr, NIfTI or npy. ``parallelkit predict``
(:mod:`parallelkit.train.predict.command`) drives both from a trained run.
"""

from parallelkit.inference.outputs import FORMATS, Output, create, open_output
from parallelkit.inference.predictor import Predictor, Result, predict

__all__ = ["FORMATS", "Output", "Predictor", "Result", "create", "open_output", "predict"]
