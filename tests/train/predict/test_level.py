"""Predictions a pathologist opens beside the slide, as a user makes them (``parallelkit
predict`` in a subprocess, on files the test writes): a tiny run trained at level 1 of
3-level OME-Zarr slides.

- a 3-level OME-Zarr slide predicted at level 1, on 2 ranks, into a 3-level pyramid: named
  ``.ome.zarr`` as its input; opened with ome-zarr-py (the OME-NGFF reference reader): every
  level's shape, scale (level 1's of the input, then doubled), translation and unit; lower
  levels are the most frequent class and the mean softmax of the level above;
- an SVS-like TIFF with ``MPP = 0.25``, predicted at its level 1: the output's scale is
  0.5 micrometre; the pixel size differs from training's, said in one line, refused with
  ``predict.strict=true``;
- ``pk.Predictor(normalize=RUN)`` takes the run's own normalizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tifffile
import zarr
from runs import predict, refused, train

from parallelkit.data.shapes import ShapesDataset
from parallelkit.inference.zarr_out import level_sizes, reduce_classes, reduce_probabilities

ome_zarr = pytest.importorskip("ome_zarr")

OPTS = [
    "train.task=segment", "data.num_classes=3", "data.channels=3", "data.image_size=[24,16]",
    "data.level=1", "train.batch_size=4", "train.max_steps=2", "train.log_every=1",
    "train.progress=false", "train.tensorboard=false", "train.plot=false", "optim.lr=0.2",
    "model.width=4", "parallel.ranks=1",
]  # fmt: skip
BASE = 0.5  # micrometres per pixel at level 0
SHIFT = [10.0, 20.0]  # the slide's origin, micrometres


def write_slide(path, a: np.ndarray) -> None:
    """A 3-level OME-Zarr 0.5 slide: level l halves level 0, scale 0.5 * 2^l micrometre."""
    g = zarr.open_group(path, mode="w", zarr_format=3)
    channel = a.ndim == 3
    axes = ([{"name": "c", "type": "channel"}] if channel else []) + [
        {"name": n, "type": "space", "unit": "micrometer"} for n in ("y", "x")]  # fmt: skip
    datasets = []
    for level in range(3):
        data = a[..., :: 2**level, :: 2**level]
        g.create_array(f"s{level}", shape=data.shape, dtype=data.dtype,
                       chunks=(3, 16, 16)[-a.ndim:])[...] = data  # fmt: skip
        s = BASE * 2**level
        datasets.append({"path": f"s{level}", "coordinateTransformations": [
            {"type": "scale", "scale": ([1.0] if channel else []) + [s, s]},
            {"type": "translation", "translation": ([0.0] if channel else []) + SHIFT}]})
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets}]}


def write_svs(path, a: np.ndarray, mpp: float) -> None:
    """An Aperio-like pyramid: baseline (its MPP in the description), thumbnail, 2 levels."""
    rgb = np.moveaxis(a, 0, -1)
    with tifffile.TiffWriter(path) as t:
        t.write(rgb, tile=(16, 16), photometric="rgb", metadata=None,
                description=f"Aperio Image Library v12.0.15 \n|AppMag = 20|MPP = {mpp}")
        t.write(rgb[::8, ::8], photometric="rgb", metadata=None, description="thumbnail")
        for f in (2, 4):
            t.write(rgb[::f, ::f], tile=(16, 16), photometric="rgb", metadata=None)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory, slides folder): 2 steps at level 1 of 6 training slides."""
    root = tmp_path_factory.mktemp("geometry")
    slides = root / "slides"
    for split, count, size, base in (("train", 6, 64, 0), ("test", 1, 88, 1000)):
        scenes = ShapesDataset(count, image_size=size, channels=3, num_classes=3, base=base)
        for folder in ("images", "masks"):
            (slides / split / folder).mkdir(parents=True)
        for i in range(count):
            image, mask = scenes[i]
            write_slide(slides / split / "images" / f"s{i}.ome.zarr", image.numpy())
            write_slide(slides / split / "masks" / f"s{i}.ome.zarr", mask.numpy().astype("u1"))
    train(root / "run", *OPTS, f"data.name=zarr:{slides}")
    return root / "run", slides


