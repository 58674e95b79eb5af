"""``parallelkit train`` on a folder read by blocks (``data.name=FORMAT:DIR``), as a user runs
it: each spatial rank reads only its block of every image and mask (the model takes blocks in:
``spatial_input="blocks"``), crops drawn at the same place on every rank. The loss curve and
the test metrics of 2 spatial ranks equal the 1-process ones: images (``.npy``, split over
rows) and volumes (NIfTI, split over depth); another seed's curve does not.
"""

from __future__ import annotations

import pytest
from runs import BLOCK_IMAGES as IMAGES
from runs import BLOCK_VOLUMES as VOLUMES
from runs import assert_curves_equal, curve, records, train_all
from runs import write_block_samples as _write

pytest.importorskip("monai")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "grid"), [("npy", "parallel.rows=2"), ("nifti", "parallel.depth=2")]
)
def test_two_spatial_ranks_reading_blocks_give_the_one_process_curve(tmp_path, kind, grid):
    _write(tmp_path / "data", kind)
    opts = [*(IMAGES if kind == "npy" else VOLUMES), f"data.name={kind}:{tmp_path / 'data'}"]
    runs = train_all({
        "one": (tmp_path / "one", [*opts, "parallel.ranks=1"]),
        "two": (tmp_path / "two", [*opts, "parallel.strategy=spatial", grid, "parallel.ranks=2"]),
        "seed": (tmp_path / "seed", [*opts, "parallel.ranks=1", "train.seed=1"]),
    })  # fmt: skip
    assert "2 ranks" in runs["two"].stdout
    one = curve(tmp_path / "one")
    assert len(one) == 4 and len(set(one)) == 4
    assert_curves_equal(curve(tmp_path / "two"), one)
    assert abs(curve(tmp_path / "seed")[-1] - one[-1]) > 1e-4  # negative control
    evals = [records(tmp_path / run, "eval") for run in ("one", "two")]
    last = [r[max(r)] for r in evals]
    # scored on the whole test samples (28^2 pixels, 20^3 voxels), not on crops
    assert last[0]["pixels"] == last[1]["pixels"] == 4 * (28**2 if kind == "npy" else 20**3)
    assert last[1]["loss"] == pytest.approx(last[0]["loss"], rel=2e-4, abs=1e-5)


@pytest.mark.timeout(300)
def test_precise_bn_is_the_average_of_the_batch_statistics(tmp_path):
    """``train.precise_bn=3``: the exported BatchNorm statistics are the plain average of the
    batch statistics of 3 training batches for the final weights, on 1 rank and on 2 spatial
    ranks alike; without it they are the training's moving averages (a negative control)."""
    import torch

    from parallelkit import models
    from parallelkit.data import build_loader
    from parallelkit.train import config

    _write(tmp_path / "data", "npy")
    opts = [*IMAGES, f"data.name=npy:{tmp_path / 'data'}", "train.precise_bn=3"]
    train_all({
        "one": (tmp_path / "one", [*opts, "parallel.ranks=1"]),
        "two": (tmp_path / "two", [*opts, "parallel.strategy=spatial", "parallel.rows=2",
                                   "parallel.ranks=2"]),
        "off": (tmp_path / "off", [*opts[:-1], "parallel.ranks=1"]),
    })  # fmt: skip
    cfg = config.load(str(tmp_path / "one" / "config.yaml"))
    dense = models.create("unet", num_classes=3, in_channels=1, widths=(4, 8, 16, 32))
    weights = torch.load(tmp_path / "one" / "model.pt")
    dense.load_state_dict(weights)
    norms = [m for m in dense.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    loader = build_loader(cfg.data, "train", rank=0, size=1, batch_size=4, seed=0)
    assert len(loader) == 2  # 3 batches take two passes, each in an order of its own
    used, epoch = 0, 1 << 20
    with torch.no_grad():
        while used < 3:
            loader.set_epoch(epoch)
            for x, _ in loader:
                dense.train()(x)
                used += 1
                if used == 3:
                    break
            epoch += 1
    want = dense.state_dict()
    two, off = (torch.load(tmp_path / run / "model.pt") for run in ("two", "off"))
    keys = [k for k in want if "running" in k]
    assert keys
    for k in keys:
        torch.testing.assert_close(weights[k], want[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two[k], want[k], rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(off[k], want[k], rtol=1e-3) for k in keys)
