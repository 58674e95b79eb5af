"""A small registry of model constructors, so configs and the command line name a model.

    model = parallelkit.models.create("resnet50", num_classes=10, stem="cifar")
    parallelkit.models.list_models()   # ['dcgan_discriminator', 'dcgan_generator', 'resnet18', ...]
    model = parallelkit.models.create("timm:resnet18", num_classes=10)   # another library's
    model = parallelkit.models.create("mypackage.nets:MyNet", num_classes=10)   # the user's own

A constructor is any callable returning an ``nn.Module``, registered under a name with
``@register("name")``. ``create`` checks the keyword arguments against the constructor before
calling it, so a misspelt argument in a config says which model rejected it and what that model
takes, instead of a ``TypeError`` from deep inside; a constructor that forwards ``**kwargs`` to
the class it returns (``resnet18(**kwargs) -> ResNet``) is checked against that class.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from parallelkit.models import imported, zoo

Constructor = Callable[..., nn.Module]
C = TypeVar("C", bound=Constructor)

_REGISTRY: dict[str, Constructor] = {}


def register(name: str) -> Callable[[C], C]:
    """Decorator: make ``fn`` available as ``create(name, ...)``; returns ``fn`` unchanged."""

    def add(fn: C) -> C:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"register: a model named {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def list_models() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def create(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` with ``kwargs``.

    Raises ValueError for an unknown name (listing the known ones) and TypeError for a keyword
    argument the model does not take (listing those it does), as calling it directly would.
    ``torchvision:NAME``, ``timm:NAME`` and ``smp:ARCH`` build that library's model
    (:mod:`parallelkit.models.zoo`; ``num_classes`` and ``in_channels`` are passed on).
    """
    if zoo.is_zoo_name(name):
        return zoo.create(name, **kwargs)
    if imported.is_import_path(name):
        return imported.create(name, **kwargs)
    if name not in _REGISTRY:
        raise ValueError(f"create: unknown model {name!r}; known models: {list_models()}")
    fn = _REGISTRY[name]
    accepted = _keyword_names(fn)
    if accepted is not None and (unknown := sorted(set(kwargs) - accepted)):
        raise TypeError(
            f"create({name!r}): unexpected keyword arguments {unknown}; "
            f"{name} takes {sorted(accepted)}"
        )
    return fn(**kwargs)


def _keyword_names(fn: Callable[..., Any]) -> set[str] | None:
    """Names ``fn`` accepts as keywords, following ``**kwargs`` into the class it is annotated
    to return; None when that cannot be told (then the call itself is the check)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C extensions have no signature
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in params if p.kind in kinds}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return names
    if not inspect.isfunction(fn):  # a class whose __init__ takes **kwargs: cannot tell
        return None
    try:
        returned = typing.get_type_hints(fn).get("return")
    except (NameError, TypeError):  # an annotation that does not resolve: do not guess
        return None
    forwarded = _keyword_names(returned) if isinstance(returned, type) else None
    return None if forwarded is None else names | forwarded
