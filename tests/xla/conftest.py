"""The XLA tier: run in the torch_xla environment (``make test-xla``), on XLA CPU devices.

This process is one replica on one XLA CPU device (world size 1): the communicator's
operations and every parallel layer run there against plain torch on the CPU. Multi-replica
tiers run in subprocesses, each with its own PJRT setup and a deadline:
``trace_replicas.py`` (4 replicas as threads: graphs traced, not run, since collectives
between CPU replicas cannot run, pytorch/xla#9089) and ``spmd_cases.py`` (SPMD over 4 CPU
devices, which do run collectives).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Before torch_xla starts its runtime: one CPU device here, one thread per device, and no
# LLVM optimization of the compiled programs (compiling dominates these tests: 4x faster).
XLA_ENV = {
    "PJRT_DEVICE": "CPU",
    "OMP_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false",
    "PARALLELKIT_TIMEOUT": "120",
}
os.environ.update(XLA_ENV)
os.environ["CPU_NUM_DEVICES"] = "1"

HERE = Path(__file__).resolve().parent


def run_script(name: str, out: Path, *args: str, timeout: float = 300, **env: str) -> dict:
    """Run ``tests/xla/<name> out args`` on 4 XLA CPU devices; return the JSON it wrote."""
    return run_scripts([(name, out, list(args), env)], timeout)[0]


def run_scripts(runs: list[tuple[str, Path, list[str], dict]], timeout: float) -> list[dict]:
    """Several ``(script, out, args, extra env)`` at once (one per core), each with a deadline."""
    procs = []
    for name, out, args, extra in runs:
        env = {**os.environ, **XLA_ENV, "CPU_NUM_DEVICES": "4", **extra}
        cmd = [sys.executable, str(HERE / name), str(out), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    failures = []
    for (name, _, args, _), proc in zip(runs, procs, strict=True):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            failures.append(f"{name} {args} did not finish in {timeout} s:\n{stderr[-3000:]}")
            continue
        if proc.returncode != 0:
            failures.append(
                f"{name} {args} failed (exit {proc.returncode}):\n{stdout[-2000:]}\n"
                f"{stderr[-6000:]}"
            )
    if failures:
        raise AssertionError("\n\n".join(failures))
    return [json.loads(out.read_text()) for _, out, _, _ in runs]
