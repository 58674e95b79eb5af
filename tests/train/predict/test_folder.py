"""``parallelkit predict`` owns its output folder, as a user runs it (``parallelkit predict`` in
a subprocess, on files the test writes), on a tiny 2-step 2-D run: nothing a user owns is ever
lost.

- an output folder that is the input folder: refused where the names collide (the inputs
  intact), used where they cannot (zarr next to npy);
- samples of one file name (a ``dataset.json`` listing ``imagesTr/c.npy`` and ``other/c.npy``)
  get one prediction each, on 2 data ranks; two that cannot be told apart are refused;
- a second predict into a folder another one holds is refused;
- resume redoes a sample made with other settings and refuses a foreign file in the way;
- NIfTI probabilities with the default float16 are stored as float32;
- a file size limit (``ulimit -f``) and a full disk end the run in one line naming the file,
  no partial file left; no room or a read-only folder is refused before start.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from runs import predict, refused, train

from parallelkit.data.shapes import ShapesDataset

HERE = Path(__file__).parents[2]  # tests/
RUN = [
    "train.task=segment", "data.num_classes=3", "data.channels=1", "train.batch_size=4",
    "train.max_steps=2", "train.log_every=1", "train.progress=false", "train.tensorboard=false",
    "train.plot=false", "optim.lr=0.2", "data.image_size=24", "model.width=4",
    "parallel.ranks=1",
]  # fmt: skip



@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, data folder): 8 training and 2 test samples of 28^2 (.npy)."""
    root = tmp_path_factory.mktemp("owned")
    data = root / "data"
    for split, count, base in (("train", 8, 0), ("test", 2, 1000)):
        for kind in ("images", "masks"):
            (data / split / kind).mkdir(parents=True)
        samples = ShapesDataset(count, image_size=28, channels=1, num_classes=3, base=base)
        for i in range(count):
            image, mask = samples[i]
            np.save(data / split / "images" / f"s{i}.npy", image.numpy())
            np.save(data / split / "masks" / f"s{i}.npy", mask.numpy().astype(np.uint8))
    train(root / "run", *RUN, f"data.name=npy:{data}")
    return root / "run", data


def _copy_inputs(data: Path, where: Path) -> dict[str, bytes]:
    shutil.copytree(data / "test" / "images", where)
    return {p.name: p.read_bytes() for p in where.iterdir()}


def test_output_in_the_input_folder_never_touches_the_inputs(run, tmp_path):
    run_dir, data = run
    inputs = tmp_path / "in"
    before = _copy_inputs(data, inputs)
    args = [f"train.run_dir={run_dir}", f"predict.input={inputs}", f"predict.output={inputs}",
            "predict.overwrite=true", "parallel.ranks=2"]
    refused(predict(*args, "predict.format=npy", ok=False), "would be written over the input")
    assert {p.name: p.read_bytes() for p in inputs.iterdir()} == before
    predict(*args, "predict.format=zarr")  # other names: nothing can collide
    for name, content in before.items():
        assert (inputs / name).read_bytes() == content
        assert (inputs / name.replace(".npy", ".zarr")).is_dir()


