"""The training configuration: typed dataclasses that OmegaConf turns into a structured config.

A run is described by one :class:`Config`. It is built from the defaults below, then an
optional YAML file, then command-line overrides in OmegaConf's dot-list form::

    parallelkit train --config examples/dcgan/dcgan.yaml train.epochs=3 parallel.ranks=4

OmegaConf checks every key and type against the dataclasses (a misspelt key or a string where
an int belongs is an error naming the key); :func:`validate` then checks every value that types
cannot (a batch that does not split over the data ranks, an unknown strategy, a timeout that
is not positive). Every mistake is one ``ValueError`` line naming the key, which the command
prints before exiting with status 2. The resolved config is saved as ``config.yaml`` in the
run directory, so a run can be repeated from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallelkit import models
from parallelkit.data.config import WITH_MASKS, DataConfig, check_config
from parallelkit.dims import GridDims
from parallelkit.models import zoo

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "classify": {"model.name": "resnet18", "model.width": 64, "data.name": "digits",
                 "data.num_classes": 10, "data.image_size": 32},
    "gan": {"model.name": "dcgan", "model.width": 64, "data.name": "digits",
            "data.num_classes": 10, "data.image_size": 32},
    "segment": {"model.name": "unet", "model.width": 16, "data.name": "shapes",
                "data.num_classes": 4, "data.image_size": 32},
}  # fmt: skip
"""Defaults that depend on ``train.task`` (the keys' defaults are ``${pk.default:KEY,TASK}``
interpolations): ``parallelkit train train.task=segment`` trains a U-Net on generated shapes."""


def _task_default(key: str, task: str) -> Any:
    # An unknown task resolves like classify, so that validate() names train.task itself.
    return TASK_DEFAULTS.get(task, TASK_DEFAULTS["classify"])[key]


# OmegaConf 2.4 renamed register_new_resolver (2.3, which the XLA environment may hold).
_register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
_register("pk.default", _task_default, replace=True)


def _default(key: str) -> Any:
    """The dataclass default of ``key``: its task default, resolved when the config is."""
    return f"${{pk.default:{key},${{train.task}}}}"

TASKS = ("classify", "gan", "segment")
STRATEGIES = ("data", "spatial", "channel", "hybrid")
OPTIMIZERS = ("sgd", "adam", "lars")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
STEMS = ("imagenet", "cifar")
FAULTS = ("exit", "raise", "raise_in_backward")  # see parallelkit.train.faults


@dataclass
class ModelConfig:
    """Which network. ``name`` is a :func:`parallelkit.models.create` name (``resnet18``,
    ``unet``, ... or another library's ``torchvision:NAME``, ``timm:NAME``, ``smp:ARCH``); for
    the GAN task it names the generator and the discriminator is its mirror. The default
    depends on the task (:data:`TASK_DEFAULTS`)."""

    name: str = _default("model.name")
    # resnet: "imagenet" (7x7 stride 2 + max pool) or "cifar" (3x3, no pooling). The default
    # main job uses "imagenet" on 32x32 digits: they are 8x8 images upscaled, so the 4x
    # downsampling loses nothing (99.7% test accuracy) and a step is 6x cheaper.
    stem: str = "imagenet"
    # resnet, unet: channels of the first stage; dcgan: ngf and ndf (zoo models: unused)
    width: int = _default("model.width")  # type: ignore[assignment]
    nz: int = 100  # dcgan: noise dimension
    kwargs: dict[str, Any] = field(default_factory=dict)  # more arguments for create()


@dataclass
class ParallelConfig:
    """How the ranks share the work.

    ``strategy`` alone spends every rank on it: "data" splits the batch, "spatial" splits each
    image by rows, "channel" splits convolution channels. Grid dimensions (``rows``, ``cols``,
    ``channel``) choose a hybrid: the ranks left over (``world / (rows * cols * channel)``)
    split the batch. ``ranks`` is how many local processes ``parallelkit train`` starts when no
    launcher (torchrun, mpiexec, srun, torch_xla.launch) started it.
    """

    strategy: str = "data"
    ranks: int = 2
    backend: str = "auto"  # auto | gloo | nccl | mpi | xla | local
    # auto: the backend's device (a GPU under nccl, the XLA device under xla), else the CPU;
    # cuda with gloo or mpi: each rank on GPU LOCAL_RANK % count, collectives staged on the host
    device: str = "auto"  # auto | cpu | cuda
    rows: int = 1
    cols: int = 1
    channel: int = 1
    timeout: float = 300.0  # seconds before a stuck collective (a dead rank) stops the job
    bucket_cap_mb: float = 25.0
    # a model with parameters that get no gradient (smp's encoder_depth < 5 keeps the unused
    # deeper stages): DataParallel then reduces a "used" flag with every bucket
    find_unused_parameters: bool = False
    # under spatial parallelism, an operation without an exact rule on blocks: "refuse" (a
    # ValueError before any rank waits) or "gather" (its module runs on whole images)
    fallback: str = "refuse"


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule.

    With ``scale_lr`` the rate is ``lr * batch_size / base_batch`` (Goyal et al.'s linear
    scaling rule), reached by a linear warm-up over ``warmup_epochs`` and then held or cosine
    decayed. "lars" is SGD with You et al.'s layer-wise trust ratio for large batches.
    """

    name: str = "sgd"
    lr: float = 0.1
    base_batch: int = 256
    scale_lr: bool = True
    momentum: float = 0.9
    weight_decay: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)  # adam
    trust_coefficient: float = 0.001  # lars
    warmup_epochs: float = 1.0
    schedule: str = "cosine"


