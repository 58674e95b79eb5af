"""The task protocol: what the training loop asks of a task, and the set-up tasks share.

The loop (:mod:`parallelkit.train.loop.trainer`) knows epochs, logging, checkpoints and faults; a
task knows its networks and what a step, an evaluation and a report are. The loop calls

    task = TASKS[cfg.train.task](cfg, grid, device, train_loader)   # build
    losses = task.step(x, y, step)           # one optimizer step; {name: 0-dim tensor}
    evals = task.evaluate(test_loader)       # {} when the task has no evaluation
    task.report(evals), task.headline(evals), task.summary(evals)   # for a person
    task.end_epoch(epoch, run_dir)           # anything per epoch (GAN sample grids)
    task.state() / load_state() / dense_state() / lr()              # checkpoints, export

and never branches on which task it runs, so a new task is one new class (as torchtitan's
trainer and Lightning's ``LightningModule`` keep the loop apart from the model's code).

Shared set-up (:class:`Task`): :meth:`Task.add` parallelizes a dense network over the grid
with ``pk.parallelize`` (the same call for every strategy) and gives it an optimizer and a
schedule; checkpoint state is every network's dense-named state dict with its optimizer's.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

import parallelkit as pk
from parallelkit import models
from parallelkit.data import Loader
from parallelkit.models import imported, zoo
from parallelkit.parallel import DataParallel, Grid
from parallelkit.parallel.sharding import sharded_parameters
from parallelkit.train.schema import Config
from parallelkit.train.tasks.optim import build_optimizer, build_schedule

Losses = dict[str, torch.Tensor]
Metrics = dict[str, Any]


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``train.compile``), or ``model`` itself."""
    return getattr(model, "_orig_mod", model)


def unwrap(model: nn.Module) -> nn.Module:
    """The model without its torch.compile and DataParallel wrappers: what checkpoints hold,
    so that a run may resume with another number of data-parallel replicas."""
    model = uncompiled(model)
    return model.module if isinstance(model, DataParallel) else model


