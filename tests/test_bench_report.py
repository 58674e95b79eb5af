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
CHAINER_DP, PK_DP = "ChainerMN multi-node optimizer", "parallelkit DataParallel"


def timed_rows() -> list[dict]:
    def t(workload: str, framework: str, transport: str, ranks: int, s: float) -> dict:
        return {
            "workload": workload,
            "framework": framework,
            "transport": transport,
            "ranks": ranks,
            "s": s,
        }

    return [
        t("bn", "chainer local BatchNormalization", "MPICH", 2, 0.01),
        t("bn", CHAINER_BN, "MPICH", 1, 0.010),
        t("bn", CHAINER_BN, "MPICH", 2, 0.015),
        t("bn", "torch local BatchNorm2d", "MPICH", 2, 0.004),
        t("bn", PK_BN, "MPICH", 1, 0.004),
        t("bn", PK_BN, "MPICH", 2, 0.005),
        t("bn", "torch local BatchNorm2d", "gloo", 2, 0.003),
        t("bn", PK_BN, "gloo", 1, 0.004),
        t("bn", PK_BN, "gloo", 2, 0.006),
        t("dp", "chainer bare (plain SGD)", "MPICH", 2, 0.100),
        t("dp", CHAINER_DP, "MPICH", 1, 0.090),
        t("dp", CHAINER_DP, "MPICH", 2, 0.101),
        t("dp", "torch bare (plain SGD)", "MPICH", 2, 0.020),
        t("dp", PK_DP, "MPICH", 1, 0.010),
        t("dp", PK_DP, "MPICH", 2, 0.023),
        t("spatial", "DTensor Shard(2)", "gloo", 2, 0.08),
    ]


def exact_rows() -> list[dict]:
    row = {"workload": "bn", "ranks": 2, "case": "uneven", "note": ""}
    return [
        {**row, "framework": PK_BN, "transport": "MPICH", "errors": {"y": 4e-16, "gx": 6e-16}},
        {**row, "framework": CHAINER_BN, "transport": "MPICH", "errors": {"y": 5.7e-2, "gx": 0.19}},
        {**row, "framework": "DTensor conv", "errors": {"y": 1e-16, "gx": "not produced"}},
        {**row, "framework": "torch.nn.SyncBatchNorm", "errors": {}, "note": "ValueError: GPU"},
    ]


def test_verdicts() -> None:
    verdicts = [peers_report.verdict(r) for r in exact_rows()]
    assert verdicts == ["exact", "WRONG", "WRONG", "refused"]


def test_mpi_transport() -> None:
    assert peers_report.mpi_transport("MPICH Version:      5.0.2") == "MPICH"
    assert peers_report.mpi_transport("Open MPI v4.1.5, package: Open MPI") == "Open MPI"
    assert peers_report.mpi_transport("MVAPICH2 Version      :\t2.3.7") == "MVAPICH"


def test_key_ratios_take_only_measured_pairs_on_their_transport() -> None:
    rows = peers_report.key_ratios(timed_rows())
    ratios = {r["measure"]: r["ratio"] for r in rows if r["workload"] == "bn"}
    assert ratios["ChainerMN overhead (MPICH): MultiNodeBN / local BN, 2 ranks"] == pytest.approx(
        1.5
    )
    mpi = "parallelkit overhead (MPICH): SyncBatchNorm / local BatchNorm2d, 2 ranks"
    gloo = "parallelkit overhead (gloo): SyncBatchNorm / local BatchNorm2d, 2 ranks"
    assert ratios[mpi] == pytest.approx(1.25)  # the MPICH rows, not gloo's
    assert ratios[gloo] == pytest.approx(2.0)
    key = "ChainerMN / parallelkit, 2 ranks, both MPICH (different times)"
    assert ratios[key] == pytest.approx(3.0)
    # no 1-rank local batch norm was timed: no raw-speed ratio
    # parallelkit's spatial rows were not timed: no DTensor ratio, no division by nothing
    assert not any("DTensor" in r["measure"] or "raw speed" in r["measure"] for r in rows)


