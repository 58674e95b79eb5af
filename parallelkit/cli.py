"""parallelkit: train convolutional networks over many devices (data, spatial and channel
parallelism, exact against one device), and predict whole samples of any size with them.

parallelkit train [--config FILE] [--resume] [--check] [key=value ...]
                        train (parallelkit train --help lists every key); starts
                        parallel.ranks local ranks, or joins torchrun / mpiexec / srun;
                        --check: the checks made before any rank starts, then exit
parallelkit predict train.run_dir=RUN predict.output=OUT [key=value ...]
                        a trained segmentation run applied to whole samples of any size,
                        block by block over the ranks (docs/inference.md)
parallelkit data shard SRC OUT --samples-per-shard N
                        write a data set as WebDataset tar shards
parallelkit plot RUN_DIR
                        draw RUN_DIR/curves.png (losses and test metrics) from its metrics
parallelkit info        versions, available backends and what ``pk.init("auto")`` would pick
parallelkit plan --model M --image-size S [S S] [--dims 3] --batch B --ranks N [--blocks-in]
parallelkit plan --config RUN.yaml [key=value ...]
                        predicted step time and memory of every grid, ranked (parallelkit.plan),
                        and the parallel.* overrides of the best
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import signal
import sys

import torch

import parallelkit
from parallelkit.comm import detect_backend


def info() -> str:
    """A few lines describing this installation, for bug reports and benchmark headers."""

    def has(module: str) -> str:
        return "yes" if importlib.util.find_spec(module) else "no"

    lines = [
        f"parallelkit {parallelkit.__version__}",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()})",
        f"gloo: {torch.distributed.is_gloo_available()}, "
        f"nccl: {torch.distributed.is_nccl_available()}, "
        f"mpi4py: {has('mpi4py')}, torch_xla: {has('torch_xla')}",
        f"pk.init('auto') here: {detect_backend()}",
    ]
    return "\n".join(lines)


def train(argv: list[str]) -> int:
    """Parse the config; start the local ranks, or be one rank of a launched job.

    A mistake found before any rank starts (a config value, the data, the model, a run
    directory that belongs to another run) is one line on stderr and exit status 2. Under
    torchrun, mpiexec or srun every rank makes the same checks before its first collective,
    and every rank whose check fails says so in one line (naming its rank, when not 0) and
    exits 2; ranks that ``parallelkit train`` started leave the line to it
    (:mod:`parallelkit.train.ranks.startup`).
    """
    from parallelkit.comm import launcher
    from parallelkit.data.errors import DataError, one_line
    from parallelkit.train import config, keys
    from parallelkit.train.loop import preflight, trainer
    from parallelkit.train.ranks import launch, startup
    from parallelkit.train.ranks.agree import REFUSED, Stop
    from parallelkit.train.ranks.stopping import exit_now
    from parallelkit.train.store import rundir

    parser = argparse.ArgumentParser(
        prog="parallelkit train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a network. The config is the defaults, then --config FILE, then "
        "key=value overrides (OmegaConf dot-lists), e.g.\n  parallelkit train "
        "parallel.strategy=spatial parallel.ranks=4 train.epochs=3\n\n"
        "Run from a shell it starts parallel.ranks local ranks; started by torchrun, mpiexec "
        "or srun (an srun step of several tasks) each process is one rank.",
        epilog=keys.key_table(),
    )
    parser.add_argument("--config", help="a YAML file with any part of the config")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in train.run_dir")  # fmt: skip
    parser.add_argument("--print-config", action="store_true", help="print it and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="make every check made before the ranks start (config, grid, data headers, the "
        "model built on the meta device, run_dir) and exit: a dry run for a login node",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)  # --resume may come after overrides
    overrides = [*args.overrides, *(["train.resume=true"] if args.resume else [])]
    job, ranked = launcher.detect(), launch.under_launcher()
    startup.reached("checks")
    restore = None
    try:
        cfg = config.load(args.config, overrides)
        if args.print_config:
            print(config.to_yaml(cfg), end="")
            return 0
        if job.name == "inconsistent":
            raise ValueError(job.why)
        launch.check_world(cfg, job, launch.explicit("parallel.ranks", args.config, overrides))
        if ranked:
            startup.check_mpi_world(cfg.parallel.backend, job)
        world = job.world if ranked else cfg.parallel.ranks
        if cfg.parallel.backend == "xla" or (ranked and job.name == "none"):
            world = None  # XLA replicas: one per device, known to torch_xla alone
        if not ranked and not args.check:
            restore = launch.checks_on_one_thread(cfg)  # the ranks may then be forks
        preflight.check(cfg, world)
        if not ranked:
            rundir.check(cfg)  # the ranks check it again, holding the run's lock
        command = None if ranked else launch.local_command(cfg, argv)
    except ValueError as e:
        if ranked:
            startup.report("train", one_line(e))
        else:
            print(f"parallelkit train: error: {one_line(e)}", file=sys.stderr)
        return 2
    if args.check:
        if not ranked or job.rank == 0:
            who = launcher.started_by(job) if ranked else f"started here ({job.why})"
            ranks = f"{world} ranks" if world else "the XLA devices"
            print(f"parallelkit train: check passed for {ranks}; {who}")
        return 0
    if ranked:
        os.environ[launcher.STARTED] = launcher.started_by(job)  # read before init adds to it
        try:
            trainer.run(cfg, startup.join(cfg))
        except Stop as stop:  # every rank stops alike; one of them says why
            exit_now(stop.status, f"parallelkit train: error: {stop}" if stop.report else "")
        except DataError as e:  # this rank's file: one line, and the launcher stops the rest
            exit_now(REFUSED, f"parallelkit train: error: {one_line(e)}")
        return 0
    if cfg.parallel.backend == "xla":
        launch.launch_xla(trainer.run, cfg)
        return 0
    return run_or_launch("train", trainer.run, cfg, command, restore)


def run_or_launch(name: str, run, cfg, command: list[str] | None, threads: int | None) -> int:
    """``parallelkit NAME``'s ranks after the launcher's checks: ``run(cfg)`` in this process
    (``command`` None: one rank), or the local ranks started and supervised; the exit status.
    ``threads``: the OpenMP thread count the checks ran without (``checks_on_one_thread``),
    given back to a rank run here."""
    from parallelkit.data.errors import one_line
    from parallelkit.train.ranks import launch, procs
    from parallelkit.train.ranks.agree import Stop

    if command is None:  # one rank, in this process
        if threads is not None:
            torch.set_num_threads(threads)  # the threads asked for
        try:
            run(cfg)
        except (ValueError, Stop) as e:
            print(f"parallelkit {name}: error: {one_line(e)}", file=sys.stderr)
            return e.status if isinstance(e, Stop) else 2
        return 0
    status = launch.launch(command, cfg.parallel.ranks, cfg.parallel.backend, entry=main,
                           timeout=cfg.parallel.timeout)  # fmt: skip
    if status == procs.REFUSED_EXIT:
        return status  # the ranks stopped together, and one of them said why
    if status and status - 128 not in (signal.SIGINT, signal.SIGTERM):
        print(f"parallelkit {name}: a rank failed (exit status {status}); see above",
              file=sys.stderr)  # fmt: skip
    return status


def predict(argv: list[str]) -> int:
    """Read the run's config and the command line's keys; start the local ranks, or be one
    rank of a launched job (as :func:`train`). Mistakes found before any rank starts are one
    line on stderr and exit status 2."""
    from pathlib import Path

    from parallelkit.comm import launcher
    from parallelkit.data.errors import DataError, one_line
    from parallelkit.train import config
    from parallelkit.train.predict import command as predicting
    from parallelkit.train.ranks import launch, startup
    from parallelkit.train.ranks.agree import REFUSED, Stop
    from parallelkit.train.ranks.stopping import exit_now

    parser = argparse.ArgumentParser(
        prog="parallelkit predict",
        description="Apply a trained segmentation run to whole samples, each rank writing its "
        "block: parallelkit predict train.run_dir=RUN predict.output=OUT "
        "[data.name=FORMAT:DIR | predict.input=PATH] [parallel.ranks=N parallel.rows=N ...] "
        "[predict.format=zarr|nifti|npy predict.probabilities=true predict.resume=true "
        "predict.overwrite=true]",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    startup.reached("checks")
    job, ranked = launcher.detect(), launch.under_launcher()
    try:
        if job.name == "inconsistent":
            raise ValueError(job.why)
        runs = [o.partition("=")[2] for o in args.overrides if o.startswith("train.run_dir=")]
        if not runs:
            raise ValueError("train.run_dir=RUN is missing: the trained run to predict with")
        saved = Path(runs[-1]) / "config.yaml"
        if not saved.is_file():
            raise ValueError(f"train.run_dir={runs[-1]} is not a run: it has no config.yaml")
        cfg = config.load(str(saved), args.overrides)
        restore = None
        if ranked:
            startup.check_mpi_world(cfg.parallel.backend, job)
        else:
            restore = launch.checks_on_one_thread(cfg)  # the ranks may then be forks
            predicting.check(cfg, cfg.parallel.ranks)
            command = launch.local_command(cfg, argv, "predict")
    except ValueError as e:
        if ranked:
            startup.report("predict", one_line(e))
        else:
            print(f"parallelkit predict: error: {e}", file=sys.stderr)
        return 2
    if ranked:
        try:
            predicting.run(cfg, startup.join(cfg))
        except Stop as stop:
            exit_now(stop.status, f"parallelkit predict: error: {stop}" if stop.report else "")
        except DataError as e:
            exit_now(REFUSED, f"parallelkit predict: error: {one_line(e)}")
        return 0
    return run_or_launch("predict", predicting.run, cfg, command, restore)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # train and data hand the rest of the line to their own parsers.
    if argv[:1] == ["train"]:
        return train(argv[1:])
    if argv[:1] == ["predict"]:
        return predict(argv[1:])
    if argv[:1] == ["plan"]:
        from parallelkit.plan.command import main as plan_main

        return plan_main(argv[1:])
    if argv[:2] == ["data", "shard"]:
        from parallelkit.data import shard_main

        return shard_main(argv[2:])
    parser = argparse.ArgumentParser(
        prog="parallelkit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\ncommands:\n" + __doc__.split("\n\n")[1],
        epilog="docs/training.md (training, launching, Slurm), docs/inference.md (predict)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, backends, and what pk.init('auto') picks")
    plot = sub.add_parser("plot", help="draw RUN_DIR/curves.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    sub.add_parser("train", help="train a network (parallelkit train --help)")
    sub.add_parser(
        "predict", help="apply a trained run to whole samples (parallelkit predict --help)"
    )
    sub.add_parser("plan", help="rank the grids for a model (parallelkit plan --help)")
    data = sub.add_parser("data", help="data tools (parallelkit data shard --help)")
    data.add_subparsers(dest="data_command", required=True).add_parser(
        "shard", help="write WebDataset tar shards"
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    if args.command == "plot":
        from pathlib import Path

        from parallelkit.train.loop.plot import FILE, plot_run

        line = plot_run(Path(args.run_dir))
        print(line, file=sys.stdout if line.startswith("curves:") else sys.stderr)
        return 0 if (Path(args.run_dir) / FILE).is_file() else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
