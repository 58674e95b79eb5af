"""What rank 0 shows and records: a progress bar, log lines, JSONL and TensorBoard metrics.

Only rank 0 writes; the other ranks get a :class:`Monitor` that does nothing, so the loop
calls it unconditionally. Values arrive already reduced over ranks (the loop reduces them
once per ``log_every`` steps, the only host synchronisation of a step).

``metrics.jsonl`` is appended to one record at a time, each flushed and fsynced, so a kill
loses at most the line being written. A resumed run first rewrites it (atomically) without
the records past the step it resumes from, so no step appears twice.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from parallelkit.train.store.files import atomic_text
from parallelkit.train.store.rundir import record


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        progress: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ) -> None:
        """resume_step: keep the earlier records up to this step (a resumed run); else start
        afresh."""
        self.enabled = enabled
        self.bar: tqdm | None = None
        self.progress = progress and enabled
        self.writer = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        atomic_text(path, kept_records(path, resume_step) if resume_step is not None else "")
        record(run_dir, path)
        self.jsonl = path.open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.print(
                    "tensorboard is not installed: no TensorBoard events (pip install "
                    "tensorboard, or train.tensorboard=false)"
                )
            else:
                self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int = 0) -> None:
        if self.progress:
            self.bar = tqdm(
                total=steps,
                initial=done,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="step",
                dynamic_ncols=True,
                leave=True,
                file=sys.stderr,
            )

    def advance(self, n: int = 1, **postfix: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log(self, kind: str, step: int, **values: Any) -> None:
        """One JSONL record ``{"kind", "step", "time", ...values}`` and TensorBoard scalars."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.end_epoch()
        if self.enabled:
            self.jsonl.close()
            if self.writer is not None:
                self.writer.close()  # its event file names end in this process's pid
                pattern = f"tensorboard/**/events.out.tfevents.*.{os.getpid()}.*"
                record(self.run_dir, *self.run_dir.glob(pattern))


def kept_records(path: Path, step: int) -> str:
    """The lines of ``path`` a run resumed at ``step`` keeps: records up to ``step``, without
    the summaries of earlier ends (the run will write its own) and without a torn last line."""
    if not path.is_file():
        return ""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        summary = isinstance(record, dict) and record.get("kind") == "summary"
        if isinstance(record, dict) and not summary and record.get("step", 0) <= step:
            kept.append(line + "\n")
    return "".join(kept)


def table(rows: list[tuple[str, str]], title: str) -> str:
    """A two-column text table, for the end of a run."""
    width = max(len(k) for k, _ in rows)
    value_width = max(len(v) for _, v in rows)
    rule = "+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+"
    lines = [title, rule]
    lines += [f"| {k:<{width}} | {v:>{value_width}} |" for k, v in rows]
    return "\n".join([*lines, rule])
