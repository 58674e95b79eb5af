"""The training config: defaults, YAML, dot-list overrides, validation, grid dimensions."""

from __future__ import annotations

import pytest

from parallelkit.train import config
from parallelkit.train.config import Config, ParallelConfig, grid_dims


def test_defaults_are_the_main_job():
    cfg = config.load()
    assert isinstance(cfg, Config)
    assert (cfg.model.name, cfg.data.name, cfg.parallel.strategy) == ("resnet18", "digits", "data")
    assert cfg.parallel.ranks == 2
    assert cfg.train.run_dir == "runs/resnet18-digits-data"  # interpolation resolved


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 3\n  batch_size: 32\noptim:\n  name: adam\n")
    cfg = config.load(str(path), ["train.epochs=5", "parallel.strategy=spatial", "optim.lr=0.01"])
    assert cfg.train.epochs == 5  # the command line wins over the file
    assert cfg.train.batch_size == 32
    assert cfg.optim.name == "adam" and cfg.optim.lr == 0.01
    assert cfg.parallel.strategy == "spatial"
    assert cfg.train.run_dir == "runs/resnet18-digits-spatial"
    cfg = config.load(None, ["optim.betas=[0.5,0.999]", "model.kwargs={zero_init_residual: true}"])
    assert tuple(cfg.optim.betas) == (0.5, 0.999)
    assert cfg.model.kwargs == {"zero_init_residual": True}


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = config.load(None, ["train.epochs=2", "data.image_size=16"])
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml(cfg))
    assert config.load(str(path)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.epochs=many"], "train.epochs"),  # wrong type
        (["train.epoch=3"], "epoch"),  # misspelt key
        (["parallel.strategy=pipeline"], "parallel.strategy"),
        (["optim.name=rmsprop"], "optim.name"),
        (["train.precision=fp8"], "train.precision"),
        (["train.batch_size=0"], "train.batch_size"),
        (["parallel.strategy=hybrid"], "hybrid"),
        (["parallel.rows=2", "parallel.channel=2"], "cannot be combined"),
        (["epochs"], "key=value"),
        (["parallel.timeout=0"], "parallel.timeout=0.0 must be > 0"),
        (["train.max_steps=-1"], "train.max_steps=-1 must be >= 0"),
        (["optim.momentum=1.5"], "optim.momentum=1.5 must be in"),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints"),
        (["train.fail_how=segfault"], "train.fail_how"),
        (["parallel.fallback=whole"], "parallel.fallback"),
        (["train.compile=true", "train.compile_backend=tensorrt2"], "train.compile_backend"),
        (["model.stem=tiny"], "model.stem"),
        (["optim.betas=[0.5"], "not valid YAML"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, overrides)


def test_every_message_is_one_line():
    with pytest.raises(ValueError) as info:
        config.load(None, ["train.epochs=many"])
    assert "\n" not in str(info.value) and "train.epochs" in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  epochs: [3\n", "is not valid YAML: .* at line 3, column 1"),
        ("- 1\n- 2\n", "must be a mapping of keys"),
    ],
)
def test_bad_yaml_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        config.load(str(path))
    assert "\n" not in str(info.value)


def test_missing_file():
    with pytest.raises(ValueError, match="does not exist"):
        config.load("no/such.yaml")


@pytest.mark.parametrize(
    ("fields", "world", "dims"),
    [
        ({}, 4, (4, 1, 1, 1)),
        ({"strategy": "spatial"}, 4, (1, 4, 1, 1)),
        ({"strategy": "channel"}, 2, (1, 1, 1, 2)),
        ({"strategy": "hybrid", "rows": 2}, 4, (2, 2, 1, 1)),
        ({"strategy": "spatial", "rows": 2, "cols": 2}, 8, (2, 2, 2, 1)),
        ({"strategy": "data"}, 1, (1, 1, 1, 1)),
    ],
)
def test_grid_dims(fields, world, dims):
    got = grid_dims(ParallelConfig(**fields), world)
    assert (got["data"], got["rows"], got["cols"], got["channel"]) == dims


def test_grid_that_does_not_divide():
    with pytest.raises(ValueError, match="do not split"):
        grid_dims(ParallelConfig(strategy="hybrid", rows=3), 4)
