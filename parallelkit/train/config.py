"""The training configuration: a run's :class:`Config`, read and checked.

A run is described by one :class:`Config`. It is built from the dataclasses' defaults, then an
optional YAML file, then command-line overrides in OmegaConf's dot-list form::

    parallelkit train --config examples/dcgan/dcgan.yaml train.epochs=3 parallel.ranks=4

OmegaConf checks every key and type against the dataclasses (:mod:`parallelkit.train.schema`: a
misspelt key or a string where an int belongs is an error naming the key); :func:`validate`
then checks every value that types cannot (a batch that does not split over the data ranks, an
unknown strategy, a timeout that is not positive), and asks the task's class
(:mod:`parallelkit.train.tasks`) for its defaults and its checks. Every mistake is one
``ValueError`` line naming the key, which the command prints before exiting with status 2. The
resolved config is saved as ``config.yaml`` in the run directory, so a run can be repeated from
it alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallelkit import models
from parallelkit.data.config import check_config
from parallelkit.data.source import Source
from parallelkit.dims import GridDims
from parallelkit.models import imported, zoo
from parallelkit.train.schema import (  # the config's dataclasses, read from here too
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from parallelkit.train.tasks import TASKS as TASK_CLASSES
from parallelkit.train.tasks.protocol import Task

__all__ = [
    "Config",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "grid_dims",
    "load",
    "to_yaml",
    "validate",
]

TASKS = tuple(TASK_CLASSES)
STRATEGIES = ("data", "spatial", "channel", "hybrid")
OPTIMIZERS = ("sgd", "adam", "lars")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
STEMS = ("imagenet", "cifar")
FAULTS = ("exit", "raise", "raise_in_backward")  # see parallelkit.train.loop.faults


def _task_default(key: str, task: str) -> Any:
    """``${pk.default:KEY,TASK}``: the default of ``key`` for ``train.task=TASK``, from its class
    (``parallelkit train train.task=segment`` trains a U-Net on generated shapes)."""
    # An unknown task resolves like the default task, so that validate() names train.task.
    return TASK_CLASSES.get(task, TASK_CLASSES[TrainConfig.task]).defaults[key]


# OmegaConf 2.4 renamed register_new_resolver (2.3, which the XLA environment may hold).
_register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
_register("pk.default", _task_default, replace=True)


def _run_name(*parts: Any) -> str:
    """``${pk.run_name:...}``: the default run directory's name from the model, data and
    strategy, one path component of letters, digits, ``.``, ``_`` and ``-``: a data name
    ``nifti:/data/ct`` becomes ``nifti-ct``, a model ``monai:UNet`` ``monai-UNet``."""
    words = []
    for part in map(str, parts):
        kind, sep, path = part.partition(":")
        if sep and "/" in path:
            part = f"{kind}-{Path(path.rstrip('/')).name}"
        words.append(re.sub(r"[^A-Za-z0-9._]+", "-", part).strip("-.") or "x")
    return "-".join(words)


_register("pk.run_name", _run_name, replace=True)


def load(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides; validated."""
    try:
        cfg = OmegaConf.structured(Config)
        if path is not None:
            cfg = OmegaConf.merge(cfg, _read_yaml(path))
        if bad := [o for o in overrides if "=" not in o]:
            raise ValueError(f"overrides must look like key=value, got {bad}")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.resolve(cfg)
        config: Config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        message = str(getattr(e, "msg", None) or e).splitlines()[0]
        key = getattr(e, "full_key", None)
        raise ValueError(f"config: {message}" + (f" (key {key})" if key else "")) from None
    except yaml.YAMLError as e:  # from a dot-list value such as optim.betas=[0.5
        raise ValueError(f"config: not valid YAML in an override: {_one_line(e)}") from None
    validate(config)
    return config


