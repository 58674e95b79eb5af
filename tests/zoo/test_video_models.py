"""torchvision's video classifiers by name: ``model.name=torchvision:r3d_18`` and the rest.

They come through ``torchvision:NAME`` like any other torchvision model (random weights, the
task's class count) and take (N, 3, T, H, W). The three video ResNets run a small clip; the
others are only built, their pooling needs clips of 16 x 224 x 224 or more.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelkit.models import create, zoo

RESNETS = ("r3d_18", "mc3_18", "r2plus1d_18")
OTHERS = ("s3d", "mvit_v2_s", "swin3d_t")


@pytest.mark.parametrize("name", RESNETS)
def test_video_resnets_build_and_run_a_clip(name):
    torch.manual_seed(0)
    model = create(f"torchvision:{name}", num_classes=4)
    assert any(isinstance(m, nn.Conv3d) for m in model.modules())
    assert model(torch.randn(2, 3, 4, 16, 16)).shape == (2, 4)


@pytest.mark.parametrize("name", OTHERS)
def test_other_video_models_build(name):
    model = create(f"torchvision:{name}", num_classes=5)
    last = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv3d)][-1]
    assert (last.out_features if isinstance(last, nn.Linear) else last.out_channels) == 5
    assert any(isinstance(m, nn.Conv3d) for m in model.modules())


def test_video_models_take_three_channels_only():
    with pytest.raises(ValueError, match="torchvision models take 3 input channels"):
        create("torchvision:r3d_18", num_classes=4, in_channels=1)
    zoo.check("torchvision:r2plus1d_18")  # known by name
