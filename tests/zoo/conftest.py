"""The zoo tier runs in its own venv (``make test-zoo``: torch with a matching torchvision,
timm and segmentation_models_pytorch). Nothing may download weights: models are built with
pretrained weights off, and the hub is told to stay offline."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from zoo_run import Pools


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """``pools(n)``: n gloo ranks, started once and reused by every case (zoo_run.Pools)."""
    p = Pools()
    yield p
    p.close()
