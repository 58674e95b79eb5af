"""The planner (parallelkit.plan), pure: no processes, no timing. Profiles come from FLOPs at
made-up rates and networks are given, so every number here is arithmetic.

- the halo bytes the cost model takes from the geometry, against a brute-force count;
- the ranking picks the obviously better grid in constructed cases;
- a profile taken at a reduced image size and scaled by the operation counts agrees with one
  taken at the real size (priced by a FLOP counter, not a clock);
- the device presets, and grids marked as not fitting a device's memory;
- the plan survives a JSON round trip; the command line's help, progress lines and mistakes;
- volumes: a 3-D network's records (C, D, H, W) with 3-D windows, grids with a depth
  dimension, halo bytes along every split dimension (against ``geometry.received_rows``);
- blocks in: the input and labels per rank fall by the sample's (P-1)/P share, and the command
  plans a small 3-D network end to end on a depth grid;
- token mixing: the walk records attention and contractions over tokens, and the bytes and
  message steps of the head all-to-all, the ring and the all-gather, counted by hand on 2 and
  4 spatial ranks; a network with the same convolutions and no attention costs none.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from parallelkit import cli
from parallelkit.geometry import Window, received_rows
from parallelkit.plan import (
    DEVICES,
    PRESETS,
    Machine,
    Network,
    Option,
    Plan,
    build,
    command,
    from_flops,
    measure,
    options,
    plan,
    table,
)
from parallelkit.plan.memory import MIXING, SAMPLES, activation_bytes, memory, sample_bytes
from parallelkit.plan.mixing_cost import Traffic, mixing_pattern, mixing_seconds, mixing_traffic
from parallelkit.plan.network import from_timings
from parallelkit.plan.shares import MIB, halo_bytes
from parallelkit.plan.step_time import exchange_seconds
from parallelkit.plan.walk import Layer, Mixing, Net, walk

from network_cases import ForwardCodeNet

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
    assert (g.input_grad, d.input_grad) == (False, True)  # fakes carry the generator's gradient


def test_the_gan_counts_follow_the_task_s_step(monkeypatch):
    """The passes are counted by running parallelkit.train.tasks.Gan.step, so another step
    (here the discriminator on real images alone) plans otherwise."""
    from parallelkit.train.tasks import Gan

    def step(self, x, y, step):
        self.discriminator(x).sum().backward()

    monkeypatch.setattr(Gan, "step", step)
    g, d = build("dcgan", 16)
    assert (g.passes, d.passes, d.grad_passes, d.input_grad) == (0, 1, 1, False)


def test_the_built_in_unet_plans_signals_and_volumes_by_its_spatial_dims():
    for dims, side in ((1, 32), (3, 16)):
        kwargs = {"spatial_dims": dims, "widths": [4, 8]}
        (net,) = build("unet", side, 3, channels=1, kwargs=kwargs)
        assert net.input_shape == (1, *(side,) * dims) and net.per_pixel
        assert net.layers[0].window == ((3, 1, 1, 1, 1),) * dims


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


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["--model-kwargs", "{widths: ["], "is not YAML at column"),
        (["--model-kwargs", "{bogus: 1}"], "unexpected keyword arguments ['bogus']"),
        (["--bandwidth", "-1", "--latency", "5"], "--bandwidth must be positive, got -1"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line_before_profiling(capsys, monkeypatch, more,
                                                                message):  # fmt: skip
    monkeypatch.setattr(command, "make_plan", lambda *a: pytest.fail("profiled first"))
    argv = ["plan", "--model", "resnet18", "--image-size", "64", "--batch", "4", "--ranks", "2"]
    try:
        status = cli.main([*argv, *more])
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err, err


def test_cli_zoo_model_without_its_library_exits_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    assert cli.main(["plan", "--model", "timm:resnet18", *ARGS]) == 2
    # the message of parallelkit train's model.name: both build it with models.create
    assert "needs timm, which is not installed here" in capsys.readouterr().err


def fake_timm(monkeypatch, build) -> None:
    """A stand-in for timm: every name is a model, and ``build(num_classes)`` makes it (with
    the arguments parallelkit.models.zoo passes: no pretrained weights, the input channels)."""
    fake = types.ModuleType("timm")
    fake.is_model = lambda name: True

    def create_model(name, *, pretrained, num_classes, in_chans):
        assert pretrained is False
        return build(num_classes)

    fake.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", fake)


def test_cli_zoo_model_plans_and_writes_json(capsys, monkeypatch, tmp_path):
    fake_timm(monkeypatch, lambda num_classes: plain_cnn())
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "timm:tiny", *ARGS, "--json", str(out)]) == 0
    assert "recommended:" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["model"] == "timm:tiny" and len(saved["ranking"]) == 4  # data, rows, cols, channel
    assert saved["recommended"] == saved["ranking"][0]


def test_cli_help_names_the_units_and_the_devices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--flop-rate FLOP_RATE GFLOP/s (1e9 FLOP/s) of one rank's device" in text
    assert "--byte-rate BYTE_RATE GB/s of its memory" in text
    assert "--memory-gib MEMORY_GIB GiB of one rank's device" in text
    for name in DEVICES:
        assert name in text
    assert "bf16 FLOP/s, memory GB/s and size" in text


def test_cli_prints_a_progress_line_per_stage_on_stderr(capsys):
    assert cli.main(["plan", "--model", "resnet18", "--stem", "cifar", *ARGS]) == 0
    out, err = capsys.readouterr()
    assert "parallelkit plan: [" in err and "walking resnet18 at 32x32" in err
    assert "walking" not in out and "recommended:" in out


# ---------------------------------------------------------------------------- reduced size
def flop_clock(fn) -> float:
    """The FLOPs one call of ``fn`` executes (forward and backward), counted by torch: a
    deterministic price in place of seconds."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


# The FLOPs a convolution or linear layer executes grow exactly as the walk's counts, so
# priced by a FLOP counter the scaled profile must equal the full-size one up to rounding.
# (Timed, a profile scaled from a smaller image over-estimates: docs/parallelism.md.)
SCALING_TOLERANCE = 1e-6


