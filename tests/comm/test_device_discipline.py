"""Device discipline on CPU machines: the gloo tier with communicators that refuse host tensors.

NCCL moves CUDA tensors only. Code that hands a host tensor to a collective (a size table, a
bucket order, a debug signature built with ``torch.tensor([...])``) therefore fails on GPUs
and nowhere else. Here every rank's communicator is declared for torch's lazy-tensor device,
which computes on the CPU: data collectives refuse host tensors as NCCL does and stage device
tensors through host memory as gloo does with CUDA tensors, and host metadata must take
``all_gather_ints``. Every layer and strategy runs with its parallel side on that device
against the dense model on the CPU: SyncBatchNorm, both channel splits, spatial layers on row,
column and 2 x 2 grids, DataParallel with its bucket rebuild, and whole networks under each
strategy. The negative control checks that host tensors are in fact refused.

Exactness is the CPU tiers' job; here whole networks are compared at a looser tolerance,
because torch's lazy backend itself deviates from eager float64 by up to ~1e-5 on a DCGAN
generator's transposed-convolution gradients, on one process without parallelkit. It also
skips the running-statistics update of torch's own batch_norm, which parallelkit calls where a
BatchNorm's group has one rank (channel parallelism without a data dimension): those buffers
are not compared there. A missed reduction or a wrong halo is off by far more than 1e-4.
"""

from __future__ import annotations

import pytest

from bn_cases import parity as bn_parity
from cases import assert_results, assert_triples
from channel_cases import parity as channel_parity
from device_cases import collectives, debug_mode, host_tensors_refused
from dp_cases import training_parity
from functional_cases import adjoint_products
from network_cases import NETWORKS, STRATEGY_GRIDS, network_parity
from spatial_cases import layer_parity
from volume_cases import volume_parity

LAZY = "lazy"
NETWORK_TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_on_the_device(device_ranks, size):
    for triples in device_ranks(size).run(collectives):
        assert_triples(triples)


def test_host_tensors_are_refused(device_ranks):
    for messages in device_ranks(2).run(host_tensors_refused):
        assert all("lazy:0" in m for m in messages), messages
        assert "moves tensors on lazy:0, got a (2,) tensor on cpu" in messages[0]
        assert "moves tensors on lazy:0, got a (2,) tensor on cpu" in messages[2]


def test_debug_mode_signatures_travel_on_the_host(device_ranks):
    for message in device_ranks(2).run(debug_mode):
        assert "ranks disagree on a collective" in message


@pytest.mark.parametrize(
    "name", ["all_gather dim1", "gather_from_group", "gather_rows", "halo", "reduce_scatter"]
)
def test_adjoint_on_the_device(device_ranks, name):
    shares = device_ranks(3).run(adjoint_products, name, device=LAZY)
    fx_y, x_fty = (sum(s[i] for s in shares) for i in (0, 1))
    assert fx_y == pytest.approx(x_fty, rel=1e-12)


@pytest.mark.parametrize(
    "name", ["(N, C, H, W)", "(N, C, L), empty rank", "height split, grad_comm", "bfloat16"]
)
def test_sync_batchnorm_on_the_device(device_ranks, name):
    for results in device_ranks(3).run(bn_parity, name, device=LAZY):
        assert_results(results)


@pytest.mark.parametrize(
    ("split", "options"),
    [("out", {}), ("in", {}), ("out", {"input_is_split": True}), ("in", {"scatter_output": True})],
)
def test_channel_parallel_on_the_device(device_ranks, split, options):
    for results in device_ranks(2).run(channel_parity, "k3 p1", split, device=LAZY, **options):
        assert_results(results)


@pytest.mark.parametrize(
    ("kind", "grid", "kw"),
    [
        ("conv", None, dict(kernel_size=3, padding=1)),
        ("conv", (1, 2), dict(kernel_size=3, stride=2, padding=1)),
        ("conv", (2, 2), dict(kernel_size=3, dilation=2, padding=2)),
        ("maxpool", (2, 2), dict(kernel_size=3, stride=2, padding=1)),
        ("avgpool", None, dict(kernel_size=2)),
        ("upsample", (2, 2), dict(scale_factor=2, mode="bilinear")),
        ("convT", None, dict(kernel_size=4, stride=2, padding=1)),
        ("globalpool", (2, 2), dict()),
    ],
)
def test_spatial_layers_on_the_device(device_ranks, kind, grid, kw):
    size = 4 if grid == (2, 2) else 2
    for triples in device_ranks(size).run(layer_parity, kind, (9, 8), grid, device=LAZY, **kw):
        assert_triples(triples)


@pytest.mark.parametrize("net", ["volume", "signal"])
def test_volumes_and_signals_on_the_device(device_ranks, net):
    """Conv3d (edge path and halo fetch), ConvTranspose3d, BatchNorm3d, pooling and
    trilinear upsampling; Conv1d and BatchNorm1d: every exchange on the device."""
    for triples in device_ranks(2).run(volume_parity, net, None, steps=1, device=LAZY):
        assert_results([(label, got, want, NETWORK_TOLERANCE) for label, got, want in triples])


def test_data_parallel_on_the_device(device_ranks):
    for triples in device_ranks(3).run(training_parity, "uneven", steps=3, device=LAZY):
        assert_triples(triples)


# Every network on 2 ranks under the model-parallel strategies, whose rules differ by layer;
# on the 4-rank grids (2 x 2, data x rows, data x channel) one network with every kind of
# layer, bottleneck blocks and a BatchNorm subclass: lazy tensors trace every operation, and
# ResNet-18 alone took minutes per 4-rank grid. Under "data" the communicator moves only the
# gradient buckets and the BatchNorm statistics, whatever the layers: the BatchNorm-subclass
# network and the DCGAN pair carry them (ResNet-18 and the plain bottleneck network added
# 40 s of lazy tracing and no other collective).
BIG = ("resnet18", "bottleneck resnet")
DEVICE_CASES = [
    (name, *grid)
    for grid in STRATEGY_GRIDS
    for name in NETWORKS
    if (grid[0] == 2 and not (grid[1] == "data" and name in BIG))
    or name == "bottleneck resnet, BatchNormAct2d"
]


@pytest.mark.parametrize(("name", "size", "strategy", "grid"), DEVICE_CASES)
def test_networks_on_the_device(device_ranks, name, size, strategy, grid):
    plain_batchnorm = strategy == "channel" and not grid  # torch's batch_norm, see above
    for triples in device_ranks(size).run(
        network_parity, name, strategy, grid, steps=2, device=LAZY, timeout=300
    ):
        assert_results(
            [
                (label, got, expected, NETWORK_TOLERANCE)
                for label, got, expected in triples
                if not (plain_batchnorm and "running_" in label)
            ]
        )
