"""The registry of spatial rules: which function rules which torch operation on blocks.

A rule is a plain function ``rule(g, call)``: ``g`` is the guard that follows the blocks (the
:class:`Guard` protocol below: the record of split tensors and a few services on it), ``call``
the operation with its arguments normalized once, by a signature given at registration
(``call["dim"]``, defaults filled in). It returns the result, marking outputs that are blocks
(``g.marked``), or raises ``g.refuse(...)``. DTensor keeps the same kind of knowledge as
``torch/distributed/tensor/_ops/``: one module per family of operations, a rule per function.

Adding a rule is one decorated function in its family's module::

    @rule(torch.logsumexp, Tensor.logsumexp, params="input, dim, keepdim=False")
    def logsumexp(g: Guard, call: Call) -> Tensor:
        \"\"\"What it does on blocks (the docs table's second column).\"\"\"

The docs table of operations (docs/parallelism.md) is generated from these registrations
(:func:`docs_rows`), and a test holds the two to each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelkit.geometry import blocks
from parallelkit.spatial.grid import SpatialGrid
from parallelkit.spatial.token_comm import box, box_index, fold_count

Size = tuple[int, ...]
"""A whole sample's spatial size, ``(L,)``, ``(H, W)`` or ``(D, H, W)``."""
Places = tuple[int, ...]
"""Where a block's spatial dimensions (L; H, W; or D, H, W) are, counted from the end:
(-2, -1) for (N, C, H, W), (-3, -2) for a channels-last (N, H, W, C), (-3, -2, -1) for a
volume (N, C, D, H, W)."""
Fold = tuple[tuple[int, int | str | None], ...]
"""A dimension that a window partition folded spatial dimensions into (Swin's B * nH * nW):
its factors, outermost first, as (whole size, the spatial dimension it is, by its place in
the record, or None for another). A block's fold has the same factors with this rank's rows
of each spatial one: a box in the whole fold's index space, so a rule that treats the folded
dimension as a batch (pointwise, linear maps, attention within windows) is local.

A token dimension's fold may begin with a *prefix* factor ``(p, PREFIX)``: ``p`` whole tokens
before the product of the others (a ViT's class token, DeiT's distillation token, register
tokens: ``torch.cat((cls, x), 1)``), held by the group's first rank (the one whose blocks
are the first of every axis) in front of its own tokens. The fold then counts ``p`` plus the
product of its other factors, and the ranks' tokens are still a partition of the whole
ones: rank 0's block is ``p`` tokens longer, as an uneven split's would be. Only rules
registered with ``prefix=True`` take such blocks (the guard refuses them to the others)."""


class Guard(Protocol):
    """What rules may ask of the guard (``parallelkit.spatial.guard``)."""

    comm: Any  # the spatial group (a Communicator)
    grid: SpatialGrid
    size_now: Size | None  # the whole spatial size of the call's first block
    read_sizes: set[Size]  # whole spatial sizes of blocks whose shape forward code read
    weights: dict[tuple, Any]  # resampling weights made for functional calls, by arguments

    def is_split(self, t: Any) -> bool: ...
    def places(self, t: Tensor) -> Places: ...
    def size_of(self, t: Tensor) -> Size | None: ...
    def folds(self, t: Tensor) -> tuple[Fold, ...]: ...
    def form(self, t: Tensor) -> tuple[Places, tuple[Fold, ...]]: ...
    def batch_fold(self, batch: int, count: int) -> tuple[Tensor, Fold] | None: ...
    def marked(
        self, out: Any, places: Places | None = None, size: Size | None = None,
        folds: tuple[Fold, ...] | None = None,
    ) -> Any: ...
    def summed(self, t: Any) -> Any: ...
    def refuse(self, op: str, why: str) -> ValueError: ...
    def rules(self) -> AbstractContextManager[None]: ...
    def module(self) -> nn.Module | None: ...
    def note_sized(self, size: Size) -> None: ...
    def warn_once(self, key: Any, message: str) -> None: ...


