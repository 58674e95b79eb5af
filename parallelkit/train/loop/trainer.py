"""The training loop that ``parallelkit train`` runs on every rank.

    comm, grid   pk.init + a Grid (data x depth x rows x cols x channel) from the config
    data         every data rank reads its rows of each global batch; ranks of one spatial or
                 channel group read the same rows (they share a data rank), and per-pixel
                 targets (masks) only their block of them
    task         the protocol of parallelkit.train.tasks.protocol: networks parallelized with
                 pk.parallelize, optimizers, one step, evaluation, what to report; the loop
                 never asks which task it runs
    loop         epochs of steps; every log_every steps one reduction of the losses (the only
                 host synchronisation); checkpoints; evaluation at epoch ends
    end          the dense model(s) exported, a summary table on rank 0

A step is deterministic given the seed, the step number and the checkpointed state, so a run
resumed from a checkpoint continues exactly as the uninterrupted run would have.

Faults (docs/training.md, "What happens when"): the run directory is checked and locked before
anything is written (:mod:`rundir`); every file is renamed into place complete
(:mod:`files`); SIGINT/SIGTERM stop the rank within a bounded time (:mod:`stopping`); an
exception ends the whole job at once (the communicator's exit hook).
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

import parallelkit as pk
from parallelkit.comm import launcher
from parallelkit.data import Loader, RankSampler, build_loader, datalist
from parallelkit.data.errors import DataError, one_line
from parallelkit.data.loader import block_layout, share_statistics
from parallelkit.parallel import Grid
from parallelkit.train import tasks
from parallelkit.train.config import Config, to_yaml
from parallelkit.train.loop import preflight
from parallelkit.train.loop.allocator import keep_freed_memory
from parallelkit.train.loop.faults import maybe_fail
from parallelkit.train.loop.log_interval import LogInterval
from parallelkit.train.loop.monitor import Monitor, table
from parallelkit.train.loop.plot import plot_run
from parallelkit.train.ranks.agree import agree, same_everywhere
from parallelkit.train.ranks.devices import (
    device_for,
    end_of_step,
    on_device,
    peak_memory_mib,
    requested_device,
)
from parallelkit.train.ranks.stopping import StopOnSignal, exit_now
from parallelkit.train.store import checkpoint, rundir
from parallelkit.train.store.files import atomic_text, atomic_torch_save, remove_stale
from parallelkit.train.tasks.protocol import Task


def open_run_dir(cfg: Config, comm: pk.Communicator) -> tuple[rundir.Lock | None, str | None]:
    """Check that ``run_dir`` is this run's to use (every rank, the same files: the same
    verdict), then on rank 0 take its lock, remove stale temporary files and unfinished
    checkpoints (saying so), clear an earlier run's outputs when overwriting, and save
    ``config.yaml``. Returns the lock and a note for the user (or None).

    The ranks agree on the verdict before going on: when another run took the lock between
    the launcher's check and this one (two runs started at once), every rank stops with one
    line (:mod:`agree`)."""
    t, lead = cfg.train, comm.rank == 0
    run_dir = Path(t.run_dir)
    problem, note, lock = "", None, None
    try:
        note = rundir.check(cfg, lock=lead)
        if lead:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = rundir.Lock(run_dir)
    except ValueError as e:
        problem = str(e)
    except OSError as e:
        problem = f"train.run_dir={run_dir} cannot be used: {e.strerror or e}"
    agree(comm, problem)
    if lead:
        remove_stale(run_dir)
        for folder in checkpoint.remove_incomplete(run_dir):
            print(
                f"parallelkit train: removed checkpoint {folder}: it has no manifest (a save "
                "that was interrupted, or a manifest that was deleted), so it cannot be verified",
                file=sys.stderr,
                flush=True,
            )
        if t.overwrite and not t.resume:
            rundir.clear_outputs(run_dir)
        atomic_text(run_dir / "config.yaml", to_yaml(cfg))
        rundir.record(run_dir, run_dir / "config.yaml")
    comm.barrier()
    return lock, note


def resume(
    cfg: Config, task: Task, grid: Grid, device: torch.device
) -> tuple[int, rundir.Identity]:
    """The step to start from and the run's identity: a new one, or the checkpoint's. A
    checkpoint whose state does not fit the task is reported like a damaged one, and the next
    older one is tried."""
    identity = rundir.new_identity(cfg)
    if not cfg.train.resume:
        return 0, identity

    def fit(folder: Path, state: dict[str, Any]) -> None:
        try:
            task.load_state(state["task"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            what = "; ".join(str(e).strip().splitlines())[:400]
            raise checkpoint.Unreadable(
                f"checkpoint {folder} does not fit this run's model ({cfg.model.name}) or "
                f"optimizer ({cfg.optim.name}): {type(e).__name__}: {what}"
            ) from None

    run_dir = Path(cfg.train.run_dir)
    found = checkpoint.load_newest_usable(run_dir, grid, device, cfg.train.resume_fallback, fit)
    if found is None:
        return 0, identity
    folder, state = found
    run_id = checkpoint.read_manifest(folder).get("run_id")
    return state["step"], rundir.new_identity(cfg, run_id)


def summary_table(
    cfg: Config,
    comm: pk.Communicator,
    grid: Grid,
    result: dict[str, Any],
    last: dict[str, float],
    evals: list[tuple[str, str]],
) -> str:
    """The table rank 0 prints at the end of a run."""
    t, rate = cfg.train, result["run_img_s"]
    rows = [
        ("task", f"{t.task} ({cfg.model.name} on {cfg.data.name})"),
        ("ranks", f"{comm.size} ({comm.backend})"),
        (
            "grid (data x depth x rows x cols x channel)",
            " x ".join(map(str, grid.dims.shape)),
        ),
        ("steps", str(result["steps"])),
        ("global batch", str(t.batch_size)),
        ("wall time (s)", f"{result['seconds']:.1f}"),
        ("images/s, global (whole run)", f"{rate:.1f}"),
        ("images/s per rank", f"{rate / comm.size:.1f}"),
        ("peak memory per rank, MiB (max)", f"{result['peak_memory_mib']:.0f}"),
    ]
    rows += [(f"train {k}", f"{last[k]:.4f}") for k in sorted(last) if k.startswith("loss")]
    rows += evals
    rows.append(("run directory", str(t.run_dir)))
    return table(rows, "parallelkit train: done")


def check_first_batches(loaders: dict[str, Loader], comm: pk.Communicator) -> None:
    """Every rank reads the first batch of each split before training (collective): a fault
    in the data (a label out of range, a corrupt file) stops every rank with one line now,
    not a traceback after the training split's epochs."""
    problem = ""
    for loader in loaders.values():
        data = loader.dataloader
        if not isinstance(data.sampler, RankSampler):
            continue  # a stream of shards, whose labels were checked when they were written
        try:  # in this process: no DataLoader workers to start for one batch
            for i in itertools.islice(iter(data.sampler), loader.batch_size):
                data.dataset[i]
        except DataError as e:
            problem = problem or one_line(e)
    agree(comm, problem)


