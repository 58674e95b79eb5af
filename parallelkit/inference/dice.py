"""Per-case and mean Dice of a prediction against labels: ``OUT/summary.json``, as nnU-Net
writes it for a Decathlon task's predictions.

    {"metric_per_case": [{"prediction_file": ..., "reference_file": ...,
                          "metrics": {"1": {"Dice": .., "IoU": .., "TP": .., "FP": .., "FN": ..,
                                            "n_pred": .., "n_ref": ..}, "2": {...}}}, ...],
     "mean": {"1": {"Dice": .., "IoU": ..}, ...},
     "foreground_mean": {"Dice": .., "IoU": ..}}

Every foreground class (1 .. K - 1, as nnU-Net's label regions) of every case. A class that
is neither predicted nor labelled in a case has no Dice there (``null``; nnU-Net's NaN), and
the means (over cases per class, then over classes) leave it out. The counts come from the
whole sample (each rank counts its block against the label's block; the sample's group sums
them), so the numbers are those of the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def case_counts(counts: Sequence[Sequence[float]]) -> dict[str, list[int]]:
    """A case's ``(3, K)`` pixel counts (predicted and labelled, predicted, labelled) as kept
    in its record."""
    inter, predicted, labelled = ([int(v) for v in row] for row in counts)
    return {"tp": inter, "predicted": predicted, "labelled": labelled}


def _class_metrics(tp: int, predicted: int, labelled: int) -> dict[str, Any]:
    fp, fn = predicted - tp, labelled - tp
    both = predicted + labelled
    return {
        "Dice": 2 * tp / both if both else None,
        "IoU": tp / (tp + fp + fn) if tp + fp + fn else None,
        "TP": tp, "FP": fp, "FN": fn, "n_pred": predicted, "n_ref": labelled,
    }  # fmt: skip


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def summary(cases: Sequence[tuple[str, str, dict[str, list[int]]]]) -> dict[str, Any]:
    """``summary.json`` of ``cases``: (prediction file, label file, :func:`case_counts`)."""
    per_case = []
    for prediction, reference, c in cases:
        metrics = {str(k): _class_metrics(c["tp"][k], c["predicted"][k], c["labelled"][k])
                   for k in range(1, len(c["tp"]))}  # fmt: skip
        per_case.append({"prediction_file": prediction, "reference_file": reference,
                         "metrics": metrics})  # fmt: skip
    classes = sorted({k for case in per_case for k in case["metrics"]}, key=int)
    mean = {k: {m: _mean([case["metrics"][k][m] for case in per_case if k in case["metrics"]])
                for m in ("Dice", "IoU")} for k in classes}  # fmt: skip
    foreground = {m: _mean([mean[k][m] for k in classes]) for m in ("Dice", "IoU")}
    return {"metric_per_case": per_case, "mean": mean, "foreground_mean": foreground}


__all__ = ["case_counts", "summary"]
