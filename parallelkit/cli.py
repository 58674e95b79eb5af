"""The ``parallelkit`` command. Subcommands grow with the library.

parallelkit info      versions, available backends and what ``pk.init("auto")`` would pick
"""

from __future__ import annotations

import argparse
import importlib.util
import platform

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parallelkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, backends, and what pk.init('auto') picks")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
