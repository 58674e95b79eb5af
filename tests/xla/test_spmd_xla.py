"""SPMD on 4 XLA CPU devices: ResNet-18 and DCGAN sharded five ways, and a 3-D network over
depth and data x depth, match torch on the CPU.

``spmd_cases.py`` trains each network three SGD steps under each of its grids (ResNet-18 all
five: data, rows, cols, a hybrid, channel; each DCGAN network data, channel, its hybrid and
one of rows or cols, the other being the same annotation on the other dimension, proven on
ResNet-18 and by the discriminator's data x cols), in two processes side by side; this module
checks what they report. Per case: outputs, losses and every gradient
(each step), parameters and BatchNorm running statistics (after each step) equal the dense
CPU reference; no compilation after the second step; the input (or, for channel
parallelism, the first convolution's weight) really is sharded as asked, and the traced graph
carries sharding annotations. For the spatial cases, XLA's dumped programs show that the
partitioner inserted the halo exchanges (collective-permutes) that the traced graph lacks.
"""

from __future__ import annotations

import pytest
from conftest import run_scripts

NETWORKS = ("resnet18", "dcgan generator", "dcgan discriminator")
HYBRID = {"resnet18": "data=2,rows=2", "dcgan generator": "rows=2,channel=2",
          "dcgan discriminator": "data=2,cols=2"}  # fmt: skip
ONE_WAY = {"resnet18": ("rows=4", "cols=4"), "dcgan generator": ("rows=4",),
           "dcgan discriminator": ("cols=4",)}  # fmt: skip
SPATIAL = [f"{n}:{g}" for n in NETWORKS for g in (*ONE_WAY[n], HYBRID[n])]
SPATIAL += ["volume:depth=4", "volume:data=2,depth=2"]  # (N, C, D, H, W): depth splits D
OTHER = [f"{n}:{g}" for n in NETWORKS for g in ("data=4", "channel=4")]
# The cases alternate between the two processes (13 cases: 7 and 6, every network in both,
# where the spatial ones used to run 9 against 6); the first dumps its partitioned programs
# and holds spatial cases for the halo check below.
CASES = sorted(SPATIAL + OTHER)
FIRST, SECOND = CASES[0::2], CASES[1::2]
assert set(FIRST) & set(SPATIAL)
# float64 throughout. XLA's CPU kernels sum in another order than torch's, and three steps of
# BatchNorm over batches of 4 (1 x 1 images deep in ResNet) amplify that: 1e-7 seen at worst.
RTOL = 1e-6
# Partition specs torch_xla reports: tile counts per dimension (N, C, H, W) for each grid.
TILES = {"data=4": "[4,1,1,1]", "rows=4": "[1,1,4,1]", "cols=4": "[1,1,1,4]",
         "data=2,rows=2": "[2,1,2,1]", "data=2,cols=2": "[2,1,1,2]",
         "depth=4": "[1,1,4,1,1]", "data=2,depth=2": "[2,1,2,1,1]"}  # fmt: skip


@pytest.fixture(scope="module")
def spmd(tmp_path_factory) -> tuple[dict, list]:
    tmp = tmp_path_factory.mktemp("spmd")
    dump = tmp / "dump"
    flags = f"--xla_backend_optimization_level=0 --xla_dump_to={dump} --xla_dump_hlo_as_text"
    first, second = run_scripts(
        [("spmd_cases.py", tmp / "first.json", FIRST, {"XLA_FLAGS": flags}),
         ("spmd_cases.py", tmp / "second.json", SECOND, {})],
        timeout=420,
    )  # fmt: skip
    partitioned = [p.read_text() for p in dump.glob("*after_optimizations.txt")]
    return {**first, **second}, partitioned


@pytest.mark.parametrize("case", SPATIAL + OTHER)
def test_matches_dense(spmd, case):
    result = spmd[0][case]
    bad = {k: e for k, e in result["errors"].items() if not e <= RTOL}
    assert not bad, f"{case}: relative errors above {RTOL}: {bad}"


@pytest.mark.parametrize("case", SPATIAL + OTHER)
def test_compiles_once(spmd, case):
    """Step 1 may compile again (the optimizer's results become the inputs), then never."""
    compiles = spmd[0][case]["compiles"]
    assert compiles[-1] == compiles[-2], f"{case}: new compilation in the last step {compiles}"


@pytest.mark.parametrize("case", SPATIAL + OTHER)
def test_really_sharded(spmd, case):
    result = spmd[0][case]
    grid = case.split(":")[1]
    assert result["annotations"] > 0, f"{case}: no sharding annotation in the graph"
    if "channel" in grid:  # output channels of the weights (dim 0, or 1 when transposed)
        assert result["weight_sharding"].startswith("{devices=["), result
    else:  # activations split as asked (the generator's 1 x 1 input cannot be, by height)
        assert TILES[grid] in result["tiles"], f"{case}: annotations {result['tiles']}"
    if grid in ("data=4", "rows=4", "cols=4", "depth=4") and not case.startswith("dcgan generator"):
        assert result["input_sharding"].startswith("{devices=" + TILES[grid]), result


def test_negative_control(spmd):
    """An unannotated tensor reports no sharding (the checks above can fail), and the
    replicated weights of the non-channel cases are reported as such."""
    assert spmd[0]["unannotated"] == ""
    assert spmd[0]["resnet18:rows=4"]["weight_sharding"] == "{replicated}"


def test_partitioner_inserts_halo_exchange(spmd):
    results, partitioned = spmd
    assert all(results[c]["traced_permutes"] == 0 for c in SPATIAL)  # none written by us
    assert partitioned, "XLA wrote no partitioned program"
    assert any("collective-permute" in text for text in partitioned)