def test_profile_scaled_from_a_reduced_size_agrees_with_the_full_size_profile():
    (full,) = build("resnet18", 64, stem="cifar")
    (small,) = build("resnet18", 16, stem="cifar")
    prof_full = measure.measure(full, 2, clock=flop_clock)
    prof_small = measure.measure(small, 2, clock=flop_clock)
    scaled = measure.scaled(prof_small, small, full)
    assert sum(prof_small.layer_s) * 10 < sum(prof_full.layer_s)  # the sizes differ
    assert scaled.layer_s == pytest.approx(prof_full.layer_s, rel=SCALING_TOLERANCE)
    assert "at 16x16, scaled by operation counts" in scaled.source
    # and so do the plans built on them, grid by grid
    by = lambda prof: {  # noqa: E731
        e.option: e.step_s for e in plan([full], [prof], 8, 4, FAST, CPU).estimates
    }
    assert by(scaled) == pytest.approx(by(prof_full), rel=SCALING_TOLERANCE)


def test_scaled_profile_scales_each_layer_by_its_operation_count():
    full = walk(plain_cnn(), (3, 32, 32))
    small = walk(plain_cnn(), (3, 8, 8))
    prof = measure.Profile(tuple(1.0 for _ in small.layers), 2.0, 3e-9, "made up")
    scaled = measure.scaled(prof, small, full)
    conv, relu, linear = (full.layers[i].kind for i in (0, 1, -1))
    assert (conv, relu, linear) == ("conv", "act", "linear")
    assert scaled.layer_s[0] == pytest.approx(16)  # 16x the output pixels
    assert scaled.layer_s[1] == pytest.approx(16)  # 16x the elements read and written
    assert scaled.layer_s[-1] == pytest.approx(1)  # after global pooling: the same
    assert scaled.optimizer_s_per_param == 3e-9


def test_reduced_size_halves_the_image_until_the_profile_is_cheap():
    (r50,) = build("resnet50", 1024)
    flops = sum(layer.flops for layer in r50.layers)
    assert measure.reduced_size(r50, 1024, 1, budget=flops) == 1024
    assert measure.reduced_size(r50, 1024, 1, budget=flops / 4) == 512
    assert measure.reduced_size(r50, 1024, 1, budget=flops / 16) == 256
    assert measure.reduced_size(r50, 1024, 4, budget=flops / 16) == 128  # 4 images
    assert measure.reduced_size(r50, 1024, 1, budget=1.0) == measure.MIN_SIZE
    assert measure.reduced_size(r50, 1024, 1) == 256  # the default budget, the case


def test_a_network_whose_layers_change_with_the_size_is_not_scaled():
    (_, d64), (_, d32) = build("dcgan", 64), build("dcgan", 32)
    assert not measure.same_layers(d64, d32)
    prof = from_flops(d32, 1e9)
    with pytest.raises(ValueError, match="different layers"):
        measure.scaled(prof, d32, d64)


def test_command_profiles_at_a_reduced_size_and_calibrates_memory_there(monkeypatch):
    """The command's path on this machine, with the timing and the subprocesses replaced."""
    seen = {}

    def fake_measure(net, batch):
        seen["measured"] = (net.input_shape, batch)
        return from_flops(net, 1e9)

    def fake_peak(name, size, classes, stem, batch, **kw):
        seen["peak"] = (name, size, batch)
        return 1000.0

    monkeypatch.setattr(measure, "measure", fake_measure)
    monkeypatch.setattr(measure, "peak_mib", fake_peak)
    monkeypatch.setattr(command, "baseline_mib", lambda: 200.0)
    args = command.parse(["--model", "resnet18", "--image-size", "512", "--batch", "4",
                          "--ranks", "4", "--preset", "ib-hdr"])  # fmt: skip
    lines: list[str] = []
    p = command.make_plan(args, lines.append)
    assert seen == {"measured": ((3, 256, 256), 1), "peak": ("resnet18", (256, 256), 1)}
    assert p.compute.endswith("at 256x256, scaled by operation counts")
    assert any("profiling 1 sample(s) at 256x256" in x and "scaled to 512x512" in x for x in lines)
    assert p.machine.baseline_mib == 200.0 and p.machine.overhead_mib > 0
    assert p.machine.device_mib is None  # this machine: no device limit


# ---------------------------------------------------------------------------- devices
def test_device_presets_carry_their_datasheet_figures():
    a100, h100 = DEVICES["a100-80gb"], DEVICES["h100-sxm"]
    v4, v5e = DEVICES["tpu-v4"], DEVICES["tpu-v5e"]
    assert (a100.flop_rate, a100.byte_rate, a100.memory_bytes) == (312e12, 2.039e12, 80e9)
    assert (h100.flop_rate, h100.byte_rate, h100.memory_bytes) == (989e12, 3.35e12, 80e9)
    assert (v4.flop_rate, v4.byte_rate, v4.memory_bytes) == (275e12, 1.2e12, 32 << 30)
    assert (v5e.flop_rate, v5e.byte_rate, v5e.memory_bytes) == (197e12, 819e9, 16 << 30)
    assert v5e.memory_mib == 16384
    for device in DEVICES.values():
        assert device.link in PRESETS