def run(cfg: Config, comm: pk.Communicator | None = None) -> dict[str, Any]:
    """Train as configured; returns the final metrics (the same on every rank)."""
    keep_freed_memory()  # each step reuses the last one's memory: no page faults
    comm = comm or join(cfg)
    grid = make_grid(cfg, comm)
    device = device_for(comm)
    lock, note = open_run_dir(cfg, comm)
    loaders = make_loaders(cfg, grid, device)
    if comm.rank == 0:  # what parallelkit predict normalizes whole samples with
        rundir.save_normalization(Path(cfg.train.run_dir), loaders["train"])
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    task = tasks.create(cfg, grid, device, loaders["train"])
    step, identity = resume(cfg, task, grid, device)
    monitor = open_monitor(cfg, grid, device, step, note)
    loop = Loop(cfg, grid, device, task, monitor, identity, step)
    loop.stop.install()  # until the end of the run: a signal during evaluation or export stops too
    loop.epochs(loaders)
    result = loop.finish()
    loop.stop.uninstall()
    if lock is not None:
        lock.release()
    return result


def join(cfg: Config) -> pk.Communicator:
    """This rank's world communicator, on the configured backend and device."""
    p = cfg.parallel
    return pk.init(p.backend, timeout=p.timeout, device=requested_device(p.device))


