"""The training loop that ``parallelkit train`` runs on every rank.

    comm, grid   pk.init + a Grid (data x depth x rows x cols x channel) from the config
    data         every data rank reads its rows of each global batch; ranks of one spatial or
                 channel group read the same rows (they share a data rank), and per-pixel
                 targets (masks) only their block of them
    task         the protocol of parallelkit.train.protocol: networks parallelized with
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
import json
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
from parallelkit.train import checkpoint, preflight, rundir, tasks
from parallelkit.train.agree import agree, same_everywhere
from parallelkit.train.allocator import keep_freed_memory
from parallelkit.train.config import Config, to_yaml
from parallelkit.train.faults import maybe_fail
from parallelkit.train.files import atomic_text, atomic_torch_save, remove_stale
from parallelkit.train.monitor import Monitor, table
from parallelkit.train.plot import plot_run
from parallelkit.train.protocol import Task
from parallelkit.train.stopping import StopOnSignal, exit_now
from parallelkit.train.window import LossWindow


def requested_device(name: str) -> torch.device | None:
    """``parallel.device`` as the device this rank trains on; None leaves it to the backend.

    cuda: the GPU of this rank's local rank under any launcher (torchrun's LOCAL_RANK,
    srun's SLURM_LOCALID, mpiexec's), modulo the GPUs there are, so several ranks may share one.
    """
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device=cuda: torch sees no CUDA device on this machine")
        local_rank = launcher.detect().local_rank
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return None


def device_for(comm: pk.Communicator) -> torch.device:
    """Where this rank trains: the communicator's declared device (NCCL: its GPU, chosen by
    LOCAL_RANK; XLA: its XLA device), else the CPU."""
    return comm.device if comm.device is not None else torch.device("cpu")


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory: device memory on GPUs, the peak resident set on CPUs.

    Linux's VmHWM where there is one: ``ru_maxrss`` keeps the maximum across ``execve``, so a
    rank that the launcher started (a fork of it until the exec) would report at least the
    launcher's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def on_device(loader, device: torch.device):
    """XLA: batches move to the device in a background thread (MpDeviceLoader), so the step
    graph never waits for a host copy. Elsewhere the loop moves each batch itself."""
    if device.type != "xla":
        return loader
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    return MpDeviceLoader(loader, device)


def end_of_step(device: torch.device) -> None:
    """Cut the lazy XLA graph after each step, so that every step is the same graph."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


NORMALIZATION = "normalization.json"
"""The per-channel mean and std that a run's block reader normalizes with (FORMAT:DIR data)."""


