"""``fallback="gather"`` under mpiexec: the hybrid network (global attention over H x W
tokens, space-to-depth) and the windowed one (an assertion on the block's height) split over
every rank's rows, uneven on 3 and 4 ranks, against the dense model; on one rank the region
is the dense model itself. The windowed one runs split, nothing gathered: its 16 rows in
blocks of whole windows of 4 (2 and 4 ranks) as they are, in blocks of 6 and 5 rows (3 ranks)
moved to whole windows (8, 4 and 4 rows) and back."""

from __future__ import annotations

import pytest

from cases import assert_triples
from fallback_cases import hybrid_parity


@pytest.mark.parametrize("net", ["hybrid", "windows"])
def test_refused_modules_run_on_whole_images_exactly(comm, net):
    triples, warned = hybrid_parity(comm, dict(rows=comm.size), net=net)
    assert_triples(triples)
    if net == "windows":
        assert not warned, warned  # its partition runs on the blocks
    else:
        assert comm.size == 1 or warned, "no module was gathered: the case proves nothing"