def test_overheads_ratio_and_added_ms() -> None:
    over = {(o["workload"], o["framework"], o["transport"]): o for o in overheads()}
    assert len(over) == 5  # no DDP timed, no gloo DataParallel
    chainer = over["bn", CHAINER_BN, "MPICH"]
    assert chainer["ratio"] == pytest.approx(1.5)
    assert chainer["added_ms"] == pytest.approx(5.0)  # 15 ms at 2 ranks - 10 ms at 1
    assert chainer["base_ratio"] == pytest.approx(1.5)
    assert chainer["base_added_ms"] == pytest.approx(5.0)  # over local BN, 10 ms
    pk = over["bn", PK_BN, "gloo"]
    assert pk["added_ms"] == pytest.approx(2.0)
    assert pk["base_added_ms"] == pytest.approx(3.0)  # over gloo's local BN, not MPICH's
    pk_dp = over["dp", PK_DP, "MPICH"]
    assert pk_dp["added_ms"] == pytest.approx(13.0)
    assert pk_dp["base_added_ms"] == pytest.approx(3.0)
    table = peers_report.overhead_table(list(over.values()))
    assert f"| bn | {CHAINER_BN} | MPICH | 10.00 | 15.00 | 1.50 | +5.00 ms | 10.00 | 1.50 " in table
    assert "| added per step (2 − 1) |" in table


def overheads() -> list[dict]:
    return peers_report.overheads(timed_rows())


def test_goal_verdict() -> None:
    # SyncBN: parallelkit adds 1 ms (vs 5) over 1 rank and 1 ms (vs 5) over local BN: met.
    # DP: 13 ms (vs 11) over 1 rank, 3 ms (vs 1) over plain SGD: missed.
    line = peers_report.goal_verdict(overheads())
    assert line.startswith("**Goal, parallelkit's added time per step at or below ChainerMN's,")
    assert "both on MPICH: not met.**" in line
    assert "SyncBN met (parallelkit +1.00 ms vs ChainerMN +5.00 ms over its 1-rank step;" in line
    assert "DP missed (parallelkit +13.00 ms vs ChainerMN +11.00 ms" in line
    assert "\n" not in line
    # parallelkit's DP adds less than ChainerMN's over plain SGD, more over 1 rank: split
    pk_dp = {1: 0.005, 2: 0.0205}  # +15.5 ms over 1 rank (11), +0.5 ms over plain SGD (1)
    faster = [{**r, "s": pk_dp[r["ranks"]]} if r["framework"] == PK_DP else r for r in timed_rows()]
    line = peers_report.goal_verdict(peers_report.overheads(faster))
    assert "DP split" in line and "not met" in line
    both = [r for r in faster if r["workload"] == "bn"]
    both += [
        {**r, "s": 0.0101} if r["framework"] == PK_DP and r["ranks"] == 2 else r
        for r in timed_rows()
        if r["workload"] == "dp"
    ]
    assert "MPICH: met.**" in peers_report.goal_verdict(peers_report.overheads(both))
    # parallelkit on gloo only: nothing on MPI to set beside ChainerMN
    gloo = [
        r
        for r in timed_rows()
        if not r["framework"].startswith("parallelkit") or r["transport"] == "gloo"
    ]
    assert "SyncBN not measured on MPI" in peers_report.goal_verdict(peers_report.overheads(gloo))
    # another MPI library than ChainerMN's: not like for like
    other = [{**r, "transport": "Open MPI"} if r["framework"] == PK_BN else r for r in timed_rows()]
    other = [r for r in other if r["transport"] != "gloo"]
    line = peers_report.goal_verdict(peers_report.overheads(other))
    assert "SyncBN not comparable (ChainerMN on MPICH, parallelkit on Open MPI)" in line


def test_tables() -> None:
    times = peers_report.time_table(timed_rows())
    assert f"| bn | {CHAINER_BN} | MPICH | 10.00 | 15.00 | 1.50 | +5.00 |" in times
    assert f"| bn | {PK_BN} | gloo | 4.00 | 6.00 | 1.50 | +2.00 |" in times
    assert "| spatial | DTensor Shard(2) | gloo | - | 80.00 | - | - |" in times
    exact = peers_report.exact_table(exact_rows())
    assert f"| {CHAINER_BN} | MPICH | 2 | uneven | WRONG | y 5.7e-02, gx 1.9e-01 |" in exact
    assert "| refused |  | ValueError: GPU |" in exact
    text = peers_report.report(exact_rows(), timed_rows(), [], {2: 0.5}, {"torch": "2"}, "cmd")
    assert "## Parallel overhead per step" in text
    assert peers_report.goal_verdict(overheads()) in text


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
    assert "dense 100 ms, 2 ranks 50 ms, ratio 2.00 (goal >= 1.7): met" in text
    assert "dense 100 ms, 2 ranks 80 ms, ratio 1.25 (goal >= 1.7): MISSED" in text
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