def test_cli_device_counts_compute_at_its_rates_and_takes_its_interconnect():
    args = command.parse(["--model", "resnet18", "--image-size", "64", "--batch", "8",
                          "--ranks", "4", "--device", "tpu-v4"])  # fmt: skip
    p = command.make_plan(args)  # nothing measured or probed here
    assert p.link == PRESETS["tpu-v4-ici"]
    assert p.machine == Machine(cores=None, baseline_mib=0.0, device_mib=32 * 1024)
    assert p.compute == "tpu-v4 datasheet, 275 TFLOP/s bf16 peak"
    (net,) = build("resnet18", 64)
    expected = plan([net], [from_flops(net, 275e12, 1.2e12)], 8, 4, p.link, p.machine)
    assert [e.step_s for e in p.estimates] == [e.step_s for e in expected.estimates]
    # --flop-rate (GFLOP/s) overrides the device's rate; --preset its interconnect
    args = command.parse(["--model", "resnet18", "--image-size", "64", "--batch", "8",
                          "--ranks", "4", "--device", "tpu-v4", "--flop-rate", "1000",
                          "--preset", "ib-hdr"])  # fmt: skip
    slow = command.make_plan(args)
    assert slow.link.name == "ib-hdr" and "FLOPs at 1e+12/s" in slow.compute
    (prof,) = command.counted_profiles(args, [net])
    assert prof.layer_s[0] == pytest.approx(3 * net.layers[0].flops / 1e12)  # forward x 3


# ---------------------------------------------------------------------------- fitting
def test_grids_needing_more_than_the_device_memory_are_marked_as_not_fitting():
    net = walk(plain_cnn(), (3, 64, 64))
    prof = [from_flops(net, 1e9)]
    roomy = plan([net], prof, 8, 4, FAST, Machine(baseline_mib=10.0)).estimates
    peaks = sorted(e.peak_mib for e in roomy)
    assert peaks[0] < peaks[-1] and all(e.feasible for e in roomy)
    limit = (peaks[0] + peaks[-1]) / 2
    p = plan([net], prof, 8, 4, FAST, Machine(baseline_mib=10.0, device_mib=limit))
    for e in p.estimates:
        fits = e.peak_mib <= limit
        assert e.feasible == fits, (e.option, e.peak_mib, limit)
        if not fits:
            assert e.problems == [
                f"does not fit: {e.peak_mib:.0f} MiB per rank, the device holds {limit:.0f} MiB"
            ]
    assert p.recommended.feasible  # the fitting grids rank first
    assert "does not fit" in table(p)
    none = plan([net], prof, 8, 4, FAST, Machine(baseline_mib=10.0, device_mib=1.0))
    assert not any(e.feasible for e in none.estimates)
    assert "recommended: none (no grid fits; see the notes)" in table(none)
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).to_dict() == p.to_dict()


def test_cli_memory_gib_marks_a_big_image_as_not_fitting(capsys):
    args = ["--image-size", "1024", "--batch", "8", "--ranks", "8", "--device", "tpu-v5e"]
    assert cli.main(["plan", "--model", "resnet50", *args]) == 0
    out = capsys.readouterr().out
    assert "does not fit: " in out and "the device holds 16384 MiB" in out  # 8 channel ranks
    assert "each rank on its own device of 16384 MiB" in out
    assert "recommended: data (8 data)" in out
    assert cli.main(["plan", "--model", "resnet50", *args, "--memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: none" in out and "the device holds 1024 MiB" in out
    assert cli.main(["plan", "--model", "resnet50", *args, "--memory-gib", "-1"]) == 2
    assert "--memory-gib must be positive" in capsys.readouterr().err


# ---------------------------------------------------------------------------- volumes
def small_unet3d(classes: int = 3) -> nn.Module:
    """A two-level 3-D encoder-decoder with per-voxel logits: the layer types of a 3-D U-Net."""
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1),
        nn.BatchNorm3d(4),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(4, 8, (3, 3, 1), padding=(1, 1, 0)),
        nn.InstanceNorm3d(8),
        nn.ConvTranspose3d(8, 4, 2, stride=2),
        nn.Conv3d(4, classes, 1),
    )


def test_a_3d_network_records_volumes_and_3d_windows():
    net = walk(small_unet3d(), (1, 8, 12, 16))
    kinds = [x.kind for x in net.layers]
    assert kinds == ["conv", "norm", "act", "pool", "conv", "sample_norm", "convT", "conv"]
    conv, pool, thin, up = (net.layers[i] for i in (0, 3, 4, 6))
    assert conv.in_shape == (1, 8, 12, 16) and conv.out_shape == (4, 8, 12, 16)
    assert conv.window == ((3, 1, 1, 1, 1),) * 3 and conv.dims == 3
    assert pool.out_shape == (4, 4, 6, 8) and pool.window == ((2, 2, 0, 0, 1),) * 3
    assert thin.window == ((3, 1, 1, 1, 1), (3, 1, 1, 1, 1), (1, 1, 0, 0, 1))
    assert up.out_shape == (4, 8, 12, 16) and up.window == ((2, 2, 0, 0, 1),) * 3
    assert conv.flops == 2 * 4 * 8 * 12 * 16 * 1 * 27
    assert all(x.spatial for x in net.layers)
    assert net.output_shape == (3, 8, 12, 16) and net.per_pixel


def test_signals_and_adaptive_pools_of_any_dims_are_recorded():
    net = walk(
        nn.Sequential(
            nn.Conv1d(2, 4, 5, stride=2, padding=2),
            nn.BatchNorm1d(4),
            nn.AvgPool1d(3, stride=1, padding=1),
            nn.AdaptiveMaxPool1d(1),
            nn.Flatten(),
            nn.Linear(4, 2),
        ),
        (2, 20),
    )
    conv, norm, pool, glob, _, linear = net.layers
    assert conv.out_shape == (4, 10) and conv.window == ((5, 2, 2, 2, 1),) and conv.dims == 1
    assert (norm.kind, pool.kind, glob.kind) == ("norm", "pool", "global_pool")
    assert pool.window == ((3, 1, 1, 1, 1),)
    assert conv.spatial and not glob.spatial and not linear.spatial  # the region ends
    assert not net.per_pixel


def conv3d(c: int, d: int, h: int, w: int, k: int, s: int, p: int) -> Layer:
    """The record of a real ``nn.Conv3d`` walked at (c, d, h, w)."""
    (layer,) = walk(nn.Sequential(nn.Conv3d(c, c, k, stride=s, padding=p)), (c, d, h, w)).layers
    return layer