def save_normalization(run_dir: Path, loader) -> None:
    """Keep the training data's normalization in the run, so that ``parallelkit predict``
    normalizes as training did without the training data at hand."""
    dataset = loader.dataloader.dataset
    if getattr(dataset, "normalizer", None) is not None:
        atomic_text(run_dir / NORMALIZATION, json.dumps(dataset.normalizer.spec()))
        rundir.record(run_dir, run_dir / NORMALIZATION)


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
    comm = comm or pk.init(
        cfg.parallel.backend,
        timeout=cfg.parallel.timeout,
        device=requested_device(cfg.parallel.device),
    )
    try:  # checked by the launcher already; ranks started by torchrun or mpiexec check here
        dims = preflight.check_grid(cfg, comm.size)
    except ValueError as e:
        raise same_everywhere(str(e), comm) from None
    grid = Grid(comm, **dims)
    t = cfg.train
    device = device_for(comm)
    run_dir = Path(t.run_dir)
    lead = comm.rank == 0
    lock, note = open_run_dir(cfg, comm)

    per_rank = t.batch_size // grid.data
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
            batch_size=per_rank,
            seed=t.seed,
            block=block,  # masks (and a block folder's images): this rank's block only
        )
        for split in ("train", "test")
    }
    check_first_batches(loaders, comm)
    train = loaders["train"]
    if lead:  # what parallelkit predict normalizes whole samples with
        save_normalization(run_dir, train)
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    task = tasks.create(cfg, grid, device, train)

    step, identity = resume(cfg, task, grid, device)
    monitor = Monitor(
        run_dir,
        lead,
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
    if split := datalist.split_note(cfg.data.name):  # a dataset.json: which cases are tested
        monitor.print(f"parallelkit train: {split}")
    total = task.total_steps
    window = LossWindow(grid.data_comm, t.batch_size)
    last: dict[str, float] = {}
    evals: dict[str, Any] = {}
    started = time.perf_counter()
    images = 0

    def log_window() -> None:
        losses, rate = window.reduce()
        last.update(losses, img_s=rate, img_s_per_rank=rate / comm.size, lr=task.lr())
        monitor.log("train", step, epoch=epoch, **last)
        monitor.advance(0, **losses, **task.headline(evals))

    def save_checkpoint() -> None:
        state = {"step": step, "task": task.state()}
        checkpoint.save(run_dir, step, state, grid, t.keep_checkpoints, identity.as_manifest())

    stop = StopOnSignal(comm.rank, t.checkpoint_on_signal)
    stop.install()  # until the end of the run: a signal during evaluation or export stops too
    for epoch in range(step // len(train), t.epochs):
        if step >= total:
            break
        done = step - epoch * len(train)
        train.set_epoch(epoch, start_batch=done)
        monitor.start_epoch(epoch, t.epochs, min(len(train), total - epoch * len(train)), done)
        for x, y in on_device(train, device):
            maybe_fail(t, comm, step, task.nets)  # a testing aid: off unless configured
            losses = task.step(x.to(device), y.to(device), step)
            end_of_step(device)
            step += 1
            images += len(x)
            window.add(losses)
            monitor.advance(1)
            if step % t.log_every == 0 or step == total:
                log_window()
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                save_checkpoint()
            if signum := stop.requested(comm, device, step):
                save_checkpoint()
                monitor.close()
                exit_now(128 + signum, f"parallelkit train: stopped at step {step}" * lead)
            if step >= total:
                break
        monitor.end_epoch()
        if window.steps:
            log_window()
        if step >= total and t.precise_bn:
            used = task.precise_bn(train, t.precise_bn)
            monitor.print(f"parallelkit train: BatchNorm statistics recomputed over {used} "
                          "training batches for the final weights (train.precise_bn)")
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                save_checkpoint()  # the last step's checkpoint again, with them
        if not t.checkpoint_every and (step == (epoch + 1) * len(train) or step >= total):
            save_checkpoint()
        due = (epoch + 1) % t.eval_every == 0 or step >= total
        if due and (found := task.evaluate(loaders["test"])):
            evals = found
            monitor.log("eval", step, epoch=epoch, **evals)
            monitor.print(f"epoch {epoch + 1}: {task.report(evals)}")
        task.end_epoch(epoch, run_dir if lead else None)

    seconds = time.perf_counter() - started
    memory = comm.all_gather(torch.tensor([peak_memory_mib(device)], device=device)).cpu()
    rate = images * grid.data / max(seconds, 1e-9)  # each data replica saw its own images
    dense = task.dense_state()
    if lead:
        for name, state in dense.items():
            atomic_torch_save(run_dir / f"{name}.pt", state)
            rundir.record(run_dir, run_dir / f"{name}.pt")
    result = {
        **last,
        **{f"test_{k}": v for k, v in evals.items() if not isinstance(v, list)},
        "steps": step,
        "seconds": seconds,
        "run_img_s": rate,  # over the whole run, evaluation and checkpoints included
        "peak_memory_mib": memory.max().item(),
    }
    monitor.log("summary", step, **result)
    monitor.print(summary_table(cfg, comm, grid, result, last, task.summary(evals)))
    monitor.close()
    if lead and t.plot:
        monitor.print(plot_run(run_dir))
        if (run_dir / "curves.png").is_file():
            rundir.record(run_dir, run_dir / "curves.png")
    stop.uninstall()
    if lock is not None:
        lock.release()
    return result
