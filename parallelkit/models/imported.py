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

from parallelkit.models.zoo import LIBRARIES

CHANNELS = ("in_channels", "in_chans", "n_input_channels", "input_channels")
CLASSES = ("num_classes", "out_channels", "classes", "n_classes")


def is_import_path(name: str) -> bool:
    """Whether ``name`` is ``module:attribute`` (and not another library's ``timm:NAME``)."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr) and module not in LIBRARIES


def load(name: str, key: str = "model.name") -> Callable[..., Any]:
    """The callable that ``module:attribute`` names (``attribute`` may be dotted); ``key``:
    the config key that named it, for the messages."""
    module_name, _, attr = name.partition(":")
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
    if not callable(target):
        raise ValueError(f"config: {key}={name!r} is not a class or a function")
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
