"""Refusals under spatial parallelism: what could not be made exact, where, and the ways out.

A refusal is a ``ValueError`` (:class:`SpatialRefusal`) that names the operation, the module
path and class, why, and what to do: ``keep_dense=[path]``, ``fallback="gather"``, or another
strategy. The guard raises one for an operation without an exact rule; a rule's refusal is the
same on every rank, since every rank runs the same code on blocks of the same shapes. A model's
own error on a block (an assertion that a window size divides the block's height, a size
mismatch between a block and a tensor sized for the whole image) becomes one too
(:func:`model_failure`), so that it says what happened and what to do; it need not be the same
on every rank (uneven blocks), which ``fallback="gather"`` checks before acting on it.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from torch import nn

from parallelkit.spatial.rules.registry import Call

_PACKAGE = Path(__file__).resolve().parents[1]
_GUARD = Path(__file__).resolve().with_name("guard.py")


class SpatialRefusal(ValueError):
    """``module``: the innermost module of the model whose forward was running (None: the
    model's own forward). ``same_everywhere``: whether every rank is known to refuse alike."""

    def __init__(self, message: str, module: nn.Module | None, same_everywhere: bool = True):
        super().__init__(message)
        self.module, self.same_everywhere = module, same_everywhere


def refusal(
    names: dict[nn.Module, str], module: nn.Module | None, head: str, tail: str
) -> SpatialRefusal:
    """The refusal "``head`` in 'module.path' (Class) ``tail``", with the ways out."""
    path = names.get(module, "") if module is not None else ""
    where = f"in {path!r} ({type(module).__name__})" if path else "in the model's forward"
    name = repr(path) if path else "..., naming the module that does it"
    return SpatialRefusal(
        f"spatial parallelism: {head} {where} {tail}; pass keep_dense=[{name}] to run that "
        'module on whole images from there on, or fallback="gather" to run it on gathered '
        "whole images and split again after it, or use the data or channel strategy",
        module,
    )


def model_failure(
    names: dict[nn.Module, str], module: nn.Module | None, exc: BaseException
) -> SpatialRefusal | None:
    """``exc`` as a refusal where the model's own code (or a torch operation it called on
    whole tensors) raised it inside ``module``, a module given blocks of split images; None
    where parallelkit's rules, layers or communication raised it (a defect or a fault of
    ours, not to be dressed up) or no module had blocks."""
    if module is None or not isinstance(exc, AssertionError | RuntimeError | IndexError):
        return None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    where = Path(code.co_filename).resolve() if code is not None else _GUARD
    torch_op = where == _GUARD or code is Call.run.__code__  # torch's operation raised
    if where.is_relative_to(_PACKAGE) and not torch_op:
        return None
    message = str(exc).splitlines()[0] if str(exc) else ""
    refused = refusal(
        names, module, "the forward", f"raised {type(exc).__name__} ({message}) on this rank's "
        "block of split images: its code may need more of the sample than the block (the "
        "block's own data where it expects the whole image's, a size check of its own)",
    )  # fmt: skip
    refused.same_everywhere = False
    return refused
