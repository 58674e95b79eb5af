"""Writing each rank's block of an output so that no two ranks write one chunk at once: the
chunks inside a block at once, the chunks it shares with a neighbour in turns. Prediction and
the pyramid's lower levels write this way."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelkit.data.axes import Block


def write_in_turns(comm, axes, size: Sequence[int], block: Block, output: Any,
                   classes: np.ndarray, probs: np.ndarray | None) -> None:
    """Write this rank's block so that no two ranks write one chunk at once.

    The chunks wholly inside the block are written at once by every rank; the parts of chunks
    shared with a neighbour are written in ``2 ** split dimensions`` turns, by the parity of
    the block's coordinates (two blocks sharing a chunk are neighbours along some dimension,
    so their parities differ there), with a barrier between turns.
    """
    split = [d for d, (_, parts, _) in enumerate(axes) if parts > 1]
    if output.chunks is None or not split:
        output.write(block, classes, probs)
        return
    own, shared = boxes(block, size, output.chunks)
    for box in own:
        _write_box(output, block, box, classes, probs)
    parity = sum(((axes[d][2] % 2) << i) for i, d in enumerate(split))
    for turn in range(2 ** len(split)):
        comm.barrier()
        if turn == parity:
            for box in shared:
                _write_box(output, block, box, classes, probs)
    comm.barrier()


def boxes(block: Block, size: Sequence[int], chunks: Sequence[int],
          ) -> tuple[list[Block], list[Block]]:
    """``block`` cut into boxes made of whole chunks (no other block touches them) and boxes in
    chunks that a neighbouring block shares; together they tile ``block``."""
    per_dim = []
    for s, n, c in zip(block, size, chunks, strict=True):
        a, b = s.start, s.stop
        inner_a = -(-a // c) * c
        inner_b = b if b == n else b // c * c
        if inner_a < inner_b:
            pieces = [(slice(a, inner_a), True), (slice(inner_a, inner_b), False),
                      (slice(inner_b, b), True)]
        else:
            pieces = [(slice(a, b), True)]
        per_dim.append([(p, sh) for p, sh in pieces if p.stop > p.start])
    own, shared = [], []
    for combo in itertools.product(*per_dim):
        box = tuple(p for p, _ in combo)
        (shared if any(sh for _, sh in combo) else own).append(box)
    return own, shared


def _write_box(output: Any, block: Block, box: Block, classes: np.ndarray,
               probs: np.ndarray | None) -> None:
    local = tuple(slice(p.start - s.start, p.stop - s.start) for p, s in zip(box, block,
                                                                          strict=True))
    output.write(box, classes[local], None if probs is None else probs[(slice(None), *local)])