@pytest.mark.parametrize("d,k,s,p,parts", [(9, 3, 2, 1, 2), (8, 3, 1, 1, 4), (10, 5, 1, 2, 3)])
def test_depth_halo_bytes_are_geometry_received_rows(d, k, s, p, parts):
    layer = conv3d(2, d, 6, 5, k, s, p)
    sizes, _, want = Window(k, s, p, p).plan(d, parts)
    planes = max(received_rows(sizes, want))
    assert planes > 0
    images = 3
    expected = images * 2 * 4 * planes * 6 * 5  # images x C x fp32 x planes x whole H x W
    assert halo_bytes(layer, Option(depth=parts), images) == expected


def test_halo_bytes_go_over_every_split_dimension():
    """W first (the bare block's rows), then D (the block extended by W's halo): edges ride
    along, as parallelkit.spatial.edges exchanges them."""
    layer = conv3d(2, 8, 6, 10, 3, 1, 1)
    # depth 2 x cols 2: blocks (4, 6, 5); 1 halo plane along D, 1 column along W
    per_channel = 1 * 4 * 6 + 1 * 6 * (5 + 1)  # W's column of the block, D's plane extended
    assert halo_bytes(layer, Option(depth=2, cols=2), 1) == 2 * 4 * per_channel
    along_w = halo_bytes(layer, Option(cols=2), 1)
    assert along_w == 2 * 4 * 1 * 8 * 6  # one column of the whole D x H
    # the edge path saves no fetched block; a strided convolution saves it, in 3-D too
    net = walk_free([layer])
    bare = layer.out_numel * 4 / 4  # the output block of a 2 x 2 grid
    assert activation_bytes(net, Option(depth=2, cols=2), 1) == bare
    strided = conv3d(2, 8, 6, 10, 3, 2, 1)  # output (2, 4, 3, 5): blocks of 2 x 3 x 3
    held = (2 * 2 + 1) * 6 * (3 * 2 + 1)  # the input its output block reads (past the padding)
    assert activation_bytes(walk_free([strided]), Option(depth=2, cols=2), 1) == (
        strided.out_numel * 4 * (2 / 4) * (3 / 5) + 2 * held * 4
    )


def test_volume_options_add_depth_and_images_never_get_it():
    vol, img, sig = options(8, dims=3), options(8), options(8, dims=1)
    assert Option(depth=8) in vol and Option(data=2, depth=2, rows=2) in vol
    assert Option(depth=2, rows=2, cols=2) in vol and Option(channel=8) in vol
    assert len(set(vol)) == len(vol) and all(g.ranks == 8 for g in vol)
    assert not any(g.spatial > 1 and g.channel > 1 for g in vol)
    assert not any(g.depth > 1 for g in img) and set(img) < set(vol)
    assert not any(g.depth > 1 or g.cols > 1 for g in sig) and Option(rows=8) in sig
    assert Option(depth=2, rows=2, cols=2).spatial == 8


def test_a_volume_plan_offers_depth_grids_and_splits_the_work():
    net = walk(small_unet3d(), (1, 16, 16, 16))
    p = plan([net], [from_flops(net, 1e9)], 1, 8, FAST, CPU, "unet3d", (16, 16, 16))
    by = {e.option: e for e in p.estimates}
    assert Option(depth=8) in by and Option(depth=2, rows=2, cols=2) in by
    whole = by[Option(channel=8)].memory_mib["activations"]
    assert by[Option(depth=8)].memory_mib["activations"] < whole / 4
    assert by[Option(depth=8)].exchange_s > 0 and by[Option(data=8)].exchange_s == 0
    assert "unet3d 16x16x16" in table(p)


# ---------------------------------------------------------------------------- blocks in
def test_blocks_in_holds_only_the_rank_s_share_of_input_and_labels():
    net = walk(small_unet3d(), (1, 8, 8, 8))
    voxels = 8 * 8 * 8
    whole = 2 * (voxels * 4 + voxels * 8)  # 2 samples: fp32 input, int64 per-voxel labels
    assert sample_bytes(net, Option(), 2) == whole
    for opt, parts in ((Option(depth=8), 8), (Option(depth=2, rows=2, cols=2), 8),
                       (Option(rows=2), 2)):  # fmt: skip
        assert sample_bytes(net, opt, 2) == whole  # every rank of the group: whole samples
        assert sample_bytes(net, opt, 2, blocks_in=True) == whole / parts
        a = memory([net], opt, 2, CPU)
        b = memory([net], opt, 2, CPU, blocks_in=True)
        assert sum(a.values()) - sum(b.values()) == pytest.approx(
            whole * (parts - 1) / parts / MIB, rel=1e-12
        )
        assert {k: v for k, v in a.items() if k != SAMPLES} == {
            k: v for k, v in b.items() if k != SAMPLES
        }
    # data parallelism splits no sample: blocks in change nothing
    assert memory([net], Option(data=2), 2, CPU) == memory([net], Option(data=2), 2, CPU, True)


def test_blocks_in_of_a_classifier_splits_the_input_not_its_labels():
    net = walk(plain_cnn(), (3, 32, 32))
    assert not net.per_pixel
    whole_input, labels = 3 * 32 * 32 * 4, 8
    assert sample_bytes(net, Option(rows=4), 1) == whole_input + labels
    assert sample_bytes(net, Option(rows=4), 1, blocks_in=True) == (whole_input + labels) / 4


def test_a_per_pixel_output_stays_split_with_blocks_in():
    net = walk(small_unet3d(), (1, 8, 8, 8))
    opt = Option(depth=4)
    gathered = exchange_seconds(net, opt, 1, FAST)
    kept = exchange_seconds(net, opt, 1, FAST, blocks_in=True)
    # the per-voxel logits (3 x 8^3, fp32) are not gathered: one all-gather of them less
    assert gathered - kept == pytest.approx(FAST.all_gather(3 * 8**3 * 4, 4))


