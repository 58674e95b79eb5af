"""The config of tasks and models, without processes: defaults that follow ``train.task``, a
model and data that must fit the task, and models of other libraries by name.

In ``.venv`` torchvision does not import (PyPI's build wants PyPI's torch, not the CPU build
here) and timm and smp are not installed: that is the real "missing library" case. The zoo
tier (tests/zoo/test_zoo_train.py) builds and trains them where they are installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from parallelkit import models
from parallelkit.train import config


def test_defaults_follow_the_task():
    seg = config.load(None, ["train.task=segment"])
    assert (seg.model.name, seg.data.name, seg.data.num_classes, seg.model.width) == (
        "unet", "shapes", 4, 16,
    )  # fmt: skip
    assert seg.train.run_dir == "runs/unet-shapes-data"
    plain = config.load(None, [])
    assert (plain.model.name, plain.data.name, plain.model.width) == ("resnet18", "digits", 64)
    gan = config.load(None, ["train.task=gan"])
    assert gan.model.name == "dcgan"
    # An explicit value wins over the task's default; the saved config holds plain values.
    mine = config.load(None, ["train.task=segment", "data.num_classes=7", "model.width=8"])
    assert (mine.data.num_classes, mine.model.width) == (7, 8)
    assert "pk.default" not in config.to_yaml(mine)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.task=segment", "data.name=digits"], "train.task=segment needs masks"),
        (["train.task=segment", "model.name=resnet50"], "resnet50 is a classify model"),
        (["model.name=unet"], "unet is a segment model"),
        (["data.name=shapes"], "data.name=shapes holds masks"),
        (["train.task=gan", "train.accumulate=2"], "train.accumulate > 1 is for"),
        (["model.name=resnet19"], "model.name='resnet19' is not a model here"),
        (["train.task=bogus"], "train.task must be one of"),
    ],
)
def test_model_and_data_must_fit_the_task(overrides, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, overrides)


@pytest.mark.parametrize("name", ["torchvision:resnet18", "timm:resnet18", "smp:Unet"])
def test_missing_library_is_a_config_error(name):
    library = models.zoo.LIBRARIES[name.partition(":")[0]]
    if importlib.util.find_spec(library) is not None:
        try:
            importlib.import_module(library)
        except Exception:
            pass  # installed but broken beside this torch: also a config error, checked below
        else:
            pytest.skip(f"{library} imports here")
    task = ["train.task=segment"] if name.startswith("smp") else []
    with pytest.raises(ValueError, match=rf"model.name='{name}' needs {library}, which is"):
        config.load(None, [*task, f"model.name={name}"])


def test_zoo_names():
    assert models.zoo.is_zoo_name("timm:resnet18") and not models.zoo.is_zoo_name("resnet18")
    assert not models.zoo.is_zoo_name("foo:bar")  # not a library this knows: a plain name
    with pytest.raises(ValueError, match="is not a model here"):
        config.load(None, ["model.name=foo:bar"])  # nor a module that imports
    with pytest.raises(ValueError, match="did you mean timm:resnet18"):
        config.load(None, ["model.name=timn:resnet18"])


# ----------------------------------------------------------------------------- monai:NAME
# MONAI installs beside .venv's torch (the data extra): its networks are built here.
@pytest.mark.parametrize(
    ("name", "kwargs", "shape", "out"),
    [
        ("monai:UNet", dict(channels=[4, 8], strides=[2]), (2, 1, 8, 8, 8), (2, 3, 8, 8, 8)),
        ("monai:resnet18", {}, (2, 1, 8, 8, 8), (2, 3)),  # n_input_channels, num_classes
        ("monai:UNet", dict(spatial_dims=2, channels=[4, 8], strides=[2]), (2, 1, 8, 8),
         (2, 3, 8, 8)),
    ],
)  # fmt: skip
def test_monai_networks_by_name(name, kwargs, shape, out):
    pytest.importorskip("monai")
    model = models.create(name, num_classes=3, in_channels=1, **kwargs)
    assert model(torch.randn(shape)).shape == out


def test_monai_defaults_never_download_and_kwargs_win():
    pytest.importorskip("monai")
    # EfficientNetBN defaults to pretrained=True: it is built with pretrained=False.
    net = models.create("monai:EfficientNetBN", num_classes=2, in_channels=1,
                        model_name="efficientnet-b0", spatial_dims=3)  # fmt: skip
    assert net._fc.out_features == 2
    stem = next(m for m in net.modules() if isinstance(m, nn.Conv3d))
    assert stem.in_channels == 1  # spatial_dims=3 given: 3-D convolutions


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.name=monai:UNet"], r"needs model.kwargs \['channels', 'strides'\]"),
        (["model.name=monai:UNett"], r"no network 'UNett'; similar names: \['UNet'"),
        (["model.name=monai:UNet", "model.kwargs={pretrained: true}"], "without pretrained"),
    ],
)
def test_monai_config_errors(overrides, message):
    pytest.importorskip("monai")
    with pytest.raises(ValueError, match=message):
        config.load(None, ["train.task=segment", *overrides])