def test_samples_of_one_file_name_get_one_prediction_each(run, tmp_path):
    run_dir, data = run
    root = tmp_path / "listed"
    for folder, i in (("imagesTr", 0), ("other", 1)):
        (root / folder).mkdir(parents=True)
        (root / f"{folder}-labels").mkdir()
        shutil.copy(data / "test" / "images" / f"s{i}.npy", root / folder / "c.npy")
        shutil.copy(data / "test" / "masks" / f"s{i}.npy", root / f"{folder}-labels" / "c.npy")
    pairs = [{"image": f"./{f}/c.npy", "label": f"./{f}-labels/c.npy"}
             for f in ("imagesTr", "other")]
    (root / "dataset.json").write_text(json.dumps({"training": pairs[:1], "validation": pairs}))
    out = tmp_path / "out"
    # 2 data ranks, one sample each. With the probabilities, in float32: the class maps of
    # this 2-step model are all background for both inputs, which no mix-up would change,
    # and its probabilities of the two differ by about 0.01.
    probabilities = ["predict.probabilities=true", "predict.dtype=float32"]
    predict(f"train.run_dir={run_dir}", f"data.name=npy:{root}", f"predict.output={out}",
            "predict.format=npy", *probabilities, "parallel.ranks=2")  # fmt: skip
    assert sorted(p.name for p in out.glob("*.npy")) == [
        "imagesTr__c.npy", "imagesTr__c_probabilities.npy", "other__c.npy",
        "other__c_probabilities.npy"]  # fmt: skip
    # Each is its own input's prediction: both inputs again under names of their own, in one
    # plain run (a run per input would start predict twice to check the same).
    apart, alone = tmp_path / "apart", tmp_path / "alone"
    apart.mkdir()
    for folder in ("imagesTr", "other"):
        shutil.copy(root / folder / "c.npy", apart / f"{folder}.npy")
    predict(f"train.run_dir={run_dir}", f"predict.input={apart}", f"predict.output={alone}",
            "predict.format=npy", *probabilities, "parallel.ranks=1")  # fmt: skip
    want = {f: np.load(alone / f"{f}_probabilities.npy") for f in ("imagesTr", "other")}
    gap = np.abs(want["imagesTr"] - want["other"]).max()
    assert gap > 1e-3, gap  # else a swap or a repeat would pass
    for folder, probs in want.items():
        got = np.load(out / f"{folder}__c_probabilities.npy")
        np.testing.assert_allclose(got, probs, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(np.load(out / f"{folder}__c.npy"),
                                      np.load(alone / f"{folder}.npy"))  # fmt: skip
    twins = tmp_path / "twins"  # one folder, one name, two formats: cannot be told apart
    twins.mkdir()
    shutil.copy(data / "test" / "images" / "s0.npy", twins / "c.npy")
    zarr.save_array(str(twins / "c.zarr"), np.load(twins / "c.npy"))
    line = refused(predict(f"train.run_dir={run_dir}", f"predict.input={twins}",
                           f"predict.output={tmp_path / 'o'}", ok=False),
                   "would both be predicted into the name 'c'")
    assert "c.npy" in line and "c.zarr" in line


def test_a_second_predict_into_a_held_output_is_refused(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "out"
    args = [f"train.run_dir={run_dir}", f"predict.output={out}", "predict.format=npy",
            "predict.resume=true", "parallel.ranks=2"]
    predict(*args)
    # Labelled samples: the last run below also finds predict's own summary.json acceptable
    # (test_decathlon.py refuses a foreign one).
    assert (out / "summary.json").is_file()
    holder = subprocess.Popen(  # the lock a running predict's rank 0 holds
        [sys.executable, "-c", "import sys, time; from parallelkit.train.store.rundir import Lock; "
         f"Lock({str(out / '.parallelkit-predict')!r}); print('held', flush=True); "
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused(predict(*args, ok=False), f"in use by another parallelkit predict (pid "
                                          f"{holder.pid})")
    finally:
        holder.kill()
        holder.wait()
    assert "(2 already written)" in predict(*args).stdout  # the kernel dropped the lock


def test_resume_redoes_other_settings_and_refuses_foreign_files(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "out"
    args = [f"train.run_dir={run_dir}", f"predict.output={out}", "predict.format=npy",
            "parallel.ranks=2"]
    predict(*args)
    assert not list(out.glob("*_probabilities.npy"))
    proc = predict(*args, "predict.resume=true", "predict.probabilities=true")
    assert "2 samples (0 already written)" in proc.stdout
    assert sorted(p.name for p in out.glob("*_probabilities.npy")) == [
        "s0_probabilities.npy", "s1_probabilities.npy"]
    again = [*args, "predict.resume=true", "predict.probabilities=true"]
    assert "(2 already written)" in predict(*again).stdout
    (out / "s1.npy").unlink()
    (out / "s1.npy").write_text("mine")  # a user's file where a prediction was
    refused(predict(*again, ok=False), f"{out / 's1.npy'} is in the way")
    refused(predict(*args, "predict.overwrite=true", ok=False), "is in the way")
    assert (out / "s1.npy").read_text() == "mine"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "s0.npy").write_text("mine")
    refused(predict(f"train.run_dir={run_dir}", f"predict.output={foreign}",
                    "predict.format=npy", "predict.resume=true", ok=False), "is in the way")
    assert (foreign / "s0.npy").read_text() == "mine"


def test_nifti_probabilities_in_float16_are_stored_as_float32(run, tmp_path):
    import nibabel as nib

    run_dir, _ = run
    out = tmp_path / "out"
    proc = predict(f"train.run_dir={run_dir}", f"predict.output={out}", "predict.format=nifti",
                   "predict.probabilities=true", "parallel.ranks=2")
    assert "probabilities stored as float32" in proc.stdout
    probs = np.asarray(nib.load(out / "s0_probabilities.nii").dataobj)
    assert probs.dtype == np.float32 and probs.shape == (28, 28, 1, 1, 3)  # a vector image
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != ".parallelkit-predict") if (
        out.exists()) else []  # fmt: skip


def test_write_errors_end_in_one_line_and_leave_no_partial_file(run, tmp_path):
    run_dir, _ = run
    args = [f"train.run_dir={run_dir}", "predict.format=npy", "predict.probabilities=true",
            "predict.dtype=float32"]
    out = tmp_path / "limited"  # class maps of 912 bytes pass, 9 KiB softmax files do not

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    # gloo: MPI's shared memory between ranks is files too, which the limit would refuse.
    line = refused(predict(*args, f"predict.output={out}", "parallel.ranks=2",
                           "parallel.backend=gloo", ok=False, preexec_fn=limit),
                   "_probabilities.npy: File too large")  # fmt: skip
    assert "ulimit -f" in line
    assert _leftovers(out) == []
    script = [str(HERE / "scripts" / "predict_output_faults.py")]
    out = tmp_path / "full"
    refused(predict(*args, f"predict.output={out}", "parallel.ranks=1", ok=False,
                    script=[*script, "full"]), "No space left on device (the file system is full)")
    assert _leftovers(out) == []
    refused(predict(*args, f"predict.output={tmp_path / 'small'}", "parallel.ranks=1",
                    ok=False, script=[*script, "no-room"]), "MiB free on its file system")
    assert not (tmp_path / "small").exists()


def test_a_read_only_output_folder_is_refused_before_start(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "read-only"
    out.mkdir()
    args = [f"train.run_dir={run_dir}", f"predict.output={out}", "parallel.ranks=2"]
    if os.geteuid() == 0:  # root writes through chmod: os.access is told to say no
        proc = predict(*args, ok=False,
                       script=[str(HERE / "scripts" / "predict_output_faults.py"), "read-only"])
    else:
        out.chmod(0o555)
        proc = predict(*args, ok=False)
    refused(proc, "is not writable by this user")
    assert list(out.iterdir()) == []