def make_grid(cfg: Config, comm: pk.Communicator) -> Grid:
    """The configured grid over ``comm``. The launcher checked it already; ranks started by
    torchrun or mpiexec check here, every rank with the same message."""
    try:
        dims = preflight.check_grid(cfg, comm.size)
    except ValueError as e:
        raise same_everywhere(str(e), comm) from None
    return Grid(comm, **dims)


def make_loaders(cfg: Config, grid: Grid, device: torch.device) -> dict[str, Loader]:
    """The train and test loaders of this rank: its data rank's rows of each global batch,
    and of per-pixel targets (and a block folder's images) only its block; their first
    batches read by every rank before training (:func:`check_first_batches`)."""
    comm = grid.comm
    _, z, row, col, _ = grid.coords
    block = block_layout(cfg.data, grid.spatial, (z, row, col))  # this rank's, made once
    share_statistics(  # a block folder's channel statistics: each rank streams its share
        cfg.data, comm.rank, comm.size,
        lambda a: comm.all_reduce(torch.from_numpy(a).to(device)).cpu().numpy(),
    )  # fmt: skip
    loaders = {
        split: build_loader(
            cfg.data,
            split,
            rank=grid.data_comm.rank,
            size=grid.data,
            batch_size=cfg.train.batch_size // grid.data,
            seed=cfg.train.seed,
            block=block,
        )
        for split in ("train", "test")
    }
    check_first_batches(loaders, comm)
    return loaders


def open_monitor(
    cfg: Config, grid: Grid, device: torch.device, step: int, note: str | None
) -> Monitor:
    """The run's progress, logs and metrics (rank 0 writes them), and the header lines."""
    t, comm = cfg.train, grid.comm
    monitor = Monitor(
        Path(t.run_dir),
        comm.rank == 0,
        progress=t.progress,
        tensorboard=t.tensorboard,
        resume_step=step if t.resume else None,
    )
    if note:
        monitor.print(f"parallelkit train: {note}")
    monitor.print(f"parallelkit train: {launcher.started_by(launcher.detect())}")
    if device.type == "cpu" and cfg.parallel.device == "auto" and torch.cuda.is_available():
        monitor.print(
            f"parallelkit train: training on the CPU ({comm.backend} with parallel.device=auto), "
            "although torch sees a GPU here; parallel.device=cuda puts each rank on its GPU"
        )
    monitor.print(
        f"parallelkit train: {t.task} {cfg.model.name} on {cfg.data.name}, {comm.size} ranks "
        f"({comm.backend}), {grid}, global batch {t.batch_size}"
        + (f", resumed at step {step}" if step else "")
    )
    if split := datalist.split_note(cfg.data.source):  # a dataset.json: which cases are tested
        monitor.print(f"parallelkit train: {split}")
    return monitor


