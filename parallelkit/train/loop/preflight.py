"""Checks made before any rank starts: a mistake is one line and exit status 2, not a traceback
from every rank.

:func:`parallelkit.train.config.validate` checks each value alone. What needs the world size,
the data or the model is checked here, where ``parallelkit train`` starts its ranks
(:mod:`parallelkit.cli`), in this order:

    device      NCCL and ``parallel.device=cuda`` find a GPU here
    grid        the model-parallel grid divides the ranks; the global batch splits over the
                data ranks and the micro-batches (``train.accumulate``)
    data        the training split gives every data rank at least one full batch, and both
                splits open (not read: digits and generated sets are small, folders listed,
                a block folder's headers read: sizes, types, the crop against every sample)
    model       the task's dense networks built on the meta device (no memory, no time): a
                ``model.kwargs`` the constructor does not take is named; the network run
                forward there on two samples of the crop's size (a size it cannot take)
    run_dir     ``train.run_dir`` is a directory, or can be made one (no file on the way), this
                user may write there, and its file system has room for the checkpoints kept
                and the exported model (estimated from the meta-built networks)

Ranks started by torchrun, mpiexec or srun make the same checks, each on its own before any
collective (:mod:`parallelkit.cli`): every rank reaches the same verdict, rank 0 says it.
Nothing here reads a sample's values or writes into the data: the statistics a block folder
needs are computed by the ranks, each streaming its share of the files
(:func:`parallelkit.data.loader.share_statistics`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parallelkit.data import Loader, build_loader
from parallelkit.data.config import crop_key, crop_shape
from parallelkit.data.loader import block_layout
from parallelkit.train.config import Config, grid_dims
from parallelkit.train.tasks import TASKS

MiB = 2**20
# Per parameter, what an optimizer keeps beside it in a checkpoint (momentum; Adam's moments).
OPTIMIZER_SLOTS = {"sgd": 1, "lars": 1, "adam": 2}


def check(cfg: Config, world: int | None) -> None:
    """Everything that can be checked before ``world`` ranks start (None: not known here, as
    under torch_xla.launch); a one-line ``ValueError`` for the first mistake."""
    check_device(cfg)
    dims = check_grid(cfg, world) if world is not None else None
    loader = check_data(cfg, dims)
    nets = build_on_meta(cfg, loader)
    check_runs(cfg, nets, loader)
    check_run_dir(Path(cfg.train.run_dir), space_needed(cfg, nets) if nets else 0)


def check_device(cfg: Config) -> None:
    """NCCL and ``parallel.device=cuda`` need a GPU that torch sees here, where the local
    ranks will run."""
    p = cfg.parallel
    if (p.backend == "nccl" or p.device == "cuda") and not torch.cuda.is_available():
        key = "parallel.backend=nccl" if p.backend == "nccl" else "parallel.device=cuda"
        raise ValueError(
            f"config: {key} needs a GPU, and torch sees none on this machine (torch "
            f"{torch.__version__}); use parallel.backend=gloo or mpi and parallel.device=cpu"
        )


def check_grid(cfg: Config, world: int) -> dict[str, int]:
    """The grid's dimensions for ``world`` ranks; the global batch must split over them."""
    dims = grid_dims(cfg.parallel, world)
    t = cfg.train
    if t.batch_size % (dims["data"] * t.accumulate):
        raise ValueError(
            f"config: train.batch_size={t.batch_size} must split into {dims['data']} "
            f"data-parallel ranks x {t.accumulate} micro-batches (train.accumulate); "
            f"choose a multiple of {dims['data'] * t.accumulate}"
        )
    given, shape = crop_key(cfg.data), crop_shape(cfg.data)  # the crop as written, and read
    # A square's side bounds the depth split too (refused later, with its own line, for images).
    sides = dict(
        zip(("depth", "rows", "cols"), (shape[0],) * (3 - len(shape)) + shape, strict=True)
    )
    for key, side in sides.items():
        if dims[key] > side:
            shown = given if given.endswith(f"={side}") else f"{given} ({key}: {side})"
            raise ValueError(
                f"config: {shown} has fewer planes than the parallel.{key}={dims[key]} blocks "
                f"it is split into, so some rank would hold none; use fewer ranks along it or "
                f"a larger {given.partition('=')[0]}"
            )
    return dims