def test_cli_plans_a_3d_network_on_depth_grids_with_blocks_in(capsys, monkeypatch, tmp_path):
    fake_timm(monkeypatch, small_unet3d)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "timm:unet3d", "--image-size", "32", "--dims", "3",
            "--channels", "1", "--classes", "3", "--batch", "2", "--ranks", "8",
            "--device", "h100-sxm", "--blocks-in", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "timm:unet3d 32x32x32, global batch 2, 8 ranks" in text
    assert "samples in: blocks" in text and "whole in" in text and "input MiB" in text
    assert "8 depth" in text and "2 depth x 2 rows x 2 cols" in text
    (best,) = [x for x in text.splitlines() if x.startswith("recommended:")]
    assert best.endswith("with whole samples in)")
    saved = json.loads(out.read_text())
    assert saved["image_size"] == [32, 32, 32] and saved["blocks_in"] is True
    depth = next(e for e in saved["ranking"] if e["grid"]["depth"] == 8)
    assert depth["whole_in_mib"] > depth["peak_mib"]
    assert Plan.from_dict(saved).to_dict() == saved


def test_cli_takes_every_side_and_the_model_s_dims():
    def size(*argv):
        return command.sample_size(command.parse([*argv, "--batch", "1", "--ranks", "2"]))

    assert size("--model", "resnet18", "--image-size", "32") == (32, 32)
    assert size("--model", "resnet18", "--image-size", "32", "--dims", "3") == (32, 32, 32)
    assert size("--model", "monai:UNet", "--image-size", "32") == (32, 32, 32)
    assert size("--model", "monai:UNet", "--image-size", "16", "32", "48") == (16, 32, 48)
    assert size("--model", "monai:UNet", "--image-size", "32",
                "--model-kwargs", "{spatial_dims: 2}") == (32, 32)  # fmt: skip
    assert size("--model", "unet", "--image-size", "32",
                "--model-kwargs", "{spatial_dims: 3}") == (32, 32, 32)  # fmt: skip
    with pytest.raises(SystemExit):
        size("--model", "unet", "--image-size", "16", "32", "--dims", "3")


def test_cli_plans_monai_unet_volumes():
    pytest.importorskip("monai")
    args = command.parse(["--model", "monai:UNet", "--image-size", "32", "--channels", "1",
                          "--classes", "3", "--batch", "2", "--ranks", "4",
                          "--model-kwargs", "{channels: [8, 16, 32], strides: [2, 2]}",
                          "--flop-rate", "1000", "--bandwidth", "10", "--latency", "5",
                          "--baseline-mib", "100", "--blocks-in"])  # fmt: skip
    p = command.make_plan(args)
    assert p.image_size == (32, 32, 32) and p.blocks_in
    assert any(e.option.depth == 4 for e in p.estimates)
    (net,) = build("monai:UNet", 32, 3, channels=1,
                   kwargs={"channels": [8, 16, 32], "strides": [2, 2]})  # fmt: skip
    assert net.per_pixel and net.layers[0].window == ((3, 2, 1, 1, 1),) * 3