def no_sync(model: nn.Module, skip: bool):
    """Accumulate gradients locally (DataParallel.no_sync) when ``skip``."""
    model = uncompiled(model)
    if skip and isinstance(model, DataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def network(cfg: Config, classes: int, channels: int, **builtin: Any) -> nn.Module:
    """``model.name`` as a dense network: a built-in one gets ``builtin`` (widths, stem) unless
    ``model.kwargs`` gives them (``model.kwargs={widths: [8, 16, 32, 64, 128]}``: a U-Net of 5
    stages); another library's (``timm:NAME``, ...) or the user's own (``package.module:Class``)
    only ``model.kwargs``."""
    m = cfg.model
    extra = {} if zoo.is_zoo_name(m.name) or imported.is_import_path(m.name) else builtin
    return models.create(m.name, num_classes=classes, in_channels=channels,
                         **{**extra, **m.kwargs})


class Task:
    """The protocol (see the module docstring) with its shared set-up; subclasses build their
    networks in ``__init__`` with :meth:`add` and implement :meth:`step`.

    A task also says, on its class, what the config needs to know of it (``parallelkit.train
    .config`` reads it from here): its ``train.task`` name, the defaults that follow the task,
    the built-in networks made for it alone, whether it learns from masks, and any further
    check of the config.
    """

    name: ClassVar[str]
    """Its ``train.task``."""
    defaults: ClassVar[dict[str, Any]]
    """Defaults of ``model.name``, ``model.width``, ``data.name``, ``data.num_classes`` and
    ``data.image_size`` when this is the task."""
    networks: ClassVar[tuple[str, ...]] = ()
    """The built-in ``model.name`` values made for this task and no other."""
    trains: ClassVar[str] = ""
    """What ``model.name`` may be, for a person: named when a model of another task is chosen."""
    masks: ClassVar[bool] = False
    """Whether it learns from per-pixel masks (and only then may data hold masks)."""

    @classmethod
    def check(cls, cfg: Config) -> None:
        """What this task alone refuses in a config: a one-line ValueError naming the key."""

    @classmethod
    def dense_networks(cls, cfg: Config, train: Loader) -> dict[str, nn.Module]:
        """The task's dense networks by name, in the order ``__init__`` adds them, built on the
        current default device: :mod:`parallelkit.train.loop.preflight` builds them on the meta
        device before any rank starts, to find a ``model.kwargs`` they do not take."""
        raise NotImplementedError

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, train: Loader) -> None:
        self.cfg, self.grid, self.device = cfg, grid, device
        self.steps_per_epoch = len(train)
        epochs_steps = cfg.train.epochs * self.steps_per_epoch
        self.total_steps = min(epochs_steps, cfg.train.max_steps or epochs_steps)
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"
        )
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedules: dict[str, torch.optim.lr_scheduler.LRScheduler] = {}
        self.nets: dict[str, nn.Module] = {}

    # ------------------------------------------------------------------ the protocol
    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> Losses:
        """One optimizer step on this rank's batch; the losses as 0-dim device tensors (the
        loop averages them over the data group once per log interval)."""
        raise NotImplementedError

    def evaluate(self, loader: Loader) -> Metrics:
        """Metrics over the whole test split, the same on every rank; {} for none."""
        return {}

    def report(self, evals: Metrics) -> str:
        """One line after an evaluation."""
        return ", ".join(f"{k} {v:.4g}" for k, v in evals.items() if isinstance(v, float))

    def headline(self, evals: Metrics) -> dict[str, float]:
        """The few numbers the progress bar shows beside the losses."""
        return {}

    def summary(self, evals: Metrics) -> list[tuple[str, str]]:
        """Rows of the final table for the last evaluation."""
        return []

    def end_epoch(self, epoch: int, run_dir: Path | None) -> None:
        """After each epoch (collective over the model group); ``run_dir`` on rank 0 only."""

    @torch.no_grad()
    def precise_bn(self, loader: Loader, batches: int) -> int:
        """BatchNorm's running statistics recomputed for the final weights: the plain average
        of the batch statistics over ``batches`` training batches (in as many shuffled passes
        as that takes), forward only (Wu and Johnson's "precise BN", as fvcore's
        ``update_bn_stats``). Why: during training the
        running statistics trail the weights (an exponential average with momentum 0.1 of
        statistics that earlier weights produced), and an evaluation with them can be far
        worse than the network is. SyncBatchNorm merges each batch's statistics over the
        ranks, so the result is the 1-process one. Returns the batches used (collective)."""
        model = self.nets["model"]
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and m.track_running_stats]
        if not norms or batches < 1:
            return 0
        momenta = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # the cumulative average over the batches seen
        used, epoch = 0, 1 << 20  # orders of their own, the same on every rank
        while used < batches:
            loader.set_epoch(epoch)
            for x, _ in loader:
                with self.autocast:
                    model(x.to(self.device))
                used += 1
                if used == batches:
                    break
            epoch += 1
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        return used

    # ------------------------------------------------------------------ shared set-up
    def add(self, name: str, dense: nn.Module, **parallelize_kwargs: Any) -> nn.Module:
        """``dense`` parallelized over the grid, with an optimizer and a schedule; compiled
        where ``train.compile`` says (the network kept in ``nets`` is the uncompiled one)."""
        if self.cfg.parallel.find_unused_parameters:  # else parallelize's own choice
            parallelize_kwargs["find_unused_parameters"] = True
        net = pk.parallelize(
            dense.to(self.device),
            self.grid,
            self.grid,
            bucket_cap_mb=self.cfg.parallel.bucket_cap_mb,
            fallback=self.cfg.parallel.fallback,
            **parallelize_kwargs,
        )
        opt = build_optimizer(
            self.cfg.optim, net.parameters(), self.cfg.train.batch_size, sharded_parameters(net)
        )
        self.nets[name], self.optimizers[name] = net, opt
        self.schedules[name] = build_schedule(
            self.cfg.optim, opt, self.steps_per_epoch, self.total_steps
        )
        if self.cfg.train.compile:
            return torch.compile(net, backend=self.cfg.train.compile_backend)
        return net

    def update(self, name: str) -> None:
        self.optimizers[name].step()
        self.schedules[name].step()
        self.optimizers[name].zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.nets:
            out[name] = unwrap(self.nets[name]).state_dict()
            out[f"{name}.optimizer"] = self.optimizers[name].state_dict()
            out[f"{name}.schedule"] = self.schedules[name].state_dict()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        for name in self.nets:
            unwrap(self.nets[name]).load_state_dict(state[name])
            self.optimizers[name].load_state_dict(state[f"{name}.optimizer"])
            self.schedules[name].load_state_dict(state[f"{name}.schedule"])

    def dense_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every network in its original form (collective over channel groups)."""
        return {name: pk.to_dense(net).state_dict() for name, net in self.nets.items()}

    def lr(self) -> float:
        return next(iter(self.optimizers.values())).param_groups[0]["lr"]
