"""OME-Zarr slide pyramids trained at a pyramid level, as a pathology user would
(``data.name=zarr:DIR data.level=1``): 2 ranks splitting rows give the 1-rank curve, and the
test samples are scored whole at that level."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from runs import assert_curves_equal, curve, records, train_all

from parallelkit.data.shapes import ShapesDataset

OPTS = [
    "train.task=segment", "data.num_classes=3", "data.channels=3", "data.image_size=[24,16]",
    "data.level=1", "data.flips=[0,1]", "train.batch_size=4", "train.max_steps=3",
    "train.log_every=1", "train.progress=false", "train.tensorboard=false", "train.plot=false",
    "optim.lr=0.2", "model.width=4",
]  # fmt: skip


def write_pyramid(path, a: np.ndarray) -> None:
    """An OME-Zarr 0.5 image group of 2 levels: ``s0`` (C, H, W) or (H, W), ``s1`` halved."""
    g = zarr.open_group(path, mode="w")
    axes = ([{"name": "c", "type": "channel"}] if a.ndim == 3 else []) + [
        {"name": "y", "type": "space"}, {"name": "x", "type": "space"}]  # fmt: skip
    for name, level in (("s0", a), ("s1", a[..., ::2, ::2])):
        g.create_array(name, shape=level.shape, dtype=level.dtype, chunks=(3, 16, 16)[-a.ndim :])
        g[name][...] = level
    g.attrs["ome"] = {"version": "0.5", "multiscales": [
        {"axes": axes, "datasets": [{"path": "s0"}, {"path": "s1"}]}]}  # fmt: skip


@pytest.mark.timeout(300)
def test_level_1_of_slides_on_two_row_ranks_gives_the_one_rank_curve(tmp_path):
    root = tmp_path / "slides"
    for split, count, base in (("train", 8, 0), ("test", 2, 1000)):
        scenes = ShapesDataset(count, image_size=64, channels=3, num_classes=3, base=base)
        for folder in ("images", "masks"):
            (root / split / folder).mkdir(parents=True)
        for i in range(count):
            image, mask = scenes[i]
            write_pyramid(root / split / "images" / f"s{i}.ome.zarr", image.numpy())
            write_pyramid(root / split / "masks" / f"s{i}.ome.zarr", mask.numpy().astype("u1"))
    opts = [*OPTS, f"data.name=zarr:{root}"]
    train_all({
        "one": (tmp_path / "one", [*opts, "parallel.ranks=1"]),
        "two": (tmp_path / "two", [*opts, "parallel.rows=2", "parallel.ranks=2"]),
        "zero": (tmp_path / "zero", [*opts, "parallel.ranks=1", "data.level=0"]),
    })  # fmt: skip
    one = curve(tmp_path / "one")
    assert len(one) == 3 and len(set(one)) == 3
    assert_curves_equal(curve(tmp_path / "two"), one)
    assert abs(curve(tmp_path / "zero")[0] - one[0]) > 1e-4  # level 0 is other data
    last = [max(records(tmp_path / r, "eval").items())[1] for r in ("one", "two", "zero")]
    assert last[0]["pixels"] == last[1]["pixels"] == 2 * 32 * 32  # whole test samples, level 1
    assert last[2]["pixels"] == 2 * 64 * 64
    assert last[1]["loss"] == pytest.approx(last[0]["loss"], rel=2e-4, abs=1e-5)
