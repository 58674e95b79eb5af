"""The training configuration's shape: one typed dataclass per section of a run's config.

``model``, ``data``, ``parallel``, ``optim`` and ``train``, with every key's type and default;
OmegaConf turns :class:`Config` into a structured config that refuses a misspelt key or a
wrong type. The values' rules, and reading a run's config from defaults, a YAML file and
overrides, are :mod:`parallelkit.train.config`'s.

Why a file of its own: the tasks (:mod:`parallelkit.train.tasks`) read these dataclasses, and the
config reads the tasks (each task's name, defaults and checks live on its class); the shape at
the bottom lets both import downward.

A few defaults follow ``train.task`` (a segmentation run trains a U-Net on generated shapes):
they are the interpolation ``${pk.default:KEY,${train.task}}``, whose resolver
:mod:`parallelkit.train.config` registers from the task classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parallelkit.data.config import DataConfig


def _default(key: str) -> Any:
    """The dataclass default of ``key``: its task default, resolved when the config is."""
    return f"${{pk.default:{key},${{train.task}}}}"


@dataclass
class ModelConfig:
    """Which network. ``name`` is a :func:`parallelkit.models.create` name (``resnet18``,
    ``unet``, ... or another library's ``torchvision:NAME``, ``timm:NAME``, ``smp:ARCH``,
    ``monai:NAME``); for the GAN task it names the generator and the discriminator is its
    mirror. The default depends on the task (its class's ``defaults``,
    :mod:`parallelkit.train.tasks`)."""

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
    image by rows, "channel" splits convolution channels. Grid dimensions (``depth``, ``rows``,
    ``cols``, ``channel``; ``depth`` splits the D of volumes) choose a hybrid: the ranks left
    over (``world / (depth * rows * cols * channel)``) split the batch. ``ranks`` is how many
    local processes ``parallelkit train`` starts when no launcher (torchrun, mpiexec, srun,
    torch_xla.launch) started it.
    """

    strategy: str = "data"
    ranks: int = 2
    backend: str = "auto"  # auto | gloo | nccl | mpi | xla | local
    # auto: the backend's device (a GPU under nccl, the XLA device under xla), else the CPU;
    # cuda with gloo or mpi: each rank on GPU LOCAL_RANK % count, collectives staged on the host
    device: str = "auto"  # auto | cpu | cuda
    depth: int = 1
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
    # segment: ce | dice | dice_ce (train/tasks/losses.py), or package.module:fn; others: ce
    loss: str = "ce"
    epochs: int = 6
    batch_size: int = 64
    accumulate: int = 1  # micro-batches per optimizer step
    precision: str = "fp32"
    # torch.compile the parallelized networks (the step's forward and backward; docs/design.md
    # "Compiled steps": few graphs on gloo and NCCL, a graph break at each collective on MPI and
    # XLA), with torch.compile's backend compile_backend
    compile: bool = False
    compile_backend: str = "inductor"
    seed: int = 0
    max_steps: int = 0  # stop after this many optimizer steps (0: run every epoch)
    log_every: int = 10  # steps between global loss reductions and log lines
    eval_every: int = 1  # epochs
    checkpoint_every: int = 0  # steps; 0: at the end of every epoch
    # after the last step, BatchNorm's running statistics recomputed over this many training
    # batches for the final weights ("precise BN"; classify and segment); 0: off
    precise_bn: int = 0
    keep_checkpoints: int = 2
    run_dir: str = "runs/${pk.run_name:${model.name},${data.name},${parallel.strategy}}"
    resume: bool = False  # continue from the newest complete checkpoint in run_dir
    resume_fallback: bool = True  # newest checkpoint unreadable: resume from the next older
    overwrite: bool = False  # a new run replaces another run's outputs in run_dir
    checkpoint_on_signal: bool = False  # SIGINT/SIGTERM: finish the step, checkpoint, exit
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True  # curves.png in run_dir at the end (needs matplotlib)
    # Testing aids (parallelkit.train.loop.faults): rank fail_rank (-1: the last) fails at step
    # fail_at_step, as fail_how says: exit | raise | raise_in_backward.
    fail_at_step: int = -1
    fail_rank: int = -1
    fail_how: str = "exit"


@dataclass
class PredictConfig:
    """``parallelkit predict``: a trained run applied to whole samples (docs/inference.md).

    The samples are every image of ``split`` (``test``: the ``test`` or ``val`` folder) of
    ``data.name=FORMAT:DIR``, or the file or folder ``input``; each is predicted at its own
    full size, split over the ranks as ``parallel.depth/rows/cols`` say (the data ranks take
    different samples). ``output``: the folder of predictions, one per sample, in ``format``
    (zarr: OME-Zarr; nifti: .nii with the input's affine; nifti.gz: the same gzipped; npy).
    ``probabilities``: the softmax too, as ``dtype`` (float16 or float32). ``resume``: skip
    the samples already written whole; ``overwrite``: replace an earlier prediction in
    ``output``. ``levels``: OME-Zarr pyramid levels (``auto``: 2-D outputs over 4096 pixels
    get levels down to 2048; or a number). ``strict``: refuse samples at another pixel size
    (pyramid level) than the run trained on, instead of saying so.
    """

    output: str = ""
    split: str = "test"
    input: str = ""
    format: str = "zarr"
    probabilities: bool = False
    dtype: str = "float16"
    resume: bool = False
    overwrite: bool = False
    levels: str = "auto"
    strict: bool = False


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
    predict: PredictConfig = field(default_factory=PredictConfig)
