"""Memory per rank of a 3-D U-Net training step on volumes read by blocks from a zarr store,
and the largest cube that trains within a per-rank memory budget, on 1 rank and on P ranks
splitting each volume over depth.

    python examples/segmentation_volumes/measure.py memory                    # table 1
    python examples/segmentation_volumes/measure.py budget                    # table 2
    python examples/segmentation_volumes/measure.py memory --sides 32 --ranks 1 2 \
        --out-dir /tmp/vol                                                    # a smoke test

One step is what ``parallelkit train train.task=segment data.name=zarr:DIR data.dims=3`` does
on a batch of one volume: this rank's depth slab of a generated shapes3d volume and of its mask,
read from a zarr store (written once per side under ``--store-dir``, ``runs/stores`` by
default), MONAI's 3-D U-Net (``monai.networks.nets.UNet``: channels ``--width`` x 1, 2, 4, 8,
strides 2, 2, 2, BatchNorm; 3 classes), per-voxel cross-entropy on this rank's slab of the
logits, backward, an SGD step. One rank runs the plain torch model on the whole volume; P ranks
run ``pk.parallelize(model, grid, grid, spatial_input="blocks", spatial_output="blocks")`` over
a grid of P depth blocks, each passing only its slab: no rank holds a whole volume.

What is measured and how the budget is enforced: ``examples/common/block_measure.py``, shared
with ``examples/segmentation_large_images/measure.py``. Results: ``memory.md``/``.json`` and
``budget.md``/``.json`` in ``--out-dir`` (this folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from block_measure import Setup, main  # noqa: E402

SETUP = Setup(
    name="segmentation_volumes", dims=3, model="monai:UNet", classes=3, channels=1,
    sides=(128, 256), ranks=(1, 2, 4, 8), budget_ranks=(1, 8), budget_mib=1024,
    lo=64, hi=512, multiple=8, width=8,
)  # fmt: skip

if __name__ == "__main__":
    main(SETUP, __doc__, HERE)