def _read_yaml(path: str):
    """The file as an OmegaConf mapping; a one-line ValueError for a missing file, a syntax
    error (with its line and column) or a file that is not a mapping of keys."""
    if not Path(path).is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {_one_line(e)}") from None
    if not OmegaConf.is_dict(loaded):
        raise ValueError(f"config file {path} must be a mapping of keys (model:, train:, ...)")
    return loaded


def _one_line(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ValueError(f"config: {key} must be one of {allowed}, got {value!r}")


def validate(cfg: Config) -> None:
    """What the types cannot say; checks that need the world size are in :func:`grid_dims`."""
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    source = check_config(cfg.data, "train")
    _one_of(t.task, TASKS, "train.task")
    _one_of(p.strategy, STRATEGIES, "parallel.strategy")
    _one_of(o.name, OPTIMIZERS, "optim.name")
    _one_of(o.schedule, SCHEDULES, "optim.schedule")
    _one_of(t.precision, PRECISIONS, "train.precision")
    _one_of(p.device, DEVICES, "parallel.device")
    _one_of(p.fallback, ("refuse", "gather"), "parallel.fallback")
    _one_of(t.fail_how, FAULTS, "train.fail_how")
    if t.compile:
        import torch._dynamo

        backends = tuple(torch._dynamo.list_backends(exclude_tags=()))
        _one_of(t.compile_backend, backends, "train.compile_backend")
    if imported.is_import_path(t.loss):  # the user's own loss of whole logits
        imported.load(t.loss, "train.loss")
        if p.depth * p.rows * p.cols > 1 or p.strategy == "spatial":
            raise ValueError(
                f"config: train.loss={t.loss} needs whole logits, and spatial parallelism "
                "keeps them split over the ranks: use train.loss=ce, dice or dice_ce there "
                "(exact on blocks), or a data or channel grid"
            )
    else:
        _one_of(t.loss, ("ce", "dice", "dice_ce"), "train.loss")  # parallelkit.train.tasks.losses
    if t.loss != "ce" and t.task != "segment":
        raise ValueError(f"config: train.loss={t.loss} is for train.task=segment, not {t.task}")
    if cfg.model.name.startswith("resnet"):
        _one_of(cfg.model.stem, STEMS, "model.stem")
    positive = {
        "train.epochs": t.epochs,
        "train.batch_size": t.batch_size,
        "train.accumulate": t.accumulate,
        "train.log_every": t.log_every,
        "train.eval_every": t.eval_every,
        "parallel.ranks": p.ranks,
        "parallel.depth": p.depth,
        "parallel.rows": p.rows,
        "parallel.cols": p.cols,
        "parallel.channel": p.channel,
        "optim.base_batch": o.base_batch,
        "train.keep_checkpoints": t.keep_checkpoints,
        "model.width": cfg.model.width,
        "model.nz": cfg.model.nz,
    }
    if bad := {k: v for k, v in positive.items() if v < 1}:
        raise ValueError(f"config: these must be at least 1: {bad}")
    _check_values(cfg)
    _check_task(cfg, source)
    spatial = p.depth * p.rows * p.cols
    if p.strategy == "hybrid" and spatial * p.channel == 1:
        raise ValueError(
            "config: parallel.strategy=hybrid needs a model-parallel grid, e.g. parallel.rows=2"
        )
    if spatial > 1 and p.channel > 1:
        raise ValueError(
            "config: spatial (depth/rows/cols) and channel parallelism cannot be combined"
        )


def _check_task(cfg: Config, source: Source) -> None:
    """The model and the data (``source``) must fit the task (its class says how); a zoo model
    must be buildable here."""
    task, name, data = TASK_CLASSES[cfg.train.task], cfg.model.name, cfg.data.name
    owner = _made_for(name)
    if owner is not None and owner is not task:
        raise ValueError(
            f"config: model.name={name} is a {owner.name} model, not one for "
            f"train.task={task.name}, which trains {task.trains}"
        )
    if source.is_users_class:
        pass  # the user's data set: its items say (the first batch is checked on every rank)
    elif task.masks and not (source.has_masks or source.is_shards):
        raise ValueError(
            f"config: train.task={task.name} needs masks: data.name=shapes, segfolder, "
            f"shapes3d, segfolder3d, FORMAT:DIR (zarr, tiff, nifti, npy) or webdataset shards "
            f"written from one, not {data}"
        )
    elif not task.masks and source.has_masks:
        with_masks = " or ".join(f"train.task={t.name}" for t in TASK_CLASSES.values() if t.masks)
        raise ValueError(f"config: data.name={data} holds masks: use it with {with_masks}")
    task.check(cfg)
    if zoo.is_zoo_name(name):
        zoo.check(name, dict(cfg.model.kwargs))
    elif imported.is_import_path(name):
        imported.load(name)
    elif owner is None and name not in models.list_models():
        raise ValueError(
            f"config: model.name={name!r} is not a model here: {models.list_models()}, dcgan, "
            "another library's torchvision:NAME, timm:NAME, smp:ARCH, monai:NAME, or your own "
            "as package.module:Class"
        )


def _made_for(name: str) -> type[Task] | None:
    """The task whose built-in network ``name`` is, if any."""
    return next((t for t in TASK_CLASSES.values() if name in t.networks), None)


def _check_values(cfg: Config) -> None:
    """Numbers that must lie in a range; the first one that does not is named."""
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    rules = [
        ("parallel.timeout", p.timeout, p.timeout > 0, "must be > 0 (seconds)"),
        ("parallel.bucket_cap_mb", p.bucket_cap_mb, p.bucket_cap_mb > 0, "must be > 0"),
        ("train.max_steps", t.max_steps, t.max_steps >= 0, "must be >= 0 (0: every epoch)"),
        ("train.checkpoint_every", t.checkpoint_every, t.checkpoint_every >= 0, "must be >= 0"),
        ("train.precise_bn", t.precise_bn, t.precise_bn >= 0, "must be >= 0 (batches; 0: off)"),
        ("train.fail_at_step", t.fail_at_step, t.fail_at_step >= -1, "must be >= -1 (off)"),
        ("train.fail_rank", t.fail_rank, t.fail_rank >= -1, "must be >= -1 (the last)"),
        ("train.run_dir", t.run_dir, bool(str(t.run_dir).strip()), "must name a directory"),
        ("optim.lr", o.lr, o.lr > 0, "must be > 0"),
        ("optim.momentum", o.momentum, 0 <= o.momentum < 1, "must be in [0, 1)"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be >= 0"),
        ("optim.warmup_epochs", o.warmup_epochs, o.warmup_epochs >= 0, "must be >= 0"),
        ("optim.trust_coefficient", o.trust_coefficient, o.trust_coefficient > 0, "must be > 0"),
        ("optim.betas", list(o.betas), all(0 <= b < 1 for b in o.betas), "must be in [0, 1)"),
    ]
    for key, value, ok, rule in rules:
        if not ok:
            raise ValueError(f"config: {key}={value} {rule}")


def grid_dims(cfg: ParallelConfig, world: int) -> dict[str, int]:
    """``Grid`` dimensions (data, depth, rows, cols, channel) for ``world`` ranks."""
    dims = GridDims(rows=cfg.rows, cols=cfg.cols, channel=cfg.channel, depth=cfg.depth)
    if dims.model == 1 and cfg.strategy in ("spatial", "channel"):
        dims = GridDims.along(cfg.strategy, world)  # the strategy alone: every rank on it
    if world % dims.model:
        raise ValueError(
            f"config: {world} ranks do not split into groups of depth x rows x cols x channel "
            f"= {dims.depth} x {dims.rows} x {dims.cols} x {dims.channel}; choose a grid whose "
            f"product divides {world}"
        )
    return dims.with_data(world // dims.model).as_dict()
