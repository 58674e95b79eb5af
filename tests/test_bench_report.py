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


def volume_row(workload: str, dense: float, pk: float) -> dict:
    """A spatial_volume row in the shape the script saves (2 layers fetching along D)."""
    layer = {"layer": "0", "kind": "Conv3d", "input": [1, 8, 4, 4, 4], "planes": [1, 1]}
    planes = [
        {**layer, "bytes": [512, 512], "grad": False},
        {**layer, "bytes": [512, 512], "grad": True},
    ]
    split = {"halo exchange": 2.0, "reductions": 1.0, "host metadata": 0.0}
    return {
        "workload": workload,
        "ranks": 2,
        "times": {"dense": [dense / 1e3], "pk": [pk / 1e3]},
        "ms": {"dense": dense, "pk": pk},
        "cpu_times": {"dense": [dense / 1e3], "pk": [pk / 2e3]},
        "cpu_ms": {"dense": dense, "pk": pk / 2},
        "loss": {"dense": 0.5, "pk": 0.5},
        "split_ms": {**split, "compute and the rest": pk - 3.0, "step": pk},
        "idle_rank": {"cpu_s": 0.01, "wall_s": 1.0},
        "other_load_cores": 0.1,
        "bytes_fwd": [{"sent": 1024, "received": 1024, "self_copied": 0}] * 2,
        "bytes_bwd": [{"sent": 512, "received": 512, "self_copied": 0}] * 2,
        "layers": planes,
    }


def test_spatial_volume_report_and_halo_check() -> None:
    import spatial_volume as sv

    rows = [volume_row("unet", 100.0, 50.0), volume_row("stack", 100.0, 80.0)]
    for row in rows:
        row["halo"] = sv.halo_check(row)
    assert rows[0]["halo"]["predicted"] == [1024, 1024]  # both layers forward
    assert rows[0]["halo"]["predicted_bwd"] == [512, 512]  # the input needs no gradient
    assert rows[0]["halo"]["agree"]
    env = {"command": "python benchmarks/spatial_volume.py --quick", "torch": "2.13.0"}
    text = sv.report(sv.Config(unet_size=32, stack_size=64, repeats=1), rows, env, 9.0)
    assert "dense 100 ms, 2 ranks 50 ms, ratio 2.00 (goal >= 1.6): met" in text
    assert "dense 100 ms, 2 ranks 80 ms, ratio 1.25 (goal >= 1.6): MISSED" in text
    assert "dense 100 ms, 2 ranks 25 ms, ratio 4.00" in text  # CPU time per rank
    assert "counted == predicted by geometry on every rank: yes" in text
    assert "| 2 (4%) | 1 (2%) | 0 (0%) | 47 (94%) | 50 |" in text  # the split of the unet step
    rows[1]["bytes_bwd"] = [{"sent": 1024, "received": 1024, "self_copied": 0}] * 2
    assert not sv.halo_check(rows[1])["agree"]  # a gradient sent back for the input: caught


def test_spatial_volume_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import plots

    path = tmp_path / "spatial_volume.json"
    path.write_text(json.dumps({"rows": [volume_row("unet", 100.0, 50.0)]}))
    assert [p.name for p in plots.plot(path)] == ["spatial_volume.png"]
    assert (tmp_path / "spatial_volume.png").read_bytes().startswith(b"\x89PNG")
