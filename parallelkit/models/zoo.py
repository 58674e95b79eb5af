"""Models of other libraries by name: ``torchvision:NAME``, ``timm:NAME``, ``smp:ARCH``,
``monai:NAME``.

Why it is here: ``pk.parallelize`` takes an unchanged network from any of these libraries,
so ``parallelkit train`` should train one without a line of user code. This module maps a
config's ``model.name`` (and ``model.kwargs``) to the library's own constructor, with
pretrained weights off, because nothing may download at run time:

==========================  ===================================================================
``torchvision:NAME``        ``torchvision.models.get_model(NAME, weights=None,
                            num_classes=K, **kwargs)`` (also ``weights_backbone=None`` for
                            the segmentation models); 3 input channels only
``timm:NAME``               ``timm.create_model(NAME, pretrained=False, num_classes=K,
                            in_chans=C, **kwargs)``
``smp:ARCH``                ``segmentation_models_pytorch.create_model(ARCH,
                            encoder_weights=None, in_channels=C, classes=K, **kwargs)``,
                            e.g. ``model.kwargs={encoder_name: resnet18}``
``monai:NAME``              ``monai.networks.nets.NAME(spatial_dims=3, in_channels=C,
                            out_channels=K, **kwargs)``: each of these only where NAME takes
                            it (``n_input_channels`` and ``num_classes`` where it takes those
                            instead), ``pretrained=False`` where it takes that, e.g.
                            ``model.kwargs={channels: [8, 16], strides: [2]}`` for ``UNet``
==========================  ===================================================================

torchvision's video classifiers (``r3d_18``, ``mc3_18``, ``r2plus1d_18``, ``s3d``, ``mvit_v2_s``)
come through ``torchvision:NAME`` like any other of its models; they take (N, 3, T, H, W).

A library that is not installed (or does not import beside this torch), an unknown name, or a
weights argument is a ``ValueError`` naming the key, which ``parallelkit train`` reports as a
config error (exit status 2) before any rank starts: :func:`check` runs in the config checks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from typing import Any

from torch import nn

LIBRARIES = {
    "torchvision": "torchvision", "timm": "timm", "smp": "segmentation_models_pytorch",
    "monai": "monai",
}  # fmt: skip
WEIGHT_ARGS = ("weights", "weights_backbone", "pretrained", "encoder_weights", "pretrained_cfg")


def is_zoo_name(name: str) -> bool:
    """Whether ``name`` names another library's model (``library:name``)."""
    return name.partition(":")[0] in LIBRARIES and ":" in name


def _library(name: str) -> tuple[str, str, Any]:
    """(prefix, model name, imported module) of a zoo name; ValueError if it cannot be."""
    prefix, _, model = name.partition(":")
    if prefix not in LIBRARIES or not model:
        known = ", ".join(f"{p}:NAME" for p in LIBRARIES)
        raise ValueError(f"config: model.name={name!r}: a zoo model is one of {known}")
    module = LIBRARIES[prefix]
    try:
        lib = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] != module:
            raise ValueError(_broken(name, module, err)) from None
        build = "; the build made for this torch" if module == "torchvision" else ""
        raise ValueError(
            f"config: model.name={name!r} needs {module}, which is not installed here "
            f"(pip install {module.replace('_', '-')}{build})"
        ) from None
    except Exception as err:  # a build for another torch fails in many ways on import
        raise ValueError(_broken(name, module, err)) from None
    return prefix, model, lib


def _broken(name: str, module: str, err: BaseException) -> str:
    what = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return (
        f"config: model.name={name!r} needs {module}, which is installed but does not import "
        f"beside this torch: {type(err).__name__}: {what}"
    )


