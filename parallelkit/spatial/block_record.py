"""The guard's record of blocks: which tensors are this rank's block of split samples, where
their spatial dimensions are, the whole samples' size, and how a window partition folded them.

:class:`~parallelkit.spatial.guard.SpatialGuard` keeps this record while a spatial region runs
and marks every block a rule or a layer returns; the rules read it through the guard
(``g.places(x)``, ``g.marked(y)``: the :class:`~parallelkit.spatial.rules.registry.Guard`
protocol), the spatial layers through :mod:`parallelkit.spatial.record`. The torch function
mode, the module stack and the lookup stay in the guard. The legend (blocks, whole tensors,
``places``, folds) is the guard's module docstring's.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_leaves

from parallelkit.spatial.rules.registry import Fold, Places, Size, standard
from parallelkit.spatial.rules.tokens import count, own_tokens, token_dim
from parallelkit.spatial.token_comm import prefixed


class BlockRecord:
    """The record of blocks (see the module docstring). The guard that derives from it sets
    what it reads when it is made (``SpatialGuard.__init__`` says what each holds)."""

    _blocks: dict[int, tuple[weakref.ref, Places, Size | None, tuple[Fold, ...]]]
    size_now: Size | None
    folds_now: tuple[Fold, ...]
    read_sizes: set[Size]
    _prefixes: bool

    def is_split(self, t: Any) -> bool:
        entry = self._blocks.get(id(t)) if isinstance(t, Tensor) else None
        return entry is not None and entry[0]() is t

    def places(self, t: Tensor) -> Places:
        """Where block ``t``'s spatial dimensions are, counted from the end."""
        return self._blocks[id(t)][1]

    def size_of(self, t: Tensor) -> Size | None:
        """The whole samples' spatial size of block ``t``, if known: it travels from the
        region's input through every rule and layer, so spatial layers need no size
        all-gather."""
        return self._blocks[id(t)][2] if self.is_split(t) else None

    def folds(self, t: Tensor) -> tuple[Fold, ...]:
        """The spatial dimensions of block ``t`` folded with others into one dimension (a
        window partition), each fold's factors outermost first; () for none."""
        return self._blocks[id(t)][3] if self.is_split(t) else ()

    def batched(self, t: Tensor) -> bool:
        """Whether block ``t``'s spatial dimensions are all folded into its first dimension,
        the batch (``layout.batched``)."""
        return self.is_split(t) and all(t.dim() + d == 0 for d in self.places(t))

    def batch_fold(self, batch: int, count: int) -> tuple[Tensor, Fold] | None:
        """The newest live block whose first dimension is a fold of the batch (``batch``) and
        spatial factors of ``count`` whole places (a window partition's windows), and that
        fold; None if there is none."""
        for ref, places, _, folds in reversed(self._blocks.values()):
            t = ref()
            for fold in folds if t is not None else ():
                spatial = [k for _, k in fold[1:]]
                if (fold[0] == (batch, None) and spatial and None not in spatial
                        and math.prod(n for n, _ in fold[1:]) == count
                        and places[spatial[0]] == -t.dim()):  # fmt: skip
                    return t, fold
        return None

    def trailing(self, t: Tensor) -> int:
        """How many dimensions follow block ``t``'s spatial ones, which come right after
        (N, C) (``layout.trailing``)."""
        if not self.is_split(t) or self.folds(t):
            return 0
        places = self.places(t)
        first, last = min(places), max(places)
        if last == -1 or t.dim() + first != 2 or places != tuple(range(first, last + 1)):
            return 0
        return -last - 1

    def tokens(self, t: Tensor) -> tuple[Tensor, int] | None:
        """This rank's whole token indices and the whole count of block ``t``, where its last
        dimension holds all its spatial dimensions (``layout.tokens``); None for a signal's
        own (N, C, L) block, whose last dimension is its one spatial dimension as it is."""
        if token_dim(self, t) != -1 or (not self.folds(t) and self.places(t) == standard(t)):
            return None
        return own_tokens(self, t), count(self, t)

    def form(self, t: Tensor) -> tuple[Places, tuple[Fold, ...]]:
        """Where block ``t``'s spatial dimensions are and how they are folded: two blocks of
        one form line up element for element, so an operation between them is local."""
        entry = self._blocks[id(t)]
        return entry[1], entry[3]

    def mark(
        self,
        *tensors: Any,
        places: Places | None = None,
        size: Size | None = None,
        folds: tuple[Fold, ...] = (),
    ) -> None:
        """Record ``tensors`` as blocks whose spatial dimensions are ``places`` (default: every
        one after N and C), folded as ``folds`` says."""
        single = len(tensors) == 1 and isinstance(tensors[0], Tensor)  # no tree to walk
        if folds and not self._prefixes:
            self._prefixes = prefixed(folds)
        for t in tensors if single else tree_leaves(tensors):
            if isinstance(t, Tensor) and t.dim() >= (-min(places) if places else 3):
                self._blocks[id(t)] = (weakref.ref(t), places or standard(t), size, folds)

    def marked(
        self,
        out: Any,
        places: Places | None = None,
        size: Size | None = None,
        folds: tuple[Fold, ...] | None = None,
    ) -> Any:
        """``out`` (any nesting) recorded as blocks, of the whole size and folds of the call's
        first block unless ``size`` and ``folds`` say otherwise (folds name spatial
        dimensions, not places: a rule that moves the places moves the folds)."""
        folds = self.folds_now if folds is None else folds
        self.mark(out, places=places, size=size or self.size_now, folds=folds)
        return out

    def note_sized(self, size: Size) -> None:
        """Remember that forward code read the whole spatial ``size`` of a block: a whole
        tensor interpolated to it, or a constant made in it, is cut into blocks
        (:mod:`parallelkit.spatial.rules.resize`, ``.pointwise``)."""
        self.read_sizes.add(tuple(size))
