"""``parallelkit predict``: a trained run applied to whole samples of any size, block by block
(:mod:`~parallelkit.train.predict.command`), with its output folder, pyramid levels and
samples."""