def test_cli_names_a_missing_model_argument(capsys):
    pytest.importorskip("monai")
    argv = ["plan", "--model", "monai:UNet", "--image-size", "16", "--batch", "1", "--ranks",
            "2", "--device", "h100-sxm"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "parallelkit plan: error: model.name='monai:UNet' needs model.kwargs" in err


def test_reduced_shape_halves_every_side_of_a_volume():
    net = walk(small_unet3d(), (1, 256, 256, 256))
    flops = sum(layer.flops for layer in net.layers)
    assert measure.reduced_shape(net, (256, 256, 256), 1, budget=flops) == (256, 256, 256)
    assert measure.reduced_shape(net, (256, 256, 256), 1, budget=flops / 8) == (128, 128, 128)
    assert measure.reduced_shape(net, (256, 128, 256), 1, budget=1.0) == (128, 64, 128)


def test_a_grid_that_cannot_split_the_samples_is_marked():
    net = walk(plain_cnn(), (3, 16, 16))
    p = plan([net], [from_flops(net, 1e9)], 2, 2, FAST, CPU, grids=[Option(depth=2)])
    assert p.estimates[0].problems == ["2 depth cannot split samples with 2 spatial dimension(s)"]


def test_cli_a_2d_model_on_volumes_exits_2(capsys):
    argv = ["plan", "--model", "resnet18", "--image-size", "32", "--dims", "3", "--batch", "2",
            "--ranks", "2", "--device", "h100-sxm"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "resnet18 does not run on samples of shape (3, 32, 32, 32)" in capsys.readouterr().err


def test_the_edge_path_needs_stride_1_everywhere_and_blocks_of_p_rows():
    """As parallelkit.spatial.edges.plan: a stride along a dimension that is not split (a
    video stem's (1, 2, 2) split over depth) takes the halo fetch, whose block is saved."""
    opt = Option(depth=2)
    same = conv3d(2, 8, 6, 6, 3, 1, 1)
    assert activation_bytes(walk_free([same]), opt, 1) == same.out_numel * 4 / 2
    (stem,) = walk(nn.Sequential(nn.Conv3d(2, 2, 3, stride=(1, 2, 2), padding=1)),
                   (2, 8, 6, 6)).layers  # fmt: skip
    saved = 2 * (1 + 4 + 1) * 6 * 6 * 4  # C x (padding, its 4 planes, halo) x whole H x W
    assert activation_bytes(walk_free([stem]), opt, 1) == stem.out_numel * 4 / 2 + saved
    wide = conv3d(2, 8, 6, 6, 7, 1, 3)  # blocks of 2 planes, halo 3
    assert activation_bytes(walk_free([wide]), Option(depth=4), 1) > wide.out_numel * 4 / 4


def test_plan_reads_a_training_config(tmp_path, capsys):
    """``plan --config run.yaml key=value``: the config's model, crop, batch and ranks are
    planned, and the overrides printed train on the recommended grid (``train --check``)."""
    run = tmp_path / "run.yaml"
    run.write_text("train: {task: segment, batch_size: 4}\nparallel: {ranks: 2}\n")
    argv = ["plan", "--config", str(run), "parallel.ranks=4", "--device", "h100-sxm"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = out.strip().splitlines()[-1]
    assert line.startswith("train on it with: parallel.ranks=4 parallel.strategy="), out
    check = ["train", "--check", "--config", str(run), f"train.run_dir={tmp_path / 'r'}"]
    assert cli.main([*check, *line.split(": ", 1)[1].split()]) == 0
    assert "check passed for 4 ranks" in capsys.readouterr().out
    bad = ["plan", "--config", str(run), "train.batch_sise=4", "--device", "h100-sxm"]
    assert cli.main(bad) == 2 and "batch_sise" in capsys.readouterr().err


# ---------------------------------------------------------------------------- token mixing
# A 4 x 4 map is 16 tokens; heads of width 2. Counted for 2 images on one data rank, fp32.
IMAGES = 2


def attention_record(heads: int, masked: bool = False) -> Mixing:
    n = heads * 16 * 2  # (h, L, d) of one sample: q, k, v and the output alike
    return Mixing("attn", "attention", (4, 4), (n, n, n, n), heads, masked)


@pytest.mark.parametrize(
    ("grid", "nbytes", "messages", "held"),
    [
        # q, k, v, out: 128 elements each, a rank's block 1/2 of them: 2 images x 64 x 4 B =
        # 512 B, of which 1/2 goes to the other rank; each crosses forward and backward
        (Option(rows=2), 2 * 4 * 512 / 2, 8, 4 * 2 * 128 * 4 / 2),
        # blocks of 1/4 (256 B), 3/4 of each sent, 3 message steps per all-to-all, 8 of them
        (Option(rows=2, cols=2), 2 * 4 * 256 * 3 / 4, 24, 4 * 2 * 128 * 4 / 4),
    ],
)
def test_head_all_to_all_moves_each_block_s_share_four_times_a_pass(grid, nbytes, messages,
                                                                    held):  # fmt: skip
    rec = attention_record(heads=4)
    assert mixing_pattern(rec, grid.spatial) == "heads"
    t = mixing_traffic(rec, grid, IMAGES)
    assert (t.nbytes, t.messages, t.held, t.saved) == (nbytes, messages, held, True)


@pytest.mark.parametrize(
    ("grid", "nbytes", "messages", "held"),
    [
        # k + v block: 2 images x (96 + 96) / 2 x 4 B = 768 B; forward 1 shift of it, backward
        # 1 shift of it with its gradients (2 x 768) and 1 of the gradients home (768)
        (Option(rows=2), 768 + 2 * 768 + 768, 1 + 2, 2 * 768),
        # 384 B blocks: forward 3 shifts, backward 3 x 2 blocks and 1
        (Option(rows=4), 3 * 384 + 3 * 2 * 384 + 384, 3 + 4, 2 * 384),
    ],
)
def test_ring_where_the_heads_do_not_divide(grid, nbytes, messages, held):
    rec = attention_record(heads=3)
    assert mixing_pattern(rec, grid.spatial) == "ring"
    t = mixing_traffic(rec, grid, IMAGES)
    assert (t.nbytes, t.messages, t.held, t.saved) == (nbytes, messages, held, False)


def test_a_mask_or_too_few_heads_take_the_ring():
    assert mixing_pattern(attention_record(4, masked=True), 2) == "ring"
    assert mixing_pattern(attention_record(2), 4) == "ring"  # fewer heads than ranks
    assert mixing_pattern(attention_record(4), 4) == "heads"


@pytest.mark.parametrize(
    ("grid", "nbytes", "messages"),
    [
        # keys and values of a pooled 2 x 2 map, 8 channels: 2 images x 32 x 4 B = 256 B each
        # whole; all-gather forward and reduce-scatter backward, (s-1)/s of the whole each
        (Option(rows=2), 2 * 512 / 2, 2 * 2 * 1),
        (Option(rows=2, cols=2), 2 * 512 * 3 / 4, 2 * 2 * 3),
    ],
)
def test_keys_of_another_map_are_gathered_whole(grid, nbytes, messages):
    rec = Mixing("attn", "gather", (2, 2), (32, 32))
    t = mixing_traffic(rec, grid, IMAGES)
    assert (t.nbytes, t.messages, t.held, t.saved) == (nbytes, messages, 512, True)


def test_token_collectives_cost_latency_per_step_and_bytes_over_bandwidth():
    act = Layer("r", "act", (8, 4, 4), (8, 4, 4), 0.0, 0)
    net = Net("n", (act,), 0, mixing=(attention_record(4), Mixing("s", "reduce", (4, 4), (64,))))
    link = Network(1e-6, 1e9)
    # heads on 2 ranks: 8 steps, 2048 B; the all-reduce of 64 elements x 2 images: 2 steps, 512 B
    expected = 10 * 1e-6 + (2048 + 512) / 1e9
    assert mixing_seconds(net, Option(rows=2), IMAGES, link) == pytest.approx(expected)
    assert mixing_seconds(net, Option(data=2), IMAGES, link) == 0.0
    mem = memory([net], Option(rows=2), IMAGES, CPU)[MIXING]
    assert mem == pytest.approx((2048 + 512) / MIB)  # the heads' tensors and the whole result


class ConvAttention(nn.Module):
    """A CNN's self-attention block: 1x1 convolutions project, the map's pixels attend."""

    def __init__(self, c: int, heads: int, mask: bool = False, explicit: bool = False,
                 pooled: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.qkv, self.out = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
        self.heads, self.mask, self.explicit = heads, mask, explicit
        self.kv = nn.Conv2d(c, 2 * c, 2, stride=2) if pooled else None  # Segformer's keys

    def forward(self, x):
        n, c, h, w = x.shape
        q, k, v = self.qkv(x).flatten(2).transpose(1, 2).chunk(3, -1)  # (N, L, C) each
        if self.kv is not None:
            k, v = self.kv(x).flatten(2).transpose(1, 2).chunk(2, -1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        if self.explicit:
            y = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        else:
            m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, m if self.mask else None)
        return x + self.out(y.transpose(1, 2).reshape(n, h * w, c).transpose(1, 2).view(x.shape))


def hybrid(attention: bool = True, **kw) -> nn.Module:
    c = 16
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1),
        nn.ReLU(),
        *([ConvAttention(c, 4, **kw)] if attention else []),
        nn.Conv2d(c, c, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, 10),
    )


def test_the_walk_records_attention_by_its_pattern():
    (rec,) = walk(hybrid(), (3, 8, 8)).mixing
    assert rec == Mixing("2", "attention", (8, 8), (1024,) * 4, heads=4, masked=False)
    (rec,) = walk(hybrid(mask=True), (3, 8, 8)).mixing
    assert rec.masked and mixing_pattern(rec, 2) == "ring"
    scores, values = walk(hybrid(explicit=True), (3, 8, 8)).mixing  # q @ k^T, then @ v
    assert (scores.kind, scores.numel, values.kind, values.numel) == ("gather", (1024,)) * 2
    (rec,) = walk(hybrid(pooled=True), (3, 8, 8)).mixing  # keys of the 4 x 4 pooled map
    assert rec == Mixing("2", "gather", (4, 4), (256, 256))


def test_the_walk_records_multihead_attention_linear_attention_and_token_mixing():
    class Tokens(nn.Module):
        def __init__(self, need_weights: bool) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.mix = nn.Linear(64, 64)  # MLP-Mixer's token mixing, over the 8 x 8 tokens
            self.mlp = nn.Linear(8, 8)  # per token: the block stays split
            self.head = nn.Linear(8, 10)
            self.need_weights = need_weights

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)  # (N, 64, 8)
            t = t + self.mha(t, t, t, need_weights=self.need_weights)[0]
            kv = t.transpose(-2, -1) @ t  # linear attention's k^T v: (N, 8, 8), summed
            t = self.mlp(self.mix(t.transpose(1, 2)).transpose(1, 2) @ kv)
            return self.head(t.mean(1))

    net = walk(Tokens(need_weights=False), (3, 8, 8))
    mha, kv, mix = net.mixing
    assert (mha.name, mha.kind, mha.heads, mha.numel) == ("mha", "attention", 2, (512,) * 4)
    assert (kv.kind, kv.numel, mix.name, mix.kind, mix.numel) == ("reduce", (64,), "mix",
                                                                 "reduce", (512,))  # fmt: skip
    assert walk(Tokens(need_weights=True), (3, 8, 8)).mixing[0].kind == "gather"
    mlp = next(layer for layer in net.layers if layer.name == "mlp")
    assert mlp.spatial and mlp.tokens == (8, 8) and mlp.flops == 2 * 8 * 8 * 64  # every token
    assert not net.layers[-1].spatial  # the head on (N, F) ends the region


def test_the_walk_reads_tokens_after_class_tokens_as_the_maps():
    class ClassToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 2, stride=2)
            self.cls = nn.Parameter(torch.zeros(1, 2, 8))  # a class and a distillation token
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)  # (N, 16, 8)
            t = torch.cat((self.cls.expand(len(t), -1, -1), t), 1)  # (N, 18, 8)
            q, k, v = self.qkv(t).view(len(t), -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v)[:, :, 0].flatten(1)

    (rec,) = walk(ClassToken(), (3, 8, 8)).mixing
    assert (rec.kind, rec.tokens, rec.heads) == ("attention", (4, 4), 2)


