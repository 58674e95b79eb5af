"""``parallelkit predict`` as a user runs it: a tiny run trained on files read by blocks, then
its checkpoint applied to whole test samples of sizes it never trained on, at 1, 2 and 4
ranks; the predictions agree (class maps equal apart from ties, softmax within float32
roundoff). The outputs: OME-Zarr with the input's axes and scale, NIfTI with the input's
affine, npy. Resuming redoes only what is not whole; mistakes stop before any rank starts,
with one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import zarr
from runs import BLOCK_IMAGES, BLOCK_VOLUMES, train

from parallelkit.data.shapes import ShapesDataset
from parallelkit.data.shapes3d import ShapesVolumeDataset

pytest.importorskip("monai")

IMAGES = [*BLOCK_IMAGES, "parallel.ranks=1"]  # train's tiny 2-D and 3-D runs
VOLUMES = [*BLOCK_VOLUMES, "parallel.ranks=1"]
TEST_SIZES = {2: [(44, 37), (61, 50)], 3: [(21, 18, 17), (26, 20, 19)]}
"""Whole test samples: other sizes than the 24^2 (16^3) crops of training, odd ones too."""
AFFINE = np.array([[0.0, 0, 1.5, -10], [0, 0.8, 0, 4], [-0.8, 0, 0, 7], [0, 0, 0, 1]])


def predict(*overrides: str, ok: bool = True, timeout: float = 300):
    cmd = [sys.executable, "-m", "parallelkit.cli", "predict", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _ome(path: Path, data: np.ndarray, axes: list[str], chunks: tuple[int, ...]) -> None:
    """An OME-Zarr 0.5 image group with its level 0 ``data``."""
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    kinds = {"c": "channel"}
    root.attrs["ome"] = {"version": "0.5", "multiscales": [{
        "axes": [{"name": a, "type": kinds.get(a, "space"), **({"unit": "micrometer"}
                  if a != "c" else {})} for a in axes],
        "datasets": [{"path": "0", "coordinateTransformations": [
            {"type": "scale", "scale": [1.0] + [0.25] * (len(axes) - 1)}]}],
    }]}  # fmt: skip
    root.create_array("0", data=data, chunks=chunks)


def _write(root: Path, dims: int) -> None:
    """Training crops' files (8) and test samples (2) of other, odd sizes: OME-Zarr images
    with zarr masks (2-D), NIfTI with an affine that is not the identity (3-D)."""
    for split in ("train", "test"):
        (root / split / "images").mkdir(parents=True)
        (root / split / "masks").mkdir(parents=True)
    make = ShapesDataset if dims == 2 else ShapesVolumeDataset
    train_data = make(8, image_size=28 if dims == 2 else 20, channels=1, num_classes=3)
    samples = [("train", f"s{i}", *train_data[i]) for i in range(8)]
    for i, size in enumerate(TEST_SIZES[dims]):
        image, mask = make(1, image_size=max(size), channels=1, num_classes=3, base=1000 + i)[0]
        cut = tuple(slice(0, n) for n in size)
        samples.append(("test", f"t{i}", image[(slice(None), *cut)], mask[cut]))
    for split, name, image, mask in samples:
        base = root / split
        x, m = image.numpy().astype(np.float32), mask.numpy().astype(np.uint8)
        if dims == 2:
            _ome(base / "images" / f"{name}.ome.zarr", x, ["c", "y", "x"], (1, 16, 16))
            zarr.save_array(str(base / "masks" / f"{name}.zarr"), m)
        else:
            nib.save(nib.Nifti1Image(x[0], AFFINE), base / "images" / f"{name}.nii.gz")
            nib.save(nib.Nifti1Image(m, AFFINE), base / "masks" / f"{name}.nii.gz")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """(run directory, data) of a 4-step 2-D run (zarr) and 3-D run (NIfTI), both 1 rank."""
    root = tmp_path_factory.mktemp("predict")
    out = {}
    for dims, kind, opts in ((2, "zarr", IMAGES), (3, "nifti", VOLUMES)):
        data = root / f"data{dims}"
        _write(data, dims)
        run = root / f"run{dims}"
        train(run, *opts, f"data.name={kind}:{data}")
        out[dims] = run, data
    return out


def _zarr_prediction(path: Path) -> tuple[np.ndarray, np.ndarray]:
    root = zarr.open_group(str(path), mode="r")
    return root["0"][...], root["probabilities/0"][...]


def _agree(classes, probs, classes_ref, probs_ref) -> None:
    """Class maps equal apart from ties, softmax within float32 roundoff."""
    np.testing.assert_allclose(probs, probs_ref, atol=2e-6, rtol=0)
    top2 = np.sort(probs_ref, axis=0)[-2:]
    clear = top2[1] - top2[0] > 1e-5
    np.testing.assert_array_equal(classes[clear], classes_ref[clear])


@pytest.mark.timeout(600)
def test_images_predicted_on_1_2_and_4_ranks_agree(runs, tmp_path):
    run, _ = runs[2]
    grids = {1: ["parallel.ranks=1"], 2: ["parallel.ranks=2", "parallel.rows=2"],
             4: ["parallel.ranks=4", "parallel.rows=2", "parallel.cols=2"]}
    got = {}
    for n, grid in grids.items():
        out = tmp_path / f"out{n}"
        proc = predict(f"train.run_dir={run}", f"predict.output={out}", "predict.dtype=float32",
                       "predict.probabilities=true", *grid)
        assert "parallelkit predict: done" in proc.stdout
        summary = json.loads((out / "predict.json").read_text())
        assert summary["samples"] == 2 and summary["voxels"] == 44 * 37 + 61 * 50
        got[n] = {t: _zarr_prediction(out / f"t{t}.ome.zarr") for t in range(2)}
        assert "mIoU" in summary
    for n in (2, 4):
        for t, size in enumerate(TEST_SIZES[2]):
            classes, probs = got[n][t]
            assert classes.shape == size and classes.dtype == np.uint8
            assert probs.shape == (3, *size) and probs.dtype == np.float32
            _agree(classes, probs, *got[1][t])
    meta = zarr.open_group(str(tmp_path / "out4" / "t1.ome.zarr"), mode="r")
    multiscale = meta.attrs["ome"]["multiscales"][0]
    assert [a["name"] for a in multiscale["axes"]] == ["y", "x"]
    assert multiscale["axes"][0]["unit"] == "micrometer"
    assert multiscale["datasets"][0]["coordinateTransformations"][0]["scale"] == [0.25, 0.25]
    assert meta["0"].chunks == (16, 16)  # the input's chunks (smaller than every block)


@pytest.mark.timeout(600)
def test_tiff_input_predicts_as_the_zarr_input_does(runs, tmp_path):
    """The 2-D test images as TIFF in a folder (``predict.input=``): one uncompressed
    (memory-mapped), one tiled and compressed (read through tifffile's zarr store), on 2
    ranks, against the OME-Zarr split on 1 rank."""
    tifffile = pytest.importorskip("tifffile")
    run, data = runs[2]
    folder = tmp_path / "tiff"
    folder.mkdir()
    for t, options in enumerate(({}, {"tile": (16, 16), "compression": "zlib"})):
        x = zarr.open_group(str(data / "test" / "images" / f"t{t}.ome.zarr"), mode="r")["0"][0]
        tifffile.imwrite(folder / f"t{t}.tif", x, **options)
    common = ["predict.format=npy", "predict.probabilities=true", "predict.dtype=float32"]
    predict(f"train.run_dir={run}", f"predict.output={tmp_path / 'ref'}", *common)
    predict(f"train.run_dir={run}", f"predict.input={folder}", f"predict.output={tmp_path / 'tif'}",
            "parallel.ranks=2", "parallel.rows=2", *common)  # fmt: skip
    for t, size in enumerate(TEST_SIZES[2]):
        classes = np.load(tmp_path / "tif" / f"t{t}.npy")
        assert classes.shape == size
        _agree(classes, np.load(tmp_path / "tif" / f"t{t}_probabilities.npy"),
               np.load(tmp_path / "ref" / f"t{t}.npy"),
               np.load(tmp_path / "ref" / f"t{t}_probabilities.npy"))  # fmt: skip


@pytest.mark.timeout(600)
def test_volumes_predicted_as_nifti_keep_the_affine_and_agree_over_depth(runs, tmp_path):
    run, _ = runs[3]
    got = {}
    for n, grid in {1: ["parallel.ranks=1"], 2: ["parallel.ranks=2", "parallel.depth=2"]}.items():
        out = tmp_path / f"out{n}"
        predict(f"train.run_dir={run}", f"predict.output={out}", "predict.format=nifti",
                "predict.probabilities=true", "predict.dtype=float32", *grid)
        got[n] = []
        for t, size in enumerate(TEST_SIZES[3]):
            image = nib.load(out / f"t{t}.nii")
            np.testing.assert_allclose(image.affine, AFFINE)
            classes = np.asarray(image.dataobj)
            assert classes.shape == size and classes.dtype == np.uint8
            vector = np.asarray(nib.load(out / f"t{t}_probabilities.nii").dataobj)
            probs = np.moveaxis(vector[:, :, :, 0], -1, 0)  # (X, Y, Z, 1, K): a vector image
            got[n].append((classes, probs))
    for (c2, p2), (c1, p1) in zip(got[2], got[1], strict=True):
        _agree(c2, p2, c1, p1)


@pytest.mark.timeout(600)
def test_resume_skips_whole_samples_and_redoes_half_written_ones(runs, tmp_path):
    run, _ = runs[2]
    out = tmp_path / "out"
    args = [f"train.run_dir={run}", f"predict.output={out}", "predict.format=npy",
            "parallel.ranks=2", "parallel.rows=2"]
    predict(*args)
    first = np.load(out / "t1.npy")
    again = predict(*args, ok=False)
    assert again.returncode == 2 and "predict.resume=true" in again.stderr
    (out / "t1.npy").rename(out / ".t1.npy.partial")  # as a killed run leaves it
    (out / ".t1.npy.partial").write_bytes(b"half")
    proc = predict(*args, "predict.resume=true")
    assert "2 samples (1 already written)" in proc.stdout
    np.testing.assert_array_equal(np.load(out / "t1.npy"), first)
    assert not (out / ".t1.npy.partial").exists()
    proc = predict(*args, "predict.overwrite=true")
    assert "(0 already written)" in proc.stdout


def test_mistakes_stop_before_any_rank_starts(runs, tmp_path):
    run, _ = runs[2]
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.yaml").write_text((run / "config.yaml").read_text())
    three = tmp_path / "three.npy"
    np.save(three, np.zeros((3, 40, 40), np.float32))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.npy").write_bytes(b"")
    cases = {
        "holds no checkpoint": [f"train.run_dir={empty}", f"predict.output={tmp_path / 'a'}"],
        "has 3 channels; the model": [f"train.run_dir={run}", f"predict.input={three}",
                                      f"predict.output={tmp_path / 'b'}"],
        "already holds files": [f"train.run_dir={run}", f"predict.output={full}"],
        "fewer than the parallel.rows=48 blocks": [
            f"train.run_dir={run}", f"predict.output={tmp_path / 'c'}", "parallel.ranks=48",
            "parallel.rows=48"],
        "is not a run": [f"train.run_dir={tmp_path}", f"predict.output={tmp_path / 'd'}"],
        "predict.format='png'": [f"train.run_dir={run}", "predict.format=png",
                                 f"predict.output={tmp_path / 'e'}"],
    }
    for expected, args in cases.items():
        proc = predict(*args, ok=False, timeout=120)
        assert proc.returncode == 2, (expected, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (expected, proc.stderr[-2000:])
        assert lines[0].startswith("parallelkit predict: error: ")


def test_channel_shards_make_the_dense_model(runs, tmp_path):
    """A run trained with channel parallelism keeps each rank's slices of the convolutions in
    its shard; ``parallelkit predict`` puts them together: the exported dense ``model.pt``."""
    import torch

    from parallelkit.train import config
    from parallelkit.train.predict.command import load_model

    _, data = runs[2]
    run = tmp_path / "channel"
    train(run, *IMAGES, "parallel.strategy=channel", "parallel.ranks=2",
          f"data.name=zarr:{data}")
    cfg = config.load(str(run / "config.yaml"))
    dense, folder = load_model(cfg, report=False)
    assert "shard-1.pt" in {p.name for p in folder.iterdir()}
    exported = torch.load(run / "model.pt")
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(value, exported[key], rtol=0, atol=0)
