"""``fallback="gather"`` under mpiexec: the hybrid network (global attention over H x W
tokens, space-to-depth) and the windowed one (an assertion on the block's height) split over
every rank's rows, uneven on 3 and 4 ranks, against the dense model; on one rank the region
is the dense model itself."""

from __future__ import annotations

import pytest

from cases import assert_triples
from fallback_cases import hybrid_parity


@pytest.mark.parametrize("net", ["hybrid", "windows"])
def test_refused_modules_run_on_whole_images_exactly(comm, net):
    triples, warned = hybrid_parity(comm, dict(rows=comm.size), net=net)
    assert_triples(triples)
    assert comm.size == 1 or warned, "no module was gathered: the case proves nothing"