def check_data(cfg: Config, dims: dict[str, int] | None) -> Loader:
    """Data rank 0's training loader, after its test loader (neither iterated: no worker
    starts, no image is read; a folder's files are opened for their headers)."""
    data = dims["data"] if dims else 1
    grid = (dims["depth"], dims["rows"], dims["cols"]) if dims else None
    block = block_layout(cfg.data, grid, (0, 0, 0)) if grid else None  # the first rank's
    loaders = [
        build_loader(
            cfg.data,
            split,
            rank=0,
            size=data,
            batch_size=cfg.train.batch_size // data,
            seed=cfg.train.seed,
            block=block,
            measure=False,  # headers only: the ranks share the statistics out
        )
        for split in ("train", "test")
    ]
    return loaders[0]


def build_on_meta(cfg: Config, loader: Loader) -> dict[str, nn.Module] | None:
    """The task's dense networks on the meta device; a constructor that refuses the config's
    arguments is a config mistake. None when a network cannot be built on the meta device for
    another reason (the ranks then build it for real, and say what is wrong)."""
    m = cfg.model
    try:
        with torch.device("meta"), _NoFills():
            return TASKS[cfg.train.task].dense_networks(cfg, loader)
    except (TypeError, ValueError) as e:
        what = " ".join(str(e).split())[:300]
        kwargs = f" with model.kwargs={dict(m.kwargs)}" if m.kwargs else ""
        raise ValueError(f"config: model.name={m.name} cannot be built{kwargs}: {what}") from None
    except Exception:
        return None


def check_runs(cfg: Config, nets: dict[str, nn.Module] | None, loader: Loader) -> None:
    """The task's network runs forward on a batch of two samples of the loader's shape, on the
    meta device (no memory, no time): a size it cannot take (a U-Net whose skip connections
    meet halves of an odd size) is a config mistake, said before any rank starts rather than as
    a traceback from every rank. Failures of the meta device itself are left to the ranks."""
    net = (nets or {}).get("model")
    if net is None or not loader.shape:
        return
    try:
        with torch.no_grad(), _NoFills():
            net(torch.empty(2, loader.channels, *loader.shape, device="meta"))
    except RuntimeError as e:
        what = " ".join(str(e).split())
        if "meta" in what.lower():
            return  # an operation the meta device does not run
        raise ValueError(
            f"config: model.name={cfg.model.name} does not run on samples of "
            f"{'x'.join(map(str, loader.shape))} ({crop_key(cfg.data)}): {what[:200]}; choose "
            "a size it takes (a network that halves the size k times takes multiples of 2^k)"
        ) from None
    except Exception:
        return


class _NoFills(TorchFunctionMode):
    """Skips the weight initializers' writes of values into meta tensors, which hold none.

    torch runs several of them on the meta device (``normal_``, ``erfinv_``, ``clamp_``) through
    Python references whose first call imports ``torch._dynamo``: about a second of CPU at the
    start of every ``parallelkit train``, spent before any rank may start. Shapes, dtypes and
    everything else still run as written.
    """

    FILLS = frozenset(
        {"normal_", "uniform_", "trunc_normal_", "erfinv_", "clamp_", "exponential_",
         "log_normal_", "cauchy_", "geometric_", "kaiming_normal_", "kaiming_uniform_",
         "xavier_normal_", "xavier_uniform_", "orthogonal_"}
    )  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        name = getattr(func, "__name__", None)
        if name in self.FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **(kwargs or {}))


def space_needed(cfg: Config, nets: dict[str, nn.Module]) -> int:
    """Bytes the run writes at most: ``train.keep_checkpoints`` checkpoints and the one being
    written (weights, buffers and the optimizer's state), and the exported dense model."""
    weights = sum(
        t.numel() * t.element_size()
        for net in nets.values()
        for t in (*net.parameters(), *net.buffers())
    )
    params = sum(p.numel() * p.element_size() for net in nets.values() for p in net.parameters())
    checkpoint = weights + OPTIMIZER_SLOTS.get(cfg.optim.name, 1) * params
    return (cfg.train.keep_checkpoints + 1) * checkpoint + weights


def check_run_dir(run_dir: Path, need: int) -> None:
    """``run_dir`` is a directory or can be made one, writable here, with ``need`` bytes free."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest part of the path that is there
    key = f"train.run_dir={run_dir}"
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"lies under {existing}, which is a file"
        raise ValueError(f"{key} {where}, not a directory; choose another train.run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it" if existing == run_dir else f"{existing}, where it would be made,"
        why = "is on a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else (
            "is not writable by this user")  # fmt: skip
        raise ValueError(f"{key}: {what} {why}; choose another train.run_dir")
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ValueError(
            f"{key}: {free / MiB:.0f} MiB free on its file system, and the run needs about "
            f"{need / MiB:.0f} MiB (the checkpoints kept, the one being written and the "
            "exported model); free some space, lower "
            "train.keep_checkpoints, or choose another train.run_dir"
        )
