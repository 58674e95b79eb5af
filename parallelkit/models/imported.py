"""Users' own networks by import path: ``model.name=package.module:Class``.

Why: a user with a network of their own should not have to register it in parallelkit, or
write a training loop, to train it in parallel. As LightningCLI's ``class_path`` and MONAI
bundles' ``_target_`` do, the config names the class (or any function returning an
``nn.Module``) by where it is imported from; ``model.kwargs`` are its arguments. The module
must import from the working directory, ``PYTHONPATH`` or an installed package.

The data's channel count and class count are passed under the first of these names the
constructor takes, unless ``model.kwargs`` gives it:

    input channels   in_channels, in_chans, n_input_channels, input_channels
    classes          num_classes, out_channels, classes, n_classes

A module that does not import, a name it does not hold, or something that is not callable is a
``ValueError`` naming ``model.name``: a config error, found before any rank starts.

A config names models, not arbitrary code. A run directory's ``config.yaml`` is read again by
``parallelkit predict`` and ``--resume``, so whoever can write it chooses what is called. A
path must therefore resolve to a class of the kind the key asks for (an ``nn.Module`` for a
model, a ``Dataset`` for data; a loss is a function) or to a plain Python function defined outside
Python's standard library; ``subprocess:Popen``, ``os:system`` or ``builtins:exec`` are
refused before anything is called, and a standard-library module is not even imported.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from parallelkit.models.zoo import LIBRARIES

CHANNELS = ("in_channels", "in_chans", "n_input_channels", "input_channels")
CLASSES = ("num_classes", "out_channels", "classes", "n_classes")


def is_import_path(name: str) -> bool:
    """Whether ``name`` is ``module:attribute`` (and not another library's ``timm:NAME``)."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr) and module not in LIBRARIES


KINDS: dict[str, tuple[type, ...]] = {"data.name": (Dataset,), "train.loss": ()}
"""The classes a key may name, beside a function (a loss is a function of logits and mask);
every other key: an ``nn.Module``."""


def _standard_library(module: str) -> bool:
    return module.partition(".")[0] in sys.stdlib_module_names


def _check_target(target: Any, name: str, key: str) -> None:
    """Refuse anything but a class of the key's kind or a plain function from outside the
    standard library (see the module's docstring)."""
    kinds = KINDS.get(key, (nn.Module,))
    if isinstance(target, type):
        if issubclass(target, kinds):
            return
        what = f"the class {target.__module__}.{target.__qualname__}"
    elif inspect.isfunction(target):
        if not _standard_library(target.__module__ or ""):
            return
        what = f"the standard library's function {target.__module__}.{target.__qualname__}"
    else:
        what = f"a {type(target).__name__}"
    wanted = (f"a {' or '.join(k.__name__ for k in kinds)} class or a function of your own "
              "that returns one") if kinds else "a function of your own"
    raise ValueError(f"config: {key}={name!r} is {what}: a config names {wanted}, not other code")


def load(name: str, key: str = "model.name") -> Callable[..., Any]:
    """The class or function that ``module:attribute`` names (``attribute`` may be dotted),
    checked to be one a config may name; ``key``: the config key that named it."""
    module_name, _, attr = name.partition(":")
    if _standard_library(module_name):
        raise ValueError(
            f"config: {key}={name!r} names Python's standard library ({module_name}): a config "
            "names a model, a loss or a data set of your own, not other code"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # as ``python -m`` would, for the console script
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or the user's module failing on import
        close = difflib.get_close_matches(module_name, LIBRARIES, n=1)
        hint = f"; did you mean {close[0]}:{attr}?" if close and key == "model.name" else ""
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        zoo = ", ".join(f"{p}:NAME" for p in LIBRARIES)
        others = f", another library's is {zoo}" if key == "model.name" else ""
        raise ValueError(
            f"config: {key}={name!r} is not {'a model' if key == 'model.name' else 'found'} "
            f"here: module {module_name!r} does not import ({why}); your own code must be "
            f"importable from the working directory, PYTHONPATH or an installed package"
            f"{others}{hint}"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"config: {key}={name!r}: {module_name} has no {attr!r}")
        target = getattr(target, part)
    _check_target(target, name, key)
    return target


def create(name: str, num_classes: int, in_channels: int = 3, **kwargs: Any) -> nn.Module:
    """The user's network, with the data's channels and classes where it takes them."""
    build = load(name)
    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):
        params = {}
    for names, value in ((CHANNELS, in_channels), (CLASSES, num_classes)):
        taken = next((n for n in names if n in params), None)
        if taken is not None and taken not in kwargs:
            kwargs[taken] = value
    model = build(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"config: model.name={name!r} returned a {type(model).__name__}, not "
                         "an nn.Module")  # fmt: skip
    return model
