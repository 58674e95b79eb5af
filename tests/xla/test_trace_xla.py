"""Four XLA replicas trace steps of the parallel layers; their graphs hold the collectives.

``trace_replicas.py`` runs once (4 CPU devices, one thread each, nothing executed) and gives,
per scenario and replica, the collective lines of the traced HLO. Each test names the
operations the step must contain, with their replica groups (a communicator's group and its
split siblings: XLA needs the whole partition) or collective-permute (source, target) pairs,
on every replica. A negative control shows the check fails on a graph without them.
"""

from __future__ import annotations

import re

import pytest
from conftest import run_script

WORLD = "{}"  # XLA's replica_groups for "all replicas"
PAIRS = "{{0,1},{2,3}}"  # Grid(data=2, rows=2).spatial_comm and its sibling
COLUMNS = "{{0,2},{1,3}}"  # the H exchange of a 2 x 2 grid
ALONG_ROWS = {(0, 1), (1, 0), (2, 3), (3, 2)}  # halo both ways inside {0,1} and {2,3}
ALONG_COLUMNS = {(0, 2), (2, 0), (1, 3), (3, 1)}


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace") / "collectives.json"
    return run_script("trace_replicas.py", out, timeout=240)


def ops(lines: list[str], op: str, groups: str | None = None) -> list[str]:
    """The lines of operation ``op`` (with these replica groups, if given)."""
    found = [line for line in lines if re.search(rf"\s{op}\(", line)]
    if groups is not None:
        found = [line for line in found if f"replica_groups={groups}," in line]
    return found


def pairs(line: str) -> set[tuple[int, int]]:
    text = re.search(r"source_target_pairs=\{(\{\d+,\d+\},?)*\}", line).group(0)
    return {(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text)}


def expect(traced: dict, scenario: str, want: dict[tuple[str, str | None], int]) -> None:
    """On every replica: ``want[(op, groups)]`` operations at least (groups None: any)."""
    for rank, lines in traced[scenario].items():
        for (op, groups), count in want.items():
            got = len(ops(lines, op, groups))
            assert got >= count, (
                f"{scenario}, rank {rank}: {got} {op} with groups {groups}, expected {count}:\n"
                + "\n".join(lines)
            )


def test_nothing_was_executed(traced):
    assert traced["executions"] == {str(r): 0 for r in range(4)}


def test_negative_control(traced):
    """The check fails on a plain convolution's graph, which has no collective."""
    assert traced["dense"] == {str(r): [] for r in range(4)}
    with pytest.raises(AssertionError):
        expect(traced, "dense", {("all-reduce", None): 1})


def test_spatial_conv_inside_data_groups(traced):
    """Grid(data=2, rows=2): halos between the two row blocks of each data replica, the
    parameter gradients summed over the spatial pair, the input gradient gathered there."""
    expect(traced, "spatial rows in data groups", {
        ("collective-permute", None): 2,  # forward halo, backward halo gradients
        ("all-reduce", PAIRS): 2,  # weight and bias gradients
        ("all-gather", PAIRS): 1,  # pk.spatial.scatter's backward
    })  # fmt: skip
    for lines in traced["spatial rows in data groups"].values():
        for line in ops(lines, "collective-permute"):
            assert pairs(line) == ALONG_ROWS  # one round carries both directions


def test_spatial_conv_on_a_2x2_grid(traced):
    """Halos along H inside grid columns, along W inside grid rows; gradients over all."""
    expect(traced, "spatial 2x2", {("collective-permute", None): 4, ("all-reduce", WORLD): 2})
    for rank, lines in traced["spatial 2x2"].items():
        found = [pairs(line) for line in ops(lines, "collective-permute")]
        assert ALONG_COLUMNS in found and ALONG_ROWS in found, f"rank {rank}: {found}"
        assert ops(lines, "all-reduce", COLUMNS), f"rank {rank}: no gather along columns"


@pytest.mark.parametrize(
    ("scenario", "gather", "groups"),
    [
        ("sync_batchnorm world", "all-gather", WORLD),
        ("sync_batchnorm pairs", "all-gather", PAIRS),
        # pin_layout (the default): torch_xla writes the all-gather as an all-reduce
        ("sync_batchnorm pinned", "all-reduce", WORLD),
    ],
)
def test_sync_batchnorm_step(traced, scenario, gather, groups):
    """Statistics (n, mean, M2) gathered forward, one all-reduce of both sums backward."""
    expect(traced, scenario, {(gather, groups): 1, ("all-reduce", groups): 1})
    for lines in traced[scenario].values():
        stats = ops(lines, gather, groups)[0]
        assert "[4,7]" in stats or "[2,7]" in stats  # a row of 1 + 2 * 3 per rank


def test_data_parallel_step(traced):
    """The parameters broadcast at construction and the gradient bucket averaged: both
    all-reduces over all replicas of the 242 parameters' values."""
    expect(traced, "data_parallel", {("all-reduce", WORLD): 2})
    for lines in traced["data_parallel"].values():
        assert all("f32[242]" in line for line in ops(lines, "all-reduce"))


def test_operations_with_uneven_blocks(traced):
    """all_gather of 3 + 2 rows and reduce_scatter into 4 + 2: blocks padded to the larger."""
    expect(traced, "operations pairs", {
        ("all-reduce", PAIRS): 2,  # all_reduce(max), broadcast
        ("all-gather", PAIRS): 1,
        ("reduce-scatter", PAIRS): 1,
    })  # fmt: skip
    for lines in traced["operations pairs"].values():
        assert "f32[6,5]" in ops(lines, "all-gather")[0]  # 2 ranks x 3 rows (padded)
        assert "f32[4,5]" in ops(lines, "reduce-scatter")[0]  # blocks of 4 rows
