"""The planner (parallelkit.plan), pure: no processes, no timing. Profiles come from FLOPs at
made-up rates and networks are given, so every number here is arithmetic.

- the halo bytes the cost model takes from the geometry, against a brute-force count;
- the ranking picks the obviously better grid in constructed cases;
- the plan survives a JSON round trip; the command line's mistakes exit 2.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
from torch import nn

from parallelkit import cli
from parallelkit.plan import Machine, Network, Option, Plan, build, from_flops, options, plan
from parallelkit.plan.cost import activation_bytes, halo_bytes
from parallelkit.plan.network import from_timings
from parallelkit.plan.walk import Layer, walk

CPU = Machine(cores=None, baseline_mib=100.0)
FAST = Network(1e-6, 100e9, "fast")


def conv_layer(c: int, h: int, w: int, k: int, s: int, p: int, kind: str = "conv") -> Layer:
    """A Layer record of a conv (or transposed conv) with square kernel k, stride s, pad p."""
    if kind == "conv":
        out = ((h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
    else:
        out = ((h - 1) * s - 2 * p + k, (w - 1) * s - 2 * p + k)
    window = ((k, s, p, p, 1), (k, s, p, p, 1))
    return Layer("x", kind, (c, h, w), (c, *out), 0.0, 0, 0, window)


def brute_rows(n: int, m: int, parts: int, reads) -> int:
    """Rows the busiest rank receives: input rows inside [0, n) its output rows read, held by
    another rank (blocks like torch.tensor_split)."""

    def block(total, r):
        base, extra = divmod(total, parts)
        start = r * base + min(r, extra)
        return start, start + base + (r < extra)

    most = 0
    for r in range(parts):
        o0, o1 = block(m, r)
        own = set(range(*block(n, r)))
        wanted = {i for o in range(o0, o1) for i in reads(o) if 0 <= i < n}
        most = max(most, len(wanted - own))
    return most


@pytest.mark.parametrize(
    "h,k,s,p,parts", [(7, 3, 1, 1, 3), (12, 4, 2, 1, 2), (9, 7, 2, 3, 4), (5, 3, 1, 1, 4)]
)
def test_conv_halo_bytes_match_brute_force(h, k, s, p, parts):
    layer = conv_layer(2, h, 6, k, s, p)
    m = layer.out_shape[1]
    rows = brute_rows(h, m, parts, lambda o: range(o * s - p, o * s - p + k))
    images = 3
    expected = images * 2 * 4 * rows * 6  # images x C x fp32 x rows x whole width
    assert halo_bytes(layer, Option(rows=parts), images) == expected


@pytest.mark.parametrize("h,k,s,p,parts", [(4, 4, 2, 1, 2), (1, 4, 1, 0, 2), (8, 3, 2, 1, 3)])
def test_transposed_halo_bytes_match_brute_force(h, k, s, p, parts):
    layer = conv_layer(2, h, 5, k, s, p, kind="convT")
    m = layer.out_shape[1]
    # output row o receives from input row i when o + p - t = i * s for a tap t
    rows = brute_rows(
        h, m, parts, lambda o: [(o + p - t) // s for t in range(k) if (o + p - t) % s == 0]
    )
    assert halo_bytes(layer, Option(rows=parts), 1) == 2 * 4 * rows * 5


def test_no_halo_without_a_spatial_split():
    layer = conv_layer(2, 8, 8, 3, 1, 1)
    assert halo_bytes(layer, Option(data=2), 4) == 0
    assert halo_bytes(layer, Option(channel=2), 4) == 0


def test_activations_split_over_spatial_ranks():
    layer = Layer("r", "act", (4, 8, 8), (4, 8, 8), 0.0, 0)
    net = walk_free([layer])
    whole = activation_bytes(net, Option(), 2)
    assert whole == 2 * 4 * 8 * 8 * 4
    assert activation_bytes(net, Option(rows=2), 2) == whole / 2
    assert activation_bytes(net, Option(data=2), 2) == whole / 2


def walk_free(layers):
    from parallelkit.plan.walk import Net

    return Net("n", tuple(layers), sum(x.params for x in layers))


def test_options_cover_every_grid_and_never_mix_spatial_and_channel():
    grids = options(4)
    assert all(g.ranks == 4 for g in grids)
    assert Option(data=2, rows=2) in grids and Option(channel=4) in grids
    assert not any(g.spatial > 1 and g.channel > 1 for g in grids)
    assert len(set(grids)) == len(grids) == 8


# ---------------------------------------------------------------------------- ranking
def plain_cnn(width: int = 16) -> nn.Module:
    """Convolutions and ReLUs only (no BatchNorm: data parallelism sends no statistics)."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def make_plan(image: int, batch: int, ranks: int, link: Network, **kw) -> Plan:
    net = walk(plain_cnn(), (3, image, image))
    return plan([net], [from_flops(net, 1e9)], batch, ranks, link, CPU, "cnn", image, **kw)


