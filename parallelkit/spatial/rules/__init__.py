"""The spatial rules: how each torch operation runs on blocks of split images, exactly.

One module per family of operations, each rule a plain function registered for the torch
functions it serves (:mod:`.registry`); the spatial guard (``parallelkit.spatial.
guard``) looks a call up here and refuses what has no rule.

- :mod:`.pointwise`: activations, arithmetic, type changes; whole tensors meeting blocks;
- :mod:`.views`: views, reshapes, permutes, repeats, and reads of a block's shape (the whole
  samples');
- :mod:`.indexing`: cat, stack, split, narrow, select, indexing and index assignment;
- :mod:`.forms` (no rules): whole tensors cut to blocks, blocks moved between layouts or
  gathered whole;
- :mod:`.reductions`: sums, means, extremes, norms and variances over H and W, or over others;
- :mod:`.windows`: functional convolution and unfolds (halo fetches);
- :mod:`.pooling`: functional pooling, adaptive pooling and max unpooling (halo fetches);
- :mod:`.padding`: pads, rolls and flips (rows fetched from whoever holds them);
- :mod:`.norms`: group, instance and layer norm, linear layers over channels, attention within
  windows;
- :mod:`.tokens`: global attention, sums over tokens and linear maps over the token axis
  (collectives: gathered keys, the head all-to-all, all-reduces);
- :mod:`.resize`: interpolation;
- :mod:`.random`: dropout masks.
"""

from parallelkit.spatial.rules import (  # noqa: F401 (each registers its rules)
    indexing,
    norms,
    padding,
    pointwise,
    pooling,
    random,
    reductions,
    resize,
    tokens,
    views,
    windows,
)
from parallelkit.spatial.rules.registry import (
    Call,
    Guard,
    Rule,
    docs_rows,
    docs_table,
    lookup,
    op_name,
    rule,
    rules,
)

__all__ = [
    "Call", "Guard", "Rule", "docs_rows", "docs_table", "lookup", "op_name", "rule", "rules",
]  # fmt: skip
