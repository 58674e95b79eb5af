"""Curves of a run for a person: ``curves.png`` in the run directory, drawn with matplotlib.

Why a picture: TensorBoard needs a server and a browser; a PNG next to the checkpoints can be
opened anywhere, attached to a report, or looked at over ssh. At the end of a run rank 0 draws
the training losses and the evaluation metrics (test loss; accuracy or mIoU and pixel
accuracy) against the step, from ``metrics.jsonl`` (so a resumed run draws its whole
history). ``parallelkit plot RUN_DIR`` draws it again for any run.

matplotlib is optional (``pip install parallelkit[plot]``); without it the run says so and
writes no picture.
"""

from __future__ import annotations

import json
from pathlib import Path

LABELS = {
    "accuracy": "accuracy", "miou": "mIoU", "mdice": "mDice", "pixel_accuracy": "pixel accuracy",
}  # fmt: skip
PERCENT = tuple(LABELS)  # the test metrics drawn, in percent, under their labels
FILE = "curves.png"


def series(run_dir: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{"train": {key: [(step, value)]}, "eval": {...}}`` from ``metrics.jsonl``, the last
    record of a step winning (a resumed run may have logged it twice)."""
    by_step: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") in by_step:
            by_step[record["kind"]][int(record.get("step", 0))] = record
    out: dict[str, dict[str, list[tuple[int, float]]]] = {"train": {}, "eval": {}}
    for kind, records in by_step.items():
        for step in sorted(records):
            for key, value in records[step].items():
                wanted = key.startswith("loss") if kind == "train" else key in ("loss", *PERCENT)
                if wanted and isinstance(value, int | float):
                    out[kind].setdefault(key, []).append((step, float(value)))
    return out


def plot_run(run_dir: Path, path: Path | None = None) -> str:
    """Draw ``run_dir``'s curves into ``path`` (default ``run_dir/curves.png``); returns a
    line for the user saying where, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no curves.png (pip install matplotlib)"
    data = series(run_dir)
    if not data["train"]:
        return f"no training records in {run_dir}/metrics.jsonl: no curves.png"
    path = path or Path(run_dir) / FILE
    panels = 2 if data["eval"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    losses = axes[0][0]
    for key, points in sorted(data["train"].items()):
        losses.plot(*zip(*points, strict=True), label=f"train {key}")
    if "loss" in data["eval"]:
        losses.plot(*zip(*data["eval"]["loss"], strict=True), "o-", label="test loss")
    losses.set(xlabel="step", ylabel="loss", title="loss")
    losses.legend()
    if panels == 2:
        metrics = axes[0][1]
        for key in PERCENT:
            if key in data["eval"]:
                steps, values = zip(*data["eval"][key], strict=True)
                metrics.plot(steps, [100 * v for v in values], "o-", label=LABELS[key])
        metrics.set(xlabel="step", ylabel="%", title="test metrics")
        metrics.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"curves: {path}"
