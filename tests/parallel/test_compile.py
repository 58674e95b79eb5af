"""``torch.compile`` of ``pk.parallelize``'s models on gloo: few graphs, the eager numbers.

On torch.distributed backends the collectives go through torch's functional collectives while
dynamo traces (``parallelkit.comm.traced``), so a parallelized ResNet compiles into as few
graphs as torch's DDP does (data, channel); a spatial region runs eager under compile
(docs/design.md, "Compiled steps"), so nothing of it is traced. The compiled step
(forward, backward, two SGD steps) gives the eager outputs, gradients and running statistics
in float64. A compiled halo exchange that drops its messages must not match (the parity is
not vacuous).
"""

from __future__ import annotations

import pytest
from compile_cases import compiled_against_eager, ddp_graphs

from cases import assert_triples, mismatches

# data and channel: no more graphs than DDP. A spatial region runs eager under compile: its
# guard records blocks by tensor identity, on which dynamo guards, and compiling it (46 graphs
# for ResNet-18 here) recompiled every layer each step; the whole step is the region here.
GOAL = {"data": "ddp", "channel": "ddp", "spatial": 0}


@pytest.fixture(scope="module")
def ddp_bound(ranks) -> int:
    """DDP's graph count, the bound of data and channel: the same for both, so traced once."""
    return ranks(2).run(ddp_graphs, timeout=300)[0]


@pytest.mark.parametrize("strategy", ["data", "channel", "spatial"])
def test_compiled_steps_are_few_graphs_and_give_the_eager_numbers(request, ranks, strategy):
    """One compile per strategy: its graph count (dynamo's backend calls in the first
    forward, as ``torch._dynamo.explain`` counts them) and its numbers."""
    pool = ranks(2)
    goal = GOAL[strategy]
    bound = request.getfixturevalue("ddp_bound") if goal == "ddp" else goal
    for triples, graphs in pool.run(compiled_against_eager, strategy, timeout=600):
        assert_triples(triples)
        assert graphs <= bound, (graphs, bound)


def test_a_compiled_halo_exchange_that_drops_its_rows_does_not_match(ranks):
    for triples, _ in ranks(2).run(compiled_against_eager, "spatial", "small", True, timeout=300):
        bad = mismatches([(label, got, want, {}) for label, got, want in triples])
        assert bad, "dropping every halo changed nothing: the parity test proves nothing"
