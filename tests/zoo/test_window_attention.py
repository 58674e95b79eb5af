"""Window attention runs split, not gathered: Swin's windows folded into the batch
on each rank's block, whole windows per rank, the attention mask cut to this rank's windows.

``test_zoo.py`` holds these networks exact against the dense model (EXPECTED); here each
runs once more under its spatial strategy on 2 ranks to show what it costs: no module
gathered, and no rank saving for backward a tensor near the size of the dense model's largest
(a whole sample's feature map). Split in two, the largest is about half of it.
"""

from __future__ import annotations

import pytest

from zoo_parity import largest_saved
from zoo_run import CASE_TIMEOUT_S

# tv swin 40: blocks that are not whole windows, so rows move to whole windows and back
WINDOWED = {"tv swin": "rows", "tv swin3d": "depth", "monai SwinUNETR 2-D": "rows",
            "tv swin 40": "rows"}  # fmt: skip


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_window_attention_holds_no_whole_sample(pools, arch):
    reports = pools(2).run(largest_saved, arch, WINDOWED[arch], timeout=CASE_TIMEOUT_S)
    measured = [r for r in reports if r["outcome"] == "measured"]
    assert len(measured) == 2, reports
    for r in measured:
        assert r["gathered"] == [], r
        assert 0 < r["split"] <= 0.6 * r["dense"], r
