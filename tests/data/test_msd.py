"""A Medical Segmentation Decathlon folder trained as a CT/MRI user would: ``dataset.json``
with ``imagesTr``/``labelsTr``, anisotropic 2-channel NIfTI volumes, ``train.loss=dice_ce``, a
Hounsfield window, a ``[16, 48, 40]`` crop, foreground oversampling, flips and quarter turns in
the H-W plane, on 2 ranks split over depth: the 1-rank loss curve and test scores, and another
seed's curve differs."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
from runs import assert_curves_equal, curve, records, train_all

from parallelkit.data import datalist

pytest.importorskip("monai")

SIZE = (20, 56, 48)  # the stored array's axes
CROP = [16, 48, 40]  # D, H, W of the crop; the volumes are (20, 56, 48): the crops move
OPTS = [
    "train.task=segment", "data.num_classes=3", "data.channels=2", "data.dims=3",
    f"data.image_size=[{','.join(map(str, CROP))}]", "data.normalize=window",
    "data.window=[-1000,400]", "data.foreground=0.5", "data.flips=[1,2]", "data.rotate=[1,2]",
    "train.loss=dice_ce",
    "train.batch_size=2", "train.max_steps=4", "train.log_every=1", "train.progress=false",
    "train.tensorboard=false", "train.plot=false", "optim.lr=0.2", "model.name=monai:UNet",
    "model.kwargs={channels: [4, 8], strides: [2], num_res_units: 1, norm: batch}",
]  # fmt: skip


def write_msd(root, count: int = 10) -> None:
    """``count`` cases in the Decathlon's layout: (X, Y, Z, 2) float images in Hounsfield-like
    units (a box of class 1 and a ball of class 2 in a noisy background), uint8 labels."""
    rng = np.random.default_rng(0)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for i in range(count):
        labels = np.zeros(SIZE, np.uint8)
        z, y, x = rng.integers(1, 10), rng.integers(2, 36), rng.integers(2, 30)
        labels[z : z + 8, y : y + 16, x : x + 14] = 1
        zz, yy, xx = np.ogrid[: SIZE[0], : SIZE[1], : SIZE[2]]
        cz, cy, cx = rng.integers(5, 15), rng.integers(8, 48), rng.integers(8, 40)
        labels[(zz - cz) ** 2 + ((yy - cy) / 2) ** 2 + ((xx - cx) / 2) ** 2 < 6] = 2
        ct = -900 + 500.0 * labels + rng.normal(0, 80, labels.shape)
        pet = 3 * (labels == 2) + rng.normal(0, 0.5, labels.shape)
        image = np.stack([ct, pet], -1).astype(np.float32)
        name = f"case_{i:03d}.nii.gz"
        nib.save(nib.Nifti1Image(image, np.diag([2.5, 0.8, 0.8, 1])), root / "imagesTr" / name)
        nib.save(nib.Nifti1Image(labels, np.diag([2.5, 0.8, 0.8, 1])), root / "labelsTr" / name)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    listing = {"name": "Synthetic", "modality": {"0": "CT", "1": "PET"},
               "labels": {"0": "background", "1": "box", "2": "ball"},
               "numTraining": count, "training": training, "test": []}  # fmt: skip
    (root / "dataset.json").write_text(json.dumps(listing))


def test_the_list_splits_training_into_train_and_held_out_test(tmp_path):
    write_msd(tmp_path)
    listing = datalist.find(tmp_path)
    train, test = datalist.pairs(listing, "train"), datalist.pairs(listing, "test")
    assert len(train) == 8 and len(test) == 2 and not set(train) & set(test)
    assert [p[0].name for p in test] == ["case_004.nii.gz", "case_009.nii.gz"]
    content = json.loads(listing.read_text())
    content["validation"] = content["training"][:3]
    listing.write_text(json.dumps(content))
    assert len(datalist.pairs(listing, "train")) == 10 and len(datalist.pairs(listing, "test")) == 3
    content["training"][0] = {"image": "./imagesTr/nope.nii.gz", "label": "x"}
    listing.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"nope\.nii\.gz does not exist"):
        datalist.pairs(listing, "train")


@pytest.mark.timeout(300)
def test_decathlon_folder_on_two_depth_ranks_gives_the_one_rank_curve(tmp_path):
    write_msd(tmp_path / "Task01")
    opts = [*OPTS, f"data.name=nifti:{tmp_path / 'Task01'}"]
    runs = train_all({
        "one": (tmp_path / "one", [*opts, "parallel.ranks=1"]),
        "two": (tmp_path / "two", [*opts, "parallel.depth=2", "parallel.ranks=2"]),
        "seed": (tmp_path / "seed", [*opts, "parallel.ranks=1", "train.seed=1"]),
    })  # fmt: skip
    assert "2 ranks" in runs["two"].stdout
    one = curve(tmp_path / "one")
    assert len(one) == 4 and len(set(one)) == 4
    assert_curves_equal(curve(tmp_path / "two"), one)
    assert abs(curve(tmp_path / "seed")[-1] - one[-1]) > 1e-4  # negative control
    last = [max(records(tmp_path / r, "eval").items())[1] for r in ("one", "two")]
    assert last[0]["pixels"] == last[1]["pixels"] == 2 * 20 * 56 * 48  # the held-out cases
    for key in ("loss", "miou", "mdice"):
        assert last[1][key] == pytest.approx(last[0][key], rel=2e-4, abs=1e-5)