# ---------------------------------------------------------------------------- ceiling, efficiency
def test_scaling_is_speedup_over_the_ceilings() -> None:
    from _common import scaling

    got = scaling(dense=100.0, ceiling=60.0, variant=80.0)
    assert got["speedup"] == pytest.approx(1.25)
    assert got["ceiling_speedup"] == pytest.approx(100 / 60)
    assert got["efficiency"] == pytest.approx(0.75)  # = ceiling / variant


def test_ceiling_rows_are_the_block_and_its_halo() -> None:
    from _common import ceiling_rows

    assert ceiling_rows(512, 2, 0, 3) == slice(0, 259)  # no halo past the image's edge
    assert ceiling_rows(512, 2, 1, 3) == slice(253, 512)
    assert ceiling_rows(7, 3, 1, 1) == slice(2, 6)  # tensor_split blocks 3, 2, 2: both sides
    assert ceiling_rows(128, 2, 0, 1, align=4) == slice(0, 68)  # a multiple of 4 rows
    assert ceiling_rows(128, 2, 1, 1, align=4) == slice(60, 128)


def test_spatial_resnet_efficiency_columns() -> None:
    import spatial_resnet as sr

    def ran(ms: dict[str, float]) -> dict:
        return {"ms": ms, "times": {k: [v / 1e3] for k, v in ms.items()}, "other_load_cores": 0}

    results = {
        1: ran({"dense": 1000.0, "pk": 1010.0}),
        2: ran({"pk": 625.0, "pk, overlap": 600.0, "leaf layers": 800.0, "ceiling": 550.0}),
    }
    sr.add_scaling(results)
    assert results[2]["scaling"]["pk"]["efficiency"] == pytest.approx(0.88)
    text = sr.report(sr.Config(size=128, batch=1), results, {"command": "x"})
    assert "| 2 | pk | 625 | 1.60 | 0.88 | 625 |" in text
    assert "| 2 | ceiling | 550 | 1.82 | 1.00 | 550 |" in text
    assert "| 1 | dense | 1000 | 1.00 | - | 1000 |" in text
    assert "ceiling 1.82x, efficiency 0.88 (goal >= 0.9: MISSED)" in text


def test_spatial_volume_efficiency_columns() -> None:
    import spatial_volume as sv

    row = volume_row("unet", 100.0, 50.0)
    row["ms"]["ceiling"], row["times"]["ceiling"] = 55.0, [0.055]
    row["cpu_ms"]["ceiling"], row["loss"]["ceiling"] = 30.0, 0.4
    row["halo"], row["scaling"] = sv.halo_check(row), sv.row_scaling(row)
    assert row["scaling"]["pk"]["efficiency"] == pytest.approx(1.1)
    env = {"command": "python benchmarks/spatial_volume.py --quick", "torch": "2.13.0"}
    text = sv.report(sv.Config(unet_size=32, stack_size=64, repeats=1), [row], env, 9.0)
    assert "ceiling 55 ms, ceiling speedup 1.82; efficiency 1.10 (goal >= 0.9): met" in text
    assert "| pk | 2 | 50 | 2.00 | 1.10 | 50 |" in text
    assert "| ceiling | 2 | 55 | 1.82 | 1.00 | 55 |" in text
    assert "| dense | 1 | 100 | 1.00 | - | 100 |" in text