def check(name: str, kwargs: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` (a config error) unless ``name`` can be built; imports the
    library, builds nothing."""
    prefix, model, lib = _library(name)
    if weights := sorted(set(kwargs or {}) & set(WEIGHT_ARGS)):
        raise ValueError(
            f"config: model.kwargs sets {weights}: zoo models are built without pretrained "
            "weights (nothing downloads at run time); load weights into model.pt yourself"
        )
    if prefix == "monai":
        _monai_arguments(name, kwargs or {}, 1, 2)
        return
    if prefix == "torchvision":
        known = lib.models.list_models()
    elif prefix == "timm":
        known = None if lib.is_model(model) else lib.list_models()
    else:
        known = list(lib.MODEL_ARCHITECTURES_MAPPING)
        model = model.lower()
        encoder = (kwargs or {}).get("encoder_name")
        if encoder is not None and encoder not in lib.encoders.get_encoder_names():
            raise ValueError(
                f"config: model.kwargs.encoder_name={encoder!r} is not an encoder of "
                f"segmentation_models_pytorch; some: {lib.encoders.get_encoder_names()[:12]}"
            )
    if known is not None and model not in known:
        close = difflib.get_close_matches(model, known, n=8, cutoff=0.6)
        hint = f"; similar names: {close}" if close else f"; {len(known)} known"
        raise ValueError(f"config: model.name={name!r}: {prefix} has no model {model!r}{hint}")


def create(name: str, num_classes: int, in_channels: int = 3, **kwargs: Any) -> nn.Module:
    """The library's model ``name`` with ``num_classes`` outputs and random weights."""
    check(name, kwargs)
    prefix, model, lib = _library(name)
    if prefix == "torchvision":
        if in_channels != 3:
            raise ValueError(
                f"config: torchvision models take 3 input channels; data.channels={in_channels}"
            )
        builder = lib.models.get_model_builder(model)
        extra = {"weights_backbone": None} if _takes(builder, "weights_backbone") else {}
        return lib.models.get_model(
            model, weights=None, num_classes=num_classes, **extra, **kwargs
        )
    if prefix == "timm":
        return lib.create_model(
            model, pretrained=False, num_classes=num_classes, in_chans=in_channels, **kwargs
        )
    if prefix == "monai":
        builder, filled = _monai_arguments(name, kwargs, in_channels, num_classes)
        return builder(**filled, **kwargs)
    return lib.create_model(
        model, encoder_weights=None, in_channels=in_channels, classes=num_classes, **kwargs
    )


# (the arguments a MONAI network may take for it, in order; the value parallelkit passes)
_MONAI_FILLED = (
    (("spatial_dims",), lambda c, k: 3),
    (("in_channels", "n_input_channels"), lambda c, k: c),
    (("out_channels", "num_classes"), lambda c, k: k),
    (("pretrained",), lambda c, k: False),
)


def _monai_arguments(
    name: str, kwargs: dict[str, Any], in_channels: int, num_classes: int
) -> tuple[Any, dict[str, Any]]:
    """MONAI's constructor for ``monai:NAME`` and the arguments parallelkit fills in (those
    it takes and ``kwargs`` does not set); ValueError for an unknown name or a required
    argument left unset."""
    import monai.networks.nets as nets

    model = name.partition(":")[2]
    builder = getattr(nets, model, None)
    if model.startswith("_") or not _builds_module(builder):
        known = [n for n in dir(nets) if not n.startswith("_") and _builds_module(getattr(nets, n))]
        close = difflib.get_close_matches(model, known, n=8, cutoff=0.6)
        hint = f"; similar names: {close}" if close else f"; {len(known)} known"
        raise ValueError(
            f"config: model.name={name!r}: monai.networks.nets has no network {model!r}{hint}"
        )
    takes, required = _parameters(builder)
    filled: dict[str, Any] = {}
    for arguments, value in _MONAI_FILLED:
        if any(a in kwargs for a in arguments):
            continue
        if argument := next((a for a in arguments if a in takes), None):
            filled[argument] = value(in_channels, num_classes)
    if missing := [a for a in required if a not in kwargs and a not in filled]:
        raise ValueError(
            f"config: model.name={name!r} needs model.kwargs {missing} (monai.networks.nets."
            f"{model} has no default for them), e.g. model.kwargs="
            "{channels: [8, 16, 32], strides: [2, 2]} for UNet"
        )
    return builder, filled


def _builds_module(builder: Any) -> bool:
    """A class of torch module, or a function annotated to return one (monai's resnet18)."""
    if inspect.isclass(builder):
        return issubclass(builder, nn.Module)
    if not inspect.isfunction(builder):
        return False
    returns = _returned_class(builder)
    return returns is not None and issubclass(returns, nn.Module)


def _returned_class(fn: Any) -> type | None:
    try:
        returns = typing.get_type_hints(fn).get("return")
    except Exception:  # annotations naming what this module cannot resolve
        return None
    return returns if inspect.isclass(returns) else None


def _parameters(builder: Any) -> tuple[set[str], list[str]]:
    """The keyword arguments ``builder`` takes and those it requires, following a function's
    ``**kwargs`` into the class it returns (``resnet18(**kwargs) -> ResNet``)."""
    params = inspect.signature(builder).parameters.values()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes = {p.name for p in named}
    required = [p.name for p in named if p.default is p.empty]
    returns = None if inspect.isclass(builder) else _returned_class(builder)
    if returns is not None and any(p.kind is p.VAR_KEYWORD for p in params):
        inner, _ = _parameters(returns)
        takes |= inner  # what the inner class requires, the function supplies
    return takes, required


def _takes(fn: Any, argument: str) -> bool:
    try:
        return argument in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