def test_the_walk_reads_a_pooling_over_tokens_as_a_reduction():
    """Next-ViT's keys: AvgPool1d over a map's flattened tokens is a sum all-reduced (its
    whole result), not a pooling of a 1-D map with a halo."""

    class PooledKeys(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.sr = nn.Conv2d(3, 8, 3, padding=1), nn.AvgPool1d(16)

        def forward(self, x):
            t = self.conv(x).flatten(2)  # (N, 8, 64)
            k = self.sr(t).transpose(1, 2)  # (N, 4, 8): whole
            return (t.transpose(1, 2) @ k.transpose(1, 2)).mean()

    net = walk(PooledKeys(), (3, 8, 8))
    assert [(r.kind, r.tokens, r.numel) for r in net.mixing] == [("reduce", (8, 8), (32,))]
    sr = next(layer for layer in net.layers if layer.name == "sr")
    assert (sr.kind, sr.tokens, sr.window) == ("other", (8, 8), ())
    plain = walk(nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.AvgPool1d(2)), (3, 64))
    assert plain.mixing == () and plain.layers[-1].kind == "pool"  # a signal's own pooling


class WindowPartition(nn.Module):
    """Swin's windows of 7 x 7 over a 35 x 28 map, channels last: partitioned, mapped, and
    merged back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 8)

    def forward(self, x):
        x = self.conv(x).permute(0, 2, 3, 1)  # (N, 35, 28, 8)
        n, h, w, c = x.shape
        t = x.view(n, h // 7, 7, w // 7, 7, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 49, c)
        y = self.lin(t).view(n, h // 7, w // 7, 7, 7, c).permute(0, 1, 3, 2, 4, 5)
        return y.reshape(n, h, w, c).mean()


@pytest.mark.parametrize(
    ("grid", "rows"),
    [
        # 35 rows in blocks of 18 + 17, in whole windows 21 + 14: rank 1 sends 3 rows
        (Option(rows=2), 3),
        # blocks of 9, 9, 9, 8 and windows 14, 7, 7, 7: rank 1 sends 5 (rows 9 to 14)
        (Option(rows=4), 5),
        (Option(cols=2), 0),  # 28 columns: blocks of 14 are whole windows
    ],
)
def test_the_walk_counts_the_rows_a_window_partition_moves(grid, rows):
    """The partition and the merge back each move the rows past a block's last whole window
    to the neighbour, forward and (their gradient) backward: 35 x 28 x 8 values of 4 B."""
    net = walk(WindowPartition(), (3, 35, 28))
    assert [(r.kind, r.tokens, r.numel, r.groups) for r in net.mixing] == [
        ("move", (35, 28), (7840,), (7, 7))] * 2  # fmt: skip
    t = mixing_traffic(net.mixing[0], grid, 1)
    assert (t.nbytes, t.messages) == (2 * rows / 35 * 7840 * 4, 2 if rows else 0)


def test_a_reshape_that_keeps_the_map_whole_moves_nothing():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)  # (N, 8, 10, 10)
            n = y.shape[0]
            return y.reshape(n, 8, 100).view(n, 2, 4, 10, 10).sum()  # the channels regrouped

    assert walk(Flat(), (3, 10, 10)).mixing == ()


def test_a_dimension_of_one_put_before_the_map_moves_nothing():
    """CBAM's spatial gate views its (N, H, W) channel mean as (N, 1, H, W), and BotNet's
    relative logits reshape the whole map's rows into the batch and back: no rows move. (The
    walk's batch of one once read such a 1 as one window of all the rows.)"""

    class SpatialGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.gate = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(1, 1, 7, padding=3)

        def forward(self, x):
            y = self.conv(x)
            n, _, h, w = y.shape
            return (y * self.gate(y.mean(1).view(n, 1, h, w)).sigmoid()).mean()

    assert walk(SpatialGate(), (3, 32, 32)).mixing == ()
    kinds = [r.kind for r in walk(ForwardCodeNet("relative logits"), (3, 12, 10)).mixing]
    assert kinds == ["gather", "gather"]  # q @ k^T and @ v; no "move"


