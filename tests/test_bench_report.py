"""The pure parts of the benchmarks: the peers tables and the plots, from tiny records.

Nothing here times anything or needs chainer: the rows are written by hand in the shape that
benchmarks/peers.py and the other scripts save.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peers_report

CHAINER_BN = "ChainerMN MultiNodeBatchNormalization"
PK_BN = "parallelkit SyncBatchNorm"


def timed_rows() -> list[dict]:
    return [
        {"workload": "bn", "framework": "chainer local BatchNormalization", "ranks": 2, "s": 0.01},
        {"workload": "bn", "framework": "torch local BatchNorm2d", "ranks": 2, "s": 0.004},
        {"workload": "bn", "framework": CHAINER_BN, "ranks": 1, "s": 0.010},
        {"workload": "bn", "framework": CHAINER_BN, "ranks": 2, "s": 0.015},
        {"workload": "bn", "framework": PK_BN, "ranks": 1, "s": 0.004},
        {"workload": "bn", "framework": PK_BN, "ranks": 2, "s": 0.005},
        {"workload": "spatial", "framework": "DTensor Shard(2)", "ranks": 2, "s": 0.08},
    ]


def exact_rows() -> list[dict]:
    row = {"workload": "bn", "ranks": 2, "case": "uneven", "note": ""}
    return [
        {**row, "framework": PK_BN, "errors": {"y": 4e-16, "gx": 6e-16}},
        {**row, "framework": CHAINER_BN, "errors": {"y": 5.7e-2, "gx": 1.9e-1}},
        {**row, "framework": "DTensor conv", "errors": {"y": 1e-16, "gx": "not produced"}},
        {**row, "framework": "torch.nn.SyncBatchNorm", "errors": {}, "note": "ValueError: GPU"},
    ]


def test_verdicts() -> None:
    verdicts = [peers_report.verdict(r) for r in exact_rows()]
    assert verdicts == ["exact", "WRONG", "WRONG", "refused"]


def test_key_ratios_take_only_measured_pairs() -> None:
    ratios = {r["measure"]: r["ratio"] for r in peers_report.key_ratios(timed_rows())}
    assert ratios["ChainerMN overhead: MultiNodeBN / local BN, 2 ranks"] == pytest.approx(1.5)
    key = "parallelkit overhead: SyncBatchNorm / local BatchNorm2d, 2 ranks"
    assert ratios[key] == pytest.approx(1.25)
    assert ratios["ChainerMN / parallelkit, 2 ranks (different times)"] == pytest.approx(3.0)
    # no 1-rank local batch norm was timed: no raw-speed ratio
    # parallelkit's spatial rows were not timed: no DTensor ratio, no division by nothing
    assert not any("DTensor" in m or "raw speed" in m for m in ratios)


def test_tables() -> None:
    times = peers_report.time_table(timed_rows())
    assert f"| bn | {CHAINER_BN} | 10.00 | 15.00 | 1.50 |" in times
    assert "| spatial | DTensor Shard(2) | - | 80.00 | - |" in times
    exact = peers_report.exact_table(exact_rows())
    assert "| WRONG | y 5.7e-02, gx 1.9e-01 |" in exact
    assert "| refused |  | ValueError: GPU |" in exact


def test_plots_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import plots

    peers = {"rows": timed_rows(), "exactness": exact_rows()}
    spatial = {"dense": 40.0, "pk": 25.0, "exchange": 3.0, "conv": 20.0}
    model_parallel = {
        "rows": [
            {"part": "spatial", "size": 64, "ranks": 1, "ms": {"dense": 40.0, "pk": 41.0}},
            {"part": "spatial", "size": 64, "ranks": 2, "ms": spatial},
            {"part": "channel", "size": 64, "ranks": 1, "ms": {"dense": 9.0}},
            {"part": "channel", "size": 64, "ranks": 2, "ms": {"pk out": 6.0}},
        ]
    }
    written = []
    for name, record in (("peers", peers), ("model_parallel", model_parallel)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(record))
        written += plots.plot(path)
    assert sorted(p.name for p in written) == [
        "model_parallel_speedup.png",
        "model_parallel_time_split.png",
        "peers_exactness.png",
        "peers_time.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    assert plots.plot(tmp_path / "unknown.json") == []
