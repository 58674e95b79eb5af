"""The zoo tier runs in its own venv (``make test-zoo``: torch with a matching torchvision,
timm and segmentation_models_pytorch). Nothing may download weights: models are built with
pretrained weights off, and the hub is told to stay offline."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from zoo_cases import STRATEGIES
from zoo_run import Pools


@pytest.fixture(scope="session")
def pools(request: pytest.FixtureRequest) -> Iterator[Pools]:
    """``pools(n)``: one pool of gloo ranks, as many as the largest selected case needs,
    started once and shared by every case, whatever the order (zoo_run.Pools)."""
    chosen = [getattr(getattr(item, "callspec", None), "params", {}).get("strategy")
              for item in request.session.items]  # fmt: skip
    # An empty parameter set (no case refused under a spatial strategy, so none to gather)
    # is one skipped item whose parameters are pytest's NOTSET, not a strategy.
    sizes = [STRATEGIES[s][0] for s in chosen if s in STRATEGIES]
    p = Pools(least=max(sizes, default=2))
    yield p
    p.close()