def test_the_walk_records_the_rows_flips_sums_and_warps_read_of_other_blocks():
    """A flip or a running sum along a spatial dimension, and a grid_sample, read rows of the
    other ranks' blocks (``rules/padding.py``, ``reductions.py``, ``resize.py``); along the
    channels they read nothing, and a flip along columns moves nothing under rows."""
    flips = walk(ForwardCodeNet("flips and running sums"), (3, 12, 10)).mixing
    assert [(r.kind, r.tokens, r.numel, r.along) for r in flips] == [
        ("fetch", (13, 11), (6 * 13 * 11,), (0,)),  # y.flip(2): the mirrored rows
        ("fetch", (13, 11), (6 * 13 * 11,), (1,)),  # flip(dims=(-1, 1)): columns, channels
        ("reduce", (13, 11), (6 * 11,), ()),  # y.cumsum(2): each block's last row
        ("reduce", (13, 11), (6 * 13,), ()),  # cumsum(dim=-1): its last column
        ("reduce", (13, 11), (6 * 13,), ()),  # cumprod(3); y.cumsum(1), over channels: none
    ]
    row_flip, col_flip = flips[:2]
    block = 7 / 13 * 6 * 13 * 11 * 4  # the larger block of 13 rows on 2 ranks, fp32
    assert mixing_traffic(row_flip, Option(rows=2), 1) == Traffic(2 * block, 2, block, True)
    assert mixing_traffic(col_flip, Option(rows=2), 1).nbytes == 0  # the negative control
    assert mixing_traffic(col_flip, Option(cols=2), 1).nbytes > 0
    warps = walk(ForwardCodeNet("warp"), (3, 12, 10)).mixing
    assert [(r.kind, r.tokens, r.along) for r in warps] == [("fetch", (12, 10), (0, 1))] * 3


def test_the_walk_records_matrices_along_one_spatial_dimension():
    """BAT's ``p @ x @ q`` and sMLP's ``Linear`` along W, and along H after a transpose: each a
    reduce-scatter along the dimension it maps, nothing where that dimension is whole."""
    maps = walk(ForwardCodeNet("axis mixing"), (3, 12, 10)).mixing
    assert [(r.kind, r.tokens, r.numel, r.along) for r in maps] == [
        ("axis", (12, 10), (6 * 12 * 10,), (0,)),  # p @ x: over H
        ("axis", (12, 10), (6 * 12 * 10,), (1,)),  # @ q: over W
        ("axis", (12, 10), (6 * 12 * 10,), (1,)),  # Linear(10, 10): over W
        ("axis", (12, 10), (6 * 12 * 10,), (0,)),  # Linear(12, 12) on the transpose: over H
    ]
    partial = 6 * 12 * 10 * 4 * (6 / 12)  # whole along H, this rank's half of W, fp32
    assert mixing_traffic(maps[0], Option(cols=2), 1) == Traffic(0.0, 0, 0.0, False)
    assert mixing_traffic(maps[0], Option(rows=2, cols=2), 1) == Traffic(partial, 2, partial, False)
    assert mixing_traffic(maps[1], Option(rows=2), 1).nbytes == 0  # W whole: local


def test_no_attention_no_token_cost():
    """The negative control: the same convolutions without the attention block."""
    net = walk(hybrid(attention=False), (3, 32, 32))
    assert net.mixing == ()
    p = plan([net], [from_flops(net, 1e9)], 2, 4, FAST, CPU, "cnn", 32)
    assert all(e.tokens_s == 0 and e.memory_mib[MIXING] == 0 for e in p.estimates)
    assert "tokens" not in table(p).splitlines()[4]  # the header row


def test_attention_appears_in_the_plan_and_changes_its_ranking():
    net = walk(hybrid(), (3, 32, 32))
    without = replace(net, mixing=())
    link = Network(2e-5, 1e9, "link")
    plans = [plan([n], [from_flops(n, 1e9)], 1, 2, link, CPU, "hybrid", 32) for n in (net, without)]
    by = {e.option: e for e in plans[0].estimates}
    assert by[Option(rows=2)].tokens_s > 0 and by[Option(channel=2)].tokens_s == 0
    assert by[Option(rows=2)].memory_mib[MIXING] > 0
    assert "tokens" in table(plans[0]).splitlines()[4]
    assert plans[0].to_dict()["recommended"]["tokens_s"] == 0  # channel: no token collective
    saved = plans[0].to_dict()
    assert Plan.from_dict(json.loads(json.dumps(saved))).to_dict() == saved
    # one image, a slow link: splitting it pays for the attention's all-to-alls
    assert plans[1].recommended.option.spatial == 2
    assert plans[0].recommended.option == Option(channel=2)