@dataclass(slots=True)
class Call:
    """One torch call on blocks: the function, its raw arguments, the blocks among them, the
    arguments by name where the rule gave a signature, and whether the arguments are bare:
    only blocks and values that hold no tensor (nothing whole to cut to a block)."""

    func: Callable
    args: tuple
    kwargs: dict
    blocks: list[Tensor]
    named: dict[str, Any] = field(default_factory=dict)
    bare: bool = False

    def __getitem__(self, name: str) -> Any:
        return self.named[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.named.get(name, default)

    def run(self) -> Any:
        """The operation itself, as it was called."""
        return self.func(*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return op_name(self.func)


@dataclass(frozen=True)
class Rule:
    """One registration: the rule function, the signature its calls are normalized by, the
    torch functions it serves, its docs-table verdict, and whether the guard asks it about
    calls without a block too (a whole tensor resized to a block's size), whether it
    takes folded blocks (window partitions; the guard refuses them to the others), and
    whether it takes token folds with a prefix (class tokens)."""

    fn: Callable[[Guard, Call], Any]
    params: inspect.Signature | None
    funcs: tuple[Callable, ...]
    exact: str  # the docs table's last column: "yes", "refused", ...
    whole: bool  # also asked about calls without a block (a whole tensor resized to blocks)
    folds: bool  # takes blocks with folds
    prefix: bool  # takes token folds with a prefix (a class token)

    @property
    def family(self) -> str:
        return self.fn.__module__.rsplit(".", 1)[-1]

    def normalize(self, g: Guard, call: Call) -> Call:
        if self.params is not None:
            try:
                bound = self.params.bind(*call.args, **call.kwargs)
            except TypeError as e:
                raise g.refuse(call.name, f"its arguments do not match {self.params} ({e})") from e
            bound.apply_defaults()
            call.named = dict(bound.arguments)
        return call


_RULES: dict[Any, Rule] = {}
PROPERTY = object()  # the key of the rule for attribute reads without one of their own


def rule(
    *funcs: Any,
    params: str | None = None,
    exact: str = "yes",
    whole: bool = False,
    folds: bool = False,
    prefix: bool = False,
) -> Callable[[Callable], Callable]:
    """Register the decorated function as the rule of ``funcs`` (None entries are skipped:
    functions this torch does not have). ``params``: the signature its arguments are
    normalized by, as Python writes one (``"input, dim=None, keepdim=False"``); ``folds``:
    it takes folded blocks too (it treats the folded dimension as a batch); ``prefix``: it
    takes folded blocks, token folds with a prefix among them (see :data:`Fold`)."""
    signature = None
    if params is not None:
        signature = inspect.signature(eval(f"lambda {params}: None"))  # our own text

    def register(fn: Callable) -> Callable:
        served = tuple(f for f in funcs if f is not None)
        entry = Rule(fn, signature, served, exact, whole, folds or prefix, prefix)
        for f in entry.funcs:
            if f in _RULES and _RULES[f].fn is not fn:
                raise AssertionError(f"{op_name(f)} has two rules: {_RULES[f].fn} and {fn}")
            _RULES[f] = entry
        return fn

    return register


def lookup(func: Any) -> Rule | None:
    """The rule of ``func``; reads of tensor attributes (``x.shape``, ``x.device``) without
    one of their own share :data:`PROPERTY`'s."""
    found = _RULES.get(func)
    if found is None and getattr(func, "__name__", "") == "__get__":
        return _RULES.get(PROPERTY)
    return found


def ops(names: str, *owners: Any, inplace: bool = False) -> list[Callable]:
    """The functions called ``names`` (space separated) on each owner (torch, Tensor, F, ...),
    with their in-place ``name_`` forms if asked; names an owner lacks are left out."""
    found = []
    for name in names.split():
        for owner in owners:
            for variant in (name, f"{name}_") if inplace else (name,):
                fn = getattr(owner, variant, None)
                if fn is not None and fn not in found:
                    found.append(fn)
    return found


def prop(name: str) -> Any:
    """The key under which ``tensor.<name>`` reaches a torch function mode."""
    return getattr(Tensor, name).__get__


def op_name(func: Any) -> str:
    """``torch.sum``, ``Tensor.view``, ``F.pad``: how a user would write ``func``."""
    if func is PROPERTY:
        return "other tensor attributes"
    if getattr(func, "__name__", "") == "__get__":
        return f"Tensor.{func.__self__.__name__}"
    if getattr(func, "__name__", "") == "__set__":
        return f"setting Tensor.{func.__self__.__name__}"
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", None) or ""
    module = getattr(func, "__module__", None) or ""
    if qualname.startswith(("Tensor.", "TensorBase.", "_TensorBase.")):
        return f"Tensor.{name}"
    if module in ("torch.nn.functional", "torch._C._nn") or getattr(F, name, None) is func:
        return f"F.{name}"
    for prefix in ("linalg", "special"):  # torch.linalg.vector_norm is linalg_vector_norm
        if module == f"torch._C._{prefix}":
            return f"torch.{prefix}.{name.removeprefix(prefix + '_')}"
    return f"torch.{name}" if module.startswith("torch") else name


def rules() -> Iterator[Rule]:
    """Every registered rule once, in registration order."""
    seen: list[Rule] = []
    for entry in _RULES.values():
        if entry not in seen:
            seen.append(entry)
            yield entry


_FAMILIES = ("pointwise", "views", "indexing", "reductions", "windows", "pooling", "padding",
             "norms", "resize", "random", "tokens")


def docs_rows() -> list[tuple[str, str, str, str]]:
    """The operations table: (family, operations, what happens on blocks, exact?) per rule
    function (the functions of all its registrations), by family; the third column is the
    rule's docstring, first paragraph."""
    funcs: dict[Callable, list[Callable]] = {}
    for entry in rules():
        funcs.setdefault(entry.fn, []).extend(entry.funcs)
    rows = []
    for fn, served in funcs.items():
        entry = _RULES[served[0]]
        names = sorted({op_name(f) for f in served}, key=lambda n: (n.lower(), n))
        shown = ", ".join(f"`{n}`" for n in names[:12])
        if len(names) > 12:
            shown += f" and {len(names) - 12} more"
        what = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        rows.append((entry.family, shown, what, entry.exact))
    return sorted(rows, key=lambda r: _FAMILIES.index(r[0]) if r[0] in _FAMILIES else 99)


def docs_table() -> str:
    head = "| family | operations | on blocks of split images | exact? |\n|---|---|---|---|\n"
    cells = (" | ".join(c.replace("|", "\\|") for c in row) for row in docs_rows())
    return head + "".join(f"| {c} |\n" for c in cells)


def all_(value: Any, want: int) -> bool:
    """Whether an int or every entry of a tuple equals ``want``."""
    return all(v == want for v in (value if isinstance(value, tuple | list) else (value,)))


def whole_size(g: Guard, x: Tensor) -> tuple[int, ...]:
    """The whole samples' spatial size of block ``x`` (wherever its spatial dimensions are):
    the record's, else one host all-gather of the block sizes (every rank reads it alike)."""
    size = g.size_of(x)
    if size is None:
        block = [x.shape[d] for d in g.places(x)]
        size = g.grid.global_size(torch.empty((1, 1, *block), device="meta"), "a block's shape")
    return tuple(size)


def whole_shape(g: Guard, x: Tensor, size: tuple[int, ...] | None = None) -> torch.Size:
    """Block ``x``'s shape with the whole samples' spatial sizes (``size``, where the caller
    has them already) in place of its own; a fold's, the product of its whole factors."""
    shape = list(x.shape)
    for d, n in zip(g.places(x), size or whole_size(g, x), strict=True):
        shape[d] = n
    for fold in g.folds(x):
        shape[fold_place(g, x, fold)] = fold_count(fold)
    return torch.Size(shape)


def fold_place(g: Guard, x: Tensor, fold: Fold) -> int:
    """Where ``fold`` is in block ``x``, counted from the end."""
    return g.places(x)[next(k for _, k in fold if isinstance(k, int))]


def fold_index(g: Guard, x: Tensor, fold: Fold) -> Tensor:
    """The whole fold's indices of block ``x``'s fold, in the block's order: its box of
    this rank's rows of each spatial factor, all of each other (and the prefix, on the
    group's first rank)."""
    axes = g.grid.axes(len(g.places(x)))
    rows = [blocks(n, axes[k][1])[axes[k][2]] if k is not None else (0, n) for n, k in box(fold)]
    return box_index(fold, rows, g.grid.at_origin).to(x.device)


def standard(x: Tensor) -> Places:
    """The spatial dimensions of an (N, C, *spatial) tensor: every one after C."""
    return tuple(range(2 - x.dim(), 0))


def channels_first(g: Guard, call: Call, x: Tensor) -> int:
    """Refuse unless block ``x`` is (N, C, *spatial) (not channels last); its number of
    spatial dimensions."""
    if g.places(x) != standard(x):
        raise g.refuse(call.name, "this rule wants an (N, C, L), (N, C, H, W) or "
                       "(N, C, D, H, W) block")  # fmt: skip
    return x.dim() - 2
