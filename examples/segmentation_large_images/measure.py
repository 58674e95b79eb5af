"""Memory per rank of a U-Net training step on large images read by blocks from a zarr store,
and the largest image that trains within a per-rank memory budget, on 1 rank and on P ranks
splitting each image by rows.

    python examples/segmentation_large_images/measure.py memory               # table 1
    python examples/segmentation_large_images/measure.py budget               # table 2
    python examples/segmentation_large_images/measure.py memory --sides 128 --ranks 1 2 \
        --out-dir /tmp/seg                                                    # a smoke test

One step is what ``parallelkit train train.task=segment data.name=zarr:DIR`` does on a batch
of one image: this rank's rows of a generated shapes scene and of its mask, read from a zarr
store (written once per side under ``--store-dir``, ``runs/stores`` by default), the library's
U-Net (``--width`` channels in the first stage, 4 classes), per-pixel cross-entropy on this
rank's rows of the logits, backward, an SGD step. One rank runs the plain torch model on the
whole image; P ranks run ``pk.parallelize(model, grid, grid, spatial_input="blocks",
spatial_output="blocks")``, each passing only its rows: no rank holds a whole image.

What is measured and how the budget is enforced: ``examples/common/block_measure.py``, shared
with ``examples/segmentation_volumes/measure.py``. Results: ``memory.md``/``.json`` and
``budget.md``/``.json`` in ``--out-dir`` (this folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from block_measure import Setup, main  # noqa: E402

SETUP = Setup(
    name="segmentation_large_images", dims=2, model="unet", classes=4, channels=3,
    sides=(1024, 2048), ranks=(1, 2, 4), budget_ranks=(1, 4), budget_mib=1536,
    lo=512, hi=3072, multiple=32, width=8,
)  # fmt: skip

if __name__ == "__main__":
    main(SETUP, __doc__, HERE)
