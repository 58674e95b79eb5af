"""The spatial guard itself, without processes: what it follows and what it does not, and its
registry of rules against the docs. Each family's rules are tried one operation at a time in
tests/spatial/rules/test_<family>.py; whole networks under the guard, on 2-4 ranks, in
tests/parallel/test_parallelize.py.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial.guard import SpatialGuard
from spatial.rules.rows import X, guarded


def test_whole_tensors_alone_are_not_followed():
    guard, _ = guarded()
    w = torch.randn(3, 3)
    with guard:
        y = (w @ w).flatten()  # nothing split: no rule applies
    assert not guard.is_split(y)


def test_negative_control_an_unmarked_input_is_not_checked():
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    with guard:
        y = X.flatten(1)  # X was never marked as a block: the guard cannot know
    assert not guard.is_split(y)


def test_the_docs_table_is_the_registry():
    """docs/parallelism.md holds the operations table generated from the rules' registry."""
    from pathlib import Path

    from parallelkit.spatial.rules import docs_table
    from parallelkit.spatial.rules.__main__ import in_docs

    docs = Path(__file__).parents[2] / "docs" / "parallelism.md"
    assert in_docs(docs.read_text()) == docs_table(), (
        "regenerate: python -m parallelkit.spatial.rules --write docs/parallelism.md"
    )


def test_every_rule_has_a_docstring_and_one_family():
    from parallelkit.spatial.rules import docs_rows

    families = {"pointwise", "views", "indexing", "reductions", "windows", "pooling", "padding",
                "norms", "resize", "random", "tokens"}  # fmt: skip
    for family, ops, what, exact in docs_rows():
        assert family in families and what and exact in ("yes", "refused"), (family, ops)