def _read(path):
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    return next(iter(Reader(parse_url(str(path)))()))


def test_a_slide_at_level_1_gives_that_levels_geometry_and_a_pyramid(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "out"
    predict(f"train.run_dir={run_dir}", f"predict.output={out}", "predict.levels=3",
            "predict.probabilities=true", "predict.dtype=float32", "parallel.rows=2",
            "parallel.ranks=2")  # fmt: skip
    assert (out / "s0.ome.zarr").is_dir() and not (out / "s0.zarr").exists()
    node = _read(out / "s0.ome.zarr")
    sizes = level_sizes((44, 44), 3)  # level 1 of the 88^2 slide, then halved
    assert [tuple(d.shape) for d in node.data] == sizes
    axes = node.metadata["axes"]
    assert [a.get("unit") for a in axes] == ["micrometer", "micrometer"]
    transforms = node.metadata["coordinateTransformations"]
    for level, t in enumerate(transforms):
        by = {x["type"]: x for x in t}
        scale = 2 * BASE * 2**level  # the input's level 1, doubled per level
        assert by["scale"]["scale"] == [scale, scale]
        shift = [s + (2 * BASE) * (2**level - 1) / 2 for s in SHIFT]  # half a pixel per level
        assert by["translation"]["translation"] == pytest.approx(shift)
    classes = [np.asarray(d) for d in node.data]
    root = zarr.open_group(str(out / "s0.ome.zarr"), mode="r")
    probs = [root[f"probabilities/{i}"][...] for i in range(3)]
    for level in (1, 2):
        np.testing.assert_array_equal(classes[level], reduce_classes(classes[level - 1], 3))
        np.testing.assert_allclose(probs[level], reduce_probabilities(probs[level - 1]),
                                   rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(probs[0].sum(0), 1, rtol=1e-5)  # written whole, not zeros
    assert np.array_equal(probs[0].argmax(0), classes[0])


def test_an_svs_slides_microns_per_pixel_are_read_and_written(run, tmp_path):
    run_dir, _ = run
    image, _ = ShapesDataset(1, image_size=96, channels=3, num_classes=3, base=2000)[0]
    slide = tmp_path / "in" / "slide0.svs"
    slide.parent.mkdir()
    write_svs(slide, (image.numpy() * 60 + 120).clip(0, 255).astype(np.uint8), mpp=0.25)
    out = tmp_path / "out"
    args = [f"train.run_dir={run_dir}", f"predict.input={slide}", "parallel.ranks=1"]
    proc = predict(*args, f"predict.output={out}")
    node = _read(out / "slide0.zarr")
    assert node.data[0].shape == (48, 48)  # level 1
    by = {x["type"]: x for x in node.metadata["coordinateTransformations"][0]}
    assert by["scale"]["scale"] == [0.5, 0.5]  # 0.25 at the baseline, level 1 is half as fine
    assert [a.get("unit") for a in node.metadata["axes"]] == ["micrometer", "micrometer"]
    said = [x for x in proc.stdout.splitlines() if "trained at" in x]
    assert len(said) == 1 and "0.5 micrometer per pixel (SVS MPP)" in said[0], proc.stdout
    assert "1 micrometer per pixel (OME-Zarr)" in said[0]
    refused(predict(*args, f"predict.output={tmp_path / 'strict'}", "predict.strict=true",
                    ok=False), "predict.strict=true refuses it")  # fmt: skip


def test_the_predictor_takes_the_runs_own_normalizer(run):
    import parallelkit as pk
    from parallelkit.data.intensity import Normalizer
    from parallelkit.train.predict.command import load_model

    run_dir, _ = run
    saved = Normalizer.from_spec(json.loads((run_dir / "normalization.json").read_text()))
    comm = pk.init("local")
    from parallelkit.train.config import load

    model, _ = load_model(load(str(run_dir / "config.yaml"), []), report=False)
    predictor = pk.Predictor(model, pk.Grid(comm), normalize=run_dir)
    assert predictor.normalize == saved
    with pytest.raises(ValueError, match="no run normalizer"):
        pk.Predictor(model, pk.Grid(comm), normalize=run_dir / "nope")