@dataclass
class TrainConfig:
    """The loop. ``batch_size`` is global (all data ranks together), so a run with the same
    seed and batch size sees the same batches on any number of ranks."""

    task: str = "classify"  # classify | gan | segment
    epochs: int = 6
    batch_size: int = 64
    accumulate: int = 1  # micro-batches per optimizer step
    precision: str = "fp32"
    seed: int = 0
    max_steps: int = 0  # stop after this many optimizer steps (0: run every epoch)
    log_every: int = 10  # steps between global loss reductions and log lines
    eval_every: int = 1  # epochs
    checkpoint_every: int = 0  # steps; 0: at the end of every epoch
    keep_checkpoints: int = 2
    run_dir: str = "runs/${model.name}-${data.name}-${parallel.strategy}"
    resume: bool = False  # continue from the newest complete checkpoint in run_dir
    resume_fallback: bool = True  # newest checkpoint unreadable: resume from the next older
    overwrite: bool = False  # a new run replaces another run's outputs in run_dir
    checkpoint_on_signal: bool = False  # SIGINT/SIGTERM: finish the step, checkpoint, exit
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True  # curves.png in run_dir at the end (needs matplotlib)
    # Testing aids (parallelkit.train.faults): rank fail_rank (-1: the last) fails at step
    # fail_at_step, as fail_how says: exit | raise | raise_in_backward.
    fail_at_step: int = -1
    fail_rank: int = -1
    fail_how: str = "exit"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(
        default_factory=lambda: DataConfig(
            name=_default("data.name"),
            num_classes=_default("data.num_classes"),  # type: ignore[arg-type]
            image_size=_default("data.image_size"),  # type: ignore[arg-type]
        )
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


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
    check_config(cfg.data, "train")
    _one_of(t.task, TASKS, "train.task")
    _one_of(p.strategy, STRATEGIES, "parallel.strategy")
    _one_of(o.name, OPTIMIZERS, "optim.name")
    _one_of(o.schedule, SCHEDULES, "optim.schedule")
    _one_of(t.precision, PRECISIONS, "train.precision")
    _one_of(p.device, DEVICES, "parallel.device")
    _one_of(p.fallback, ("refuse", "gather"), "parallel.fallback")
    _one_of(t.fail_how, FAULTS, "train.fail_how")
    if cfg.model.name.startswith("resnet"):
        _one_of(cfg.model.stem, STEMS, "model.stem")
    positive = {
        "train.epochs": t.epochs,
        "train.batch_size": t.batch_size,
        "train.accumulate": t.accumulate,
        "train.log_every": t.log_every,
        "train.eval_every": t.eval_every,
        "parallel.ranks": p.ranks,
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
    _check_task(cfg)
    if p.strategy == "hybrid" and p.rows * p.cols * p.channel == 1:
        raise ValueError(
            "config: parallel.strategy=hybrid needs a model-parallel grid, e.g. parallel.rows=2"
        )
    if p.rows * p.cols > 1 and p.channel > 1:
        raise ValueError("config: spatial (rows/cols) and channel parallelism cannot be combined")


def _check_task(cfg: Config) -> None:
    """The model and the data must fit the task; a zoo model must be buildable here."""
    task, name, data = cfg.train.task, cfg.model.name, cfg.data.name
    if (task == "gan") != (name == "dcgan"):
        raise ValueError(
            f"config: train.task={task} with model.name={name}; the GAN task trains "
            "model.name=dcgan, and model.name=dcgan is for train.task=gan"
        )
    builtin_for = {"unet": "segment", "resnet18": "classify", "resnet34": "classify",
                   "resnet50": "classify"}  # fmt: skip
    if builtin_for.get(name, task) != task:
        raise ValueError(
            f"config: model.name={name} is a {builtin_for[name]} model, not one for "
            f"train.task={task}; segmentation: unet, smp:ARCH or a torchvision segmentation "
            "model; classification: resnet18/34/50, torchvision:NAME or timm:NAME"
        )
    masks = data in WITH_MASKS
    if task == "segment" and not (masks or data == "webdataset"):
        raise ValueError(
            f"config: train.task=segment needs masks: data.name=shapes, segfolder or "
            f"webdataset shards written from one, not {data}"
        )
    if task != "segment" and masks:
        raise ValueError(f"config: data.name={data} holds masks: use it with train.task=segment")
    if task == "gan" and cfg.train.accumulate > 1:
        raise ValueError("config: train.accumulate > 1 is for train.task=classify or segment")
    if zoo.is_zoo_name(name):
        zoo.check(name, dict(cfg.model.kwargs))
    elif name != "dcgan" and name not in models.list_models():
        raise ValueError(
            f"config: model.name={name!r} is not a model here: {models.list_models()}, dcgan, "
            "or another library's torchvision:NAME, timm:NAME, smp:ARCH"
        )


def _check_values(cfg: Config) -> None:
    """Numbers that must lie in a range; the first one that does not is named."""
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    rules = [
        ("parallel.timeout", p.timeout, p.timeout > 0, "must be > 0 (seconds)"),
        ("parallel.bucket_cap_mb", p.bucket_cap_mb, p.bucket_cap_mb > 0, "must be > 0"),
        ("train.max_steps", t.max_steps, t.max_steps >= 0, "must be >= 0 (0: every epoch)"),
        ("train.checkpoint_every", t.checkpoint_every, t.checkpoint_every >= 0, "must be >= 0"),
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
    """``Grid`` dimensions (data, rows, cols, channel) for ``world`` ranks."""
    dims = GridDims(rows=cfg.rows, cols=cfg.cols, channel=cfg.channel)
    if dims.model == 1 and cfg.strategy in ("spatial", "channel"):
        dims = GridDims.along(cfg.strategy, world)  # the strategy alone: every rank on it
    if world % dims.model:
        raise ValueError(
            f"config: {world} ranks do not split into groups of rows x cols x channel = "
            f"{dims.rows} x {dims.cols} x {dims.channel}; choose a grid whose product divides "
            f"{world}"
        )
    return dims.with_data(world // dims.model).as_dict()