class Loop:
    """The epochs of one run from ``step`` on, and its end: the losses reduced every
    ``log_every`` steps, checkpoints, evaluation at epoch ends, a signal's stop, then the
    dense model(s) exported and the summary."""

    def __init__(
        self,
        cfg: Config,
        grid: Grid,
        device: torch.device,
        task: Task,
        monitor: Monitor,
        identity: rundir.Identity,
        step: int,
    ) -> None:
        self.cfg, self.t, self.grid, self.comm = cfg, cfg.train, grid, grid.comm
        self.device, self.task, self.monitor, self.identity = device, task, monitor, identity
        self.run_dir, self.lead = Path(cfg.train.run_dir), grid.comm.rank == 0
        self.step, self.epoch, self.images = step, 0, 0
        self.interval = LogInterval(grid.data_comm, cfg.train.batch_size)
        self.last: dict[str, float] = {}
        self.evals: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.stop = StopOnSignal(self.comm.rank, cfg.train.checkpoint_on_signal)

    def epochs(self, loaders: dict[str, Loader]) -> None:
        train, total = loaders["train"], self.task.total_steps
        for epoch in range(self.step // len(train), self.t.epochs):
            self.epoch = epoch
            if self.step >= total:
                break
            self.steps(train, total)
            self.monitor.end_epoch()
            if self.interval.steps:
                self.log_interval()
            self.end_epoch(train, loaders["test"], total)

    def steps(self, train: Loader, total: int) -> None:
        """The steps of this epoch, from where a resumed run left off."""
        t, epoch = self.t, self.epoch
        done = self.step - epoch * len(train)
        train.set_epoch(epoch, start_batch=done)
        self.monitor.start_epoch(epoch, t.epochs, min(len(train), total - epoch * len(train)),
                                 done)  # fmt: skip
        for x, y in on_device(train, self.device):
            maybe_fail(t, self.comm, self.step, self.task.nets)  # a testing aid: off unless set
            losses = self.task.step(x.to(self.device), y.to(self.device), self.step)
            end_of_step(self.device)
            self.step += 1
            self.images += len(x)
            self.interval.add(losses)
            self.monitor.advance(1)
            if self.step % t.log_every == 0 or self.step == total:
                self.log_interval()
            if t.checkpoint_every and self.step % t.checkpoint_every == 0:
                self.save_checkpoint()
            if signum := self.stop.requested(self.comm, self.device, self.step):
                self.save_checkpoint()
                self.monitor.close()
                said = f"parallelkit train: stopped at step {self.step}" * self.lead
                exit_now(128 + signum, said)
            if self.step >= total:
                break

    def end_epoch(self, train: Loader, test: Loader, total: int) -> None:
        """Precise BatchNorm statistics at the end, the epoch's checkpoint, evaluation."""
        t, step, epoch = self.t, self.step, self.epoch
        if step >= total and t.precise_bn:
            used = self.task.precise_bn(train, t.precise_bn)
            self.monitor.print(
                f"parallelkit train: BatchNorm statistics recomputed over {used} "
                "training batches for the final weights (train.precise_bn)"
            )
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                self.save_checkpoint()  # the last step's checkpoint again, with them
        if not t.checkpoint_every and (step == (epoch + 1) * len(train) or step >= total):
            self.save_checkpoint()
        due = (epoch + 1) % t.eval_every == 0 or step >= total
        if due and (found := self.task.evaluate(test)):
            self.evals = found
            self.monitor.log("eval", step, epoch=epoch, **found)
            self.monitor.print(f"epoch {epoch + 1}: {self.task.report(found)}")
        self.task.end_epoch(epoch, self.run_dir if self.lead else None)

    def log_interval(self) -> None:
        losses, rate = self.interval.reduce()
        self.last.update(losses, img_s=rate, img_s_per_rank=rate / self.comm.size,
                         lr=self.task.lr())  # fmt: skip
        self.monitor.log("train", self.step, epoch=self.epoch, **self.last)
        self.monitor.advance(0, **losses, **self.task.headline(self.evals))

    def save_checkpoint(self) -> None:
        state = {"step": self.step, "task": self.task.state()}
        checkpoint.save(self.run_dir, self.step, state, self.grid, self.t.keep_checkpoints,
                        self.identity.as_manifest())  # fmt: skip

    def finish(self) -> dict[str, Any]:
        """The dense model(s) saved, the summary logged and printed, the curves plotted; the
        final metrics."""
        comm, grid, device, run_dir = self.comm, self.grid, self.device, self.run_dir
        seconds = time.perf_counter() - self.started
        memory = comm.all_gather(torch.tensor([peak_memory_mib(device)], device=device)).cpu()
        rate = self.images * grid.data / max(seconds, 1e-9)  # each data replica, its images
        dense = self.task.dense_state()
        if self.lead:
            for name, state in dense.items():
                atomic_torch_save(run_dir / f"{name}.pt", state)
                rundir.record(run_dir, run_dir / f"{name}.pt")
        result = {
            **self.last,
            **{f"test_{k}": v for k, v in self.evals.items() if not isinstance(v, list)},
            "steps": self.step,
            "seconds": seconds,
            "run_img_s": rate,  # over the whole run, evaluation and checkpoints included
            "peak_memory_mib": memory.max().item(),
        }
        self.monitor.log("summary", self.step, **result)
        summary = self.task.summary(self.evals)
        self.monitor.print(summary_table(self.cfg, comm, grid, result, self.last, summary))
        self.monitor.close()
        if self.lead and self.t.plot:
            self.monitor.print(plot_run(run_dir))
            if (run_dir / "curves.png").is_file():
                rundir.record(run_dir, run_dir / "curves.png")
        return result
