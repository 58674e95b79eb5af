"""The spatial guard: every operation on a block of split images is exact, or it is refused.

Under spatial parallelism the leaf layers that read neighbouring pixels (convolution, pooling,
upsampling, BatchNorm statistics) are swapped for spatial ones. But the operations that decide
correctness also live in forward code that swapping never sees: ``x * gate`` in an SE block,
``x.mean((2, 3))``, ``torch.cat``, a parameter used directly, ``F.interpolate``. While a
:class:`~parallelkit.spatial.region.SpatialRegion` runs, this guard (a torch function mode) sees
every torch call and keeps the record of which tensors are this rank's block of the split
images. A call that touches a block goes to its rule in the registry
(:mod:`parallelkit.spatial.rules`, one module per family of operations); a call without a rule
is refused with a ``ValueError`` naming the operation, the module and the ways out. Every rank
runs the same code on the same shapes of blocks, so every rank refuses at the same operation,
and none waits in a collective. Inside the swapped layers (and SyncBatchNorm, keep_dense
modules) there is nothing to check: their outputs are blocks when their inputs were. The guard
takes itself off torch's mode stack while such a layer runs, so that their many small
operations pay nothing for it (a mode's Python handler costs microseconds per call, which on a
fast device is more than the operation).

This module keeps only that: the mode, the module stack, the lookup and the refusal; the
record of blocks is its base class (:class:`~parallelkit.spatial.block_record.BlockRecord`).
docs/parallelism.md has the table of every rule (generated from the registry).

Legend: a *block* is this rank's (N, C, *spatial) part of split samples (signals, images,
volumes); a *whole* tensor is the same on every rank of the spatial group. ``places`` is
where a block's spatial dimensions are, counted from the end: (-2, -1) for (N, C, H, W),
(-3, -2) after ConvNeXt's permute to (N, H, W, C), (-3, -2, -1) for (N, C, D, H, W). A window
partition folds spatial dimensions into one (Swin's (B * nH * nW, ws * ws, C)): several share
a place, and the record keeps the fold's factors (``folds``;
:mod:`parallelkit.spatial.rules.views`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode

from parallelkit.comm import Communicator
from parallelkit.spatial import record
from parallelkit.spatial.block_record import BlockRecord, Size
from parallelkit.spatial.blocks import takes_blocks
from parallelkit.spatial.fallback import gather_inputs, gathered_message, scatter_outputs
from parallelkit.spatial.grid import SpatialGrid, grid_of
from parallelkit.spatial.refusal import SpatialRefusal, model_failure, refusal
from parallelkit.spatial.rules import Call, lookup, op_name
from parallelkit.spatial.rules.registry import Fold, Places, standard
from parallelkit.spatial.token_comm import prefixed

WHOLE = ("whole",)
"""A layer's form whose output is whole (a pooling over a block's tokens)."""
TRAILING = "trailing"
"""In a layer's form: a convolution over the spatial dimensions of a block that has others
after them (its output's spatial size from its windows)."""


class SpatialGuard(TorchFunctionMode, BlockRecord):
    """Follows blocks of split images through one forward of ``model`` (see the module
    docstring); ``comm`` is the spatial group, over which whole tensors' gradients are summed,
    ``whole_comm`` the data group (BatchNorm on whole tensors), ``shares`` the region's
    gradient convention (:mod:`parallelkit.spatial.record`)."""

    def __init__(
        self,
        model: nn.Module,
        comm: Communicator,
        grid: SpatialGrid | None = None,
        whole_comm: Communicator | None = None,
        shares: bool = False,
        gathered: set[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.comm, self._grid, self.whole_comm, self.shares = comm, grid, whole_comm, shares
        # Modules to run on gathered whole images (fallback="gather"), and how many now run.
        self.gathered, self._gathering = gathered or set(), 0
        self.warned: set[Any] = set()  # what warn_once warned of (a region keeps one set)
        self.weights: dict[tuple, Any] = {}  # resampling weights, once per shape and arguments
        self.names = {m: name for name, m in model.named_modules()}
        # id -> (the block, where its spatial dimensions are, the whole size if known, folds)
        self._blocks: dict[int, tuple[weakref.ref, Places, Size | None, tuple[Fold, ...]]] = {}
        self.size_now: Size | None = None  # the whole size of the call being ruled on
        self.folds_now: tuple[Fold, ...] = ()  # and its folds
        self.read_sizes: set[Size] = set()  # whole sizes of blocks whose shape code read
        # (module, trusted, given blocks, their size, a gathered one's layout, given folds)
        self._stack: list[tuple[nn.Module, bool, bool, Size | None, Any, bool, Any] | None] = []
        self._restore: dict[int, tuple[Any, Any]] = {}
        self._trusted = 0
        self._off_stack: nn.Module | None = None  # the trusted layer we stepped aside for
        self._prefixes = False  # whether a token fold with a prefix was ever marked

    # ------------------------------------------------------------------ what rules ask of it
    @property
    def grid(self) -> SpatialGrid:
        if self._grid is None:
            self._grid = grid_of(self.comm)
        return self._grid

    def summed(self, t: Any) -> Any:
        """A whole tensor acting on blocks: identity forward, gradient summed over the group
        (where gradients are shares, nothing to do: ``record.replicated``)."""
        if isinstance(t, Tensor) and t.requires_grad and not self.is_split(t):
            return record.replicated(t, self.comm)
        return t

    def module(self, with_blocks: bool = False) -> nn.Module | None:
        """The innermost module of the model whose forward is running (that was given blocks
        of split images, if asked)."""
        entries = (e for e in reversed(self._stack) if e is not None and (e[2] or not with_blocks))
        return next((e[0] for e in entries), None)

    def warn_once(self, key: Any, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=3)

    @contextlib.contextmanager
    def rules(self) -> Iterator[None]:
        """This guard's rules again, for operations written out inside a rule (the handler
        runs with the mode popped); the hooks and the record stay as they are."""
        TorchFunctionMode.__enter__(self)
        try:
            yield
        finally:
            TorchFunctionMode.__exit__(self, None, None, None)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No rules: calls run as they are (moving whole tensors and blocks between forms)."""
        self._trusted += 1
        try:
            yield
        finally:
            self._trusted -= 1

    # ------------------------------------------------------------------ entering and leaving
    def __enter__(self) -> SpatialGuard:
        install_hooks()
        record.push(self)
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaves the mode; a model's own error on blocks leaves as a refusal (not one raised
        inside a gathered module, which computes on whole tensors)."""
        if self._off_stack is not None:  # an error inside a trusted layer: back on, to leave
            self._off_stack = None
            torch._C._push_on_torch_function_stack(self)
        super().__exit__(exc_type, exc, tb)
        record.pop()
        if exc is not None and not isinstance(exc, SpatialRefusal) and not self._gathering:
            refused = model_failure(self.names, self.module(with_blocks=True), exc)
            if refused is not None:
                raise refused from exc

    def _enter_module(self, module: nn.Module, args: tuple) -> tuple | None:
        if self._trusted or module not in self.names:
            self._stack.append(None)
            return None
        whole = None  # a gathered module's input blocks' layout: (places, ndim)
        if module in self.gathered and (blocks := self._blocks_in(args, {})):
            if any(self.folds(b) for b in blocks):  # gather the module that folded them
                outer = next((e[0] for e in reversed(self._stack) if e and e[2] and not e[5]),
                             None)  # fmt: skip
                raise self.refuse(type(module).__name__, "it is to be gathered, and is given "
                                  "spatial dimensions folded with others (a flatten, a window "
                                  "partition)", outer)  # fmt: skip
            whole, args = (self.places(blocks[0]), blocks[0].dim()), gather_inputs(self, args)
            self._gathering += 1
        # A layer that says how it handles blocks (parallelkit.spatial.blocks) runs as it is.
        kind = takes_blocks(module)
        trusted, ends = kind is not None, kind == "ends"
        blocks = self._blocks_in(args, {})
        if kind == "norm" and not blocks and self.comm.size > 1:
            self._normalize_whole(module)
        self._trusted += trusted
        if trusted and self._off_stack is None and self._on_top():
            torch._C._pop_torch_function_stack()  # nothing to rule on inside: step aside
            self._off_stack = module
        # A pointwise convolution's input form, which its output keeps; read while trusted
        # (no rule runs for the shapes it reads). A refusal here ends this guard's forward.
        form = self._layer_form(module, blocks) if trusted and blocks else None
        size = self.size_of(blocks[0]) if blocks else None
        folded = any(self.folds(b) for b in blocks)
        self._stack.append((module, trusted, bool(blocks) and not ends, size, whole, folded,
                            form))  # fmt: skip
        return args if whole else None

    def _layer_form(self, module: nn.Module, blocks: list[Tensor]) -> Any:
        """None for (N, C, *spatial) blocks, which every layer that takes blocks takes; the
        form of one block in another form (its output keeps it) that a pointwise convolution
        is given with the spatial dimensions after the channels, a convolution or pooling
        with all of them folded into the batch (TNT's patches, SAM2's pooled windows: it
        covers each patch's own pixels, as dense; ``windows_in_batch``), or a norm with none
        in the channels (LeViT's BatchNorm1d over (N * L, C): a per-channel statistic over
        every other dimension, merged over the ranks as for an image); otherwise the
        refusal."""
        if all(self.places(b) == standard(b) and not self.folds(b) for b in blocks):
            return None
        places = [blocks[0].dim() + d for d in self.places(blocks[0])]
        pointwise = getattr(module, "pointwise", False) and all(p >= 2 for p in places)
        norm = takes_blocks(module) == "norm" and blocks[0].dim() >= 2 and 1 not in places
        batched = getattr(module, "windows_in_batch", False) and self.batched(blocks[0])
        if len(blocks) == 1 and getattr(module, "over_tokens", False) and self.tokens(blocks[0]):
            return WHOLE  # a pooling over the flattened tokens: its output is whole
        over = getattr(module, "over_trailing", None)
        if len(blocks) == 1 and over is not None and over(self.trailing(blocks[0])):
            return (*self.form(blocks[0]), TRAILING)  # a window of 1 after the spatial ones
        if len(blocks) != 1 or not (pointwise or norm or batched):
            raise self.refuse(type(module).__name__, "it wants (N, C, *spatial) blocks", module)
        return self.form(blocks[0])

    def _leave_module(self, module: nn.Module, args: tuple, out: Any) -> Any:
        entry = self._stack.pop()
        if entry is None:
            return None
        _, trusted, blocks_out, size, whole, _, form = entry
        if id(module) in self._restore:
            module.use_communicators(*self._restore.pop(id(module)))
        if trusted:  # marked while no rule runs (still trusted, or stepped aside)
            if form is WHOLE:
                pass
            elif form is not None:  # the spatial size a convolution's windows make of it
                if TRAILING in form and size:
                    size = tuple(w.out_size(n) for w, n in zip(module.windows, size, strict=False))
                self.mark(out, places=form[0], size=size, folds=form[1])
            elif blocks_out:  # a spatial layer's output size from its geometry; norms keep it
                out_size = module.out_size(size) if size and hasattr(module, "out_size") else size
                self.mark(out, size=out_size)
            self._trusted -= 1
            if self._off_stack is module:
                self._off_stack = None
                torch._C._push_on_torch_function_stack(self)
        if whole is not None:
            self._gathering -= 1
            self.warn_once(module, gathered_message(self.names[module], module, args, out))
            return scatter_outputs(self, out, *whole)
        return None

    def _on_top(self) -> bool:
        """Whether this guard is the innermost torch function mode (so it may step aside)."""
        n = torch._C._len_torch_function_stack()
        return n > 0 and torch._C._get_function_stack_at(n - 1) is self

    def _normalize_whole(self, module: nn.Module) -> None:
        """BatchNorm on a whole tensor (DeepLab's pooled branch): every rank of the spatial
        group holds the same samples, so statistics go over the data group only, and each
        rank's parameter gradient is already the dense one (or, under shares, a share of it)."""
        if self.whole_comm is None:
            raise self.refuse(
                "BatchNorm", "its input is whole (not a block) and this region has no data "
                "group to normalize it over", module,
            )  # fmt: skip
        self._restore[id(module)] = module.communicators()
        module.use_communicators(self.whole_comm, None)

    # ------------------------------------------------------------------ the lookup
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self._trusted:
            return func(*args, **kwargs)
        entry = lookup(func)
        blocks, bare = self._scan(args, kwargs)
        if not blocks and not (entry is not None and entry.whole and not self._gathering):
            return func(*args, **kwargs)
        if entry is None:
            raise self.refuse(op_name(func), "it has no exact rule for blocks of split images")
        if self._prefixes and not entry.prefix and self._any_prefixed(blocks):
            raise self.refuse(op_name(func), "it is given tokens with a class token before "
                              "them (a prefix held by the first rank), which only pointwise, "
                              "linear, attention, layer-norm and token reductions, reshapes "
                              "that keep the tokens, and indexing that takes the class token "
                              "or the rest take")  # fmt: skip
        if not entry.folds and any(self._blocks[id(b)][3] for b in blocks):
            raise self.refuse(op_name(func), "it is given a window partition (spatial "
                              "dimensions folded into one), which only reshapes, permutes, "
                              "pointwise, linear and attention operations take")  # fmt: skip
        before = self.size_now, self.folds_now
        first = self._blocks[id(blocks[0])] if blocks else (None, None, None, ())
        self.size_now, self.folds_now = first[2], first[3]
        try:
            call = Call(func, args, kwargs, blocks, bare=bare)
            return entry.fn(self, entry.normalize(self, call))
        finally:
            self.size_now, self.folds_now = before

    def _any_prefixed(self, blocks: list[Tensor]) -> bool:
        return any(prefixed(self._blocks[id(b)][3]) for b in blocks)

    def _blocks_in(self, args: tuple, kwargs: dict) -> list[Tensor]:
        """The blocks among the arguments (tensors, and tensors in lists and tuples: what
        torch functions take), without flattening the arguments on every call."""
        return self._scan(args, kwargs)[0]

    def _scan(self, args: tuple, kwargs: dict) -> tuple[list[Tensor], bool]:
        """The blocks among the arguments (:meth:`_blocks_in`), and whether the arguments are
        bare: blocks and values without a tensor in them, so that a rule has nothing whole to
        cut and walks no tree (a pytree walk costs tens of microseconds, more than the
        operation on a fast device)."""
        found, bare, marked = [], True, self._blocks
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, Tensor):
                entry = marked.get(id(a))
                if entry is not None and entry[0]() is a:
                    found.append(a)
                else:
                    bare = False
            elif isinstance(a, list | tuple):
                found += [t for t in a if self.is_split(t)]
                bare = False
            elif isinstance(a, dict):
                bare = False
        return found, bare

    def refuse(self, op: str, why: str, module: nn.Module | None = None) -> SpatialRefusal:
        """The refusal of ``op`` (raise it), naming the module and the ways out."""
        module = module if module is not None else self.module()
        return refusal(self.names, module, op, f"touches a block of split images, and {why}")


# ---------------------------------------------------------------------- the module hooks
_HOOKS: list[Any] = []  # the handles (never read in a forward: dynamo cannot represent them)
_hooked = False


def install_hooks() -> None:
    """Torch's global module hooks, registered once per process (when a region is made) and
    handed to the guards running on this thread (none: nothing to do). Registering them at
    every forward would end ``torch.compile``'s graph there (a hook handle is made by
    ``setattr`` on a type)."""
    global _hooked
    if not _hooked:
        _hooked = True
        _HOOKS[:] = [register_module_forward_pre_hook(_enter_module),
                     register_module_forward_hook(_leave_module)]  # fmt: skip


def _enter_module(module: nn.Module, args: tuple) -> tuple | None:
    changed = None
    for guard in record.records():
        if isinstance(guard, SpatialGuard):
            out = guard._enter_module(module, args if changed is None else changed)
            changed = out if out is not None else changed
    return changed


def _leave_module(module: nn.Module, args: tuple, out: Any) -> Any:
    changed = None
    for guard in record.records():
        if isinstance(guard, SpatialGuard):
            new = guard._leave_module(module, args, out if changed is None else changed)
            changed = new if new is not None else changed
    return changed