def test_huge_latency_favours_data_parallelism():
    slow = Network(1.0, 100e9, "slow")  # one second per message
    p = make_plan(32, 8, 2, slow)
    assert p.recommended.option == Option(data=2)


def test_one_huge_image_favours_spatial_parallelism():
    p = make_plan(512, 1, 2, FAST)
    best = p.recommended
    assert best.option.spatial == 2, [(e.option, e.step_s) for e in p.estimates]
    assert not p.estimates[-1].feasible  # data parallelism cannot split one image
    assert "does not split" in p.estimates[-1].problems[0]


def test_more_ranks_than_cores_slows_compute():
    net = walk(plain_cnn(), (3, 32, 32))
    prof = [from_flops(net, 1e9)]
    own = plan([net], prof, 8, 4, FAST, Machine(cores=None)).estimates
    shared = plan([net], prof, 8, 4, FAST, Machine(cores=2)).estimates
    by = lambda ests: {e.option: e.compute_s for e in ests}  # noqa: E731
    assert by(shared)[Option(data=4)] == pytest.approx(2 * by(own)[Option(data=4)])


def test_plan_json_round_trip():
    p = make_plan(64, 4, 4, FAST)
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again.to_dict() == p.to_dict()
    assert again.recommended.option == p.recommended.option


def test_network_from_timings_recovers_latency_and_bandwidth():
    lat, bw = 50e-6, 2e9
    t = lambda n: 2 * lat + n / bw  # noqa: E731  (2-rank ring all-reduce)
    net = from_timings(t(1024), t(16 << 20), 1024, 16 << 20)
    assert net.bandwidth_Bps == pytest.approx(bw, rel=1e-6)
    assert net.latency_s == pytest.approx(lat, rel=0.05)


def test_builtin_models_walk():
    (r18,) = build("resnet18", 32, stem="cifar")
    assert r18.params == 11_173_962 and r18.layers[0].kind == "conv"
    g, d = build("dcgan", 64)
    assert (g.passes, d.passes, d.grad_passes) == (1, 3, 2)
    assert not d.layers[-1].spatial  # the head runs on the whole image


# ---------------------------------------------------------------------------- command line
ARGS = [
    "--image-size",
    "32",
    "--batch",
    "4",
    "--ranks",
    "2",
    "--preset",
    "nvlink4",
    "--flop-rate",
    "100",
    "--baseline-mib",
    "200",
]


def test_cli_unknown_model_exits_2(capsys):
    assert cli.main(["plan", "--model", "nosuch", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "parallelkit plan: error: unknown model 'nosuch'" in err and "resnet18" in err


def test_cli_zoo_model_without_its_library_exits_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    assert cli.main(["plan", "--model", "timm:resnet18", *ARGS]) == 2
    assert "timm does not import here" in capsys.readouterr().err


def test_cli_zoo_model_plans_and_writes_json(capsys, monkeypatch, tmp_path):
    fake = types.ModuleType("timm")
    fake.create_model = lambda name, num_classes: plain_cnn()
    monkeypatch.setitem(sys.modules, "timm", fake)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "timm:tiny", *ARGS, "--json", str(out)]) == 0
    assert "recommended:" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["model"] == "timm:tiny" and len(saved["ranking"]) == 4  # data, rows, cols, channel
    assert saved["recommended"] == saved["ranking"][0]