def test_model_parallel_efficiency_columns() -> None:
    import model_parallel as mp

    err = {"pk out": 1e-7, "grouped": 0.7}
    rows = [
        {"part": "channel", "size": 64, "ranks": 1, "ms": {"dense": 90.0, "pk out": 92.0},
         "rel_err": {"pk out": 1e-7}},
        {"part": "channel", "size": 64, "ranks": 2, "rel_err": err,
         "ms": {"pk out": 60.0, "grouped": 30.0, "ceiling": 50.0}},
        {"part": "network", "size": 128, "ranks": 1, "ms": {"dense": 400.0},
         "loss": {"dense": 2.5}},
        {"part": "network", "size": 128, "ranks": 2,
         "ms": {"spatial": 300.0, "data": 250.0, "ceiling, rows": 240.0, "ceiling, batch": 220.0},
         "loss": {"spatial": 2.5, "data": 2.5}},
    ]  # fmt: skip
    mp.add_scaling(rows)
    assert rows[1]["scaling"]["pk out"]["efficiency"] == pytest.approx(50 / 60)
    assert "grouped" not in rows[1]["scaling"]  # not the dense convolution: no efficiency
    # dense 90, pk out 60 (1.50x), ceiling 50 (1.80x): efficiency 0.83
    assert "| 64 -> 64 | 2 | 90.0 | 60.0 | 1.50 | 50.0 | 1.80 | 0.83 | - | - | - |" in (
        mp.channel_table(rows, set())
    )
    network = mp.network_table(rows, 2)
    assert "| 128x128 | spatial | 2 | 2 | 300 | 1.33 | ceiling, rows | 0.80 |" in network
    assert "| 128x128 | data | 2 | 1 | 250 | 1.60 | ceiling, batch | 0.88 |" in network
    assert "| 128x128 | ceiling, batch | 2 | 1 | 220 | 1.82 | - | - | - | - |" in network
    for row in rows[:2]:
        row["size"] = 256  # the channel goal's width
    mp.add_scaling(rows)
    cfg = mp.config(mp.parse_args(["--quick", "--ranks", "1", "2"]))
    env = {"date": "today", "python": "3", "torch": "2", "cpu": "cpu", "nproc": "2"}
    rows = [{**r, "other_load_cores": 0.0} for r in rows]
    text = mp.report(rows, env, cfg, 1.0)
    assert "channel, 256 ch, 2 ranks: speedup 1.50 (goal >= 1.5): met; efficiency 0.83 " in text
    assert "(goal >= 0.9): MISSED" in text


def test_data_parallel_efficiency_rows() -> None:
    import data_parallel as dp

    def row(ranks: int, ms: dict[str, float]) -> dict:
        return {"ranks": ranks, "image_size": 32, "times": {k: [v / 1e3] for k, v in ms.items()}}

    rows = [
        row(1, {"dense": 200.0, "bare": 100.0, "pk": 101.0, "ddp": 102.0}),
        row(2, {"bare": 110.0, "ddp": 125.0, "pk": 120.0}),
    ]
    scaled = {s["variant"]: s for s in dp.scaling_rows(rows)}
    assert scaled["pk"]["ceiling_speedup"] == pytest.approx(200 / 110)
    assert scaled["pk"]["speedup"] == pytest.approx(200 / 120)
    assert scaled["pk"]["efficiency"] == pytest.approx(110 / 120)
    table = dp.scaling_table(list(scaled.values()))
    assert "| 32x32 | 2 | 200 | 110 | 1.82 | pk | 120 | 1.67 | 0.92 (goal >= 0.9: met) |" in table
    assert "| ddp | 125 | 1.60 | 0.88 (goal >= 0.9: MISSED) |" in table


def test_token_mixing_compares_each_path_with_its_dense_network() -> None:
    """The ring against the dense network with the same bias; memory against an even share
    of that network's, the most of the two ranks (rank 1 runs no dense step)."""
    import token_mixing

    def mem(largest: float, saved: float) -> dict:
        return {"largest_mib": largest, "saved_mib": saved}

    ms = {"dense": 100.0, "heads": 60.0, "dense, bias": 200.0, "ring": 120.0, "gather": 110.0}
    shared = {"heads": mem(5, 10), "ring": mem(10, 20), "gather": mem(10, 20)}
    dense = {"dense": mem(10, 20), "dense, bias": mem(20, 40)}
    row = {"case": "volume", "side": 8, "tokens": 1, "ms": ms}
    ranks = [{"rows": [{**row, "memory": {**dense, **shared}}]},
             {"rows": [{**row, "memory": {**shared, "ring": mem(11, 22)}}]}]  # fmt: skip
    env = {"command": "c", "cpu": "x", "nproc": "2", "python": "3", "torch": "t", "date": "d"}
    md = token_mixing.report(token_mixing.Config(), ranks, env)
    assert "| heads | 60 | 0.60 | 5.0 | 1.00 | 10.0 | 1.00 |" in md
    assert "| ring | 120 | 0.60 | 11.0 | 1.10 | 22.0 | 1.10 |" in md
    assert "| gather | 110 | 1.10 | 10.0 | 2.00 | 20.0 | 2.00 |" in md
