"""Rank-side ChannelParallelConv1d/2d/3d cases, shared by the gloo and mpiexec tiers.

A case's spatial size (``hw``) says which: one size is a signal (``nn.Conv1d``), two an image
(``nn.Conv2d``), three a volume (``nn.Conv3d``); their names start with "1d" and "3d".
Every rank builds the same dense ``nn.Conv*d`` (fixed seed), the same whole input and output
gradient, and runs the dense convolution on them. The parallel layer is made with
``from_dense``; a replicated input or output is compared whole, a split one by this rank's
channel block. Blocks are computed here with ``torch.tensor_split`` (of the channels, or of the
groups when groups > 1), independently of the layer's own bookkeeping. Each case returns
``(label, got, expected, tolerance)``: output, input gradient, this rank's weight and bias
against the dense ones' block, and their gradients against the block of the dense gradients.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.nn import (
    ChannelParallelConv1d,
    ChannelParallelConv2d,
    ChannelParallelConv3d,
    ChannelParallelConvTranspose1d,
    ChannelParallelConvTranspose2d,
    ChannelParallelConvTranspose3d,
)

from bn_cases import counting

Result = tuple[str, torch.Tensor, torch.Tensor, dict]

# Defaults: 7 -> 10 channels (uneven over 3 and 4 ranks), 3x3 kernel, padding 1, an (9, 8) image.
DEFAULTS = dict(
    in_c=7,
    out_c=10,
    k=3,
    stride=1,
    padding=1,
    dilation=1,
    groups=1,
    bias=True,
    padding_mode="zeros",
    dtype=torch.float32,
    hw=(9, 8),
)
CASES: dict[str, dict] = {
    "k3 p1": {},
    "k1 p0": dict(k=1, padding=0),
    "k3 s2 p0, no bias": dict(stride=2, padding=0, bias=False),
    "k4 s2 p1 d2": dict(k=4, stride=2, padding=1, dilation=2),
    "k5 s2 p2": dict(k=5, stride=2, padding=2, hw=(11, 9)),
    "k5 same d2": dict(k=5, padding="same", dilation=2),
    "k4 same (uneven padding)": dict(k=4, padding="same", bias=False),
    "k (3,1) s (2,1) p (1,0)": dict(k=(3, 1), stride=(2, 1), padding=(1, 0)),
    "valid d (1,2)": dict(padding="valid", dilation=(1, 2)),
    "reflect d2": dict(padding=2, dilation=2, padding_mode="reflect"),
    "circular s2": dict(stride=2, padding_mode="circular"),
    "float64 k3 d2 p1": dict(dilation=2, dtype=torch.float64),
    "float64 k5 same, no bias": dict(k=5, padding="same", bias=False, dtype=torch.float64),
    "4 -> 5 channels": dict(in_c=4, out_c=5),
    "groups 2": dict(in_c=6, out_c=4, groups=2, k=4, stride=2, padding=1),
    "groups 4": dict(in_c=8, out_c=12, groups=4),
    "depthwise": dict(in_c=6, out_c=6, groups=6),
    "depthwise x2 k5 s2": dict(in_c=5, out_c=10, groups=5, k=5, stride=2, padding=2),
    # Volumes (N, C, D, H, W) and signals (N, C, L): the same splits along dim 1.
    "3d k3 p1": dict(hw=(5, 6, 4)),
    "3d k (3,1,2) s (2,1,1) p (1,0,1)": dict(
        k=(3, 1, 2), stride=(2, 1, 1), padding=(1, 0, 1), hw=(5, 6, 4)
    ),
    "3d same d2 reflect, no bias": dict(
        padding="same", dilation=2, padding_mode="reflect", bias=False, hw=(5, 6, 5)
    ),
    "3d float64 k4 s2 circular": dict(
        k=4, stride=2, padding=1, padding_mode="circular", dtype=torch.float64, hw=(6, 5, 5)
    ),
    "3d groups 2": dict(in_c=6, out_c=4, groups=2, hw=(4, 5, 4)),
    "1d k5 s2 p2": dict(k=5, stride=2, padding=2, hw=(17,)),
    "1d same d3 replicate": dict(padding="same", dilation=3, padding_mode="replicate", hw=(13,)),
    "1d depthwise x2": dict(in_c=5, out_c=10, groups=5, hw=(11,)),
}
# (case, split, options) beyond the defaults gather_output=True, input_is_split=False.
OPTIONS: list[tuple[str, str, dict]] = [
    ("k3 p1", "out", dict(gather_output=False)),
    ("k3 p1", "out", dict(input_is_split=True)),
    ("k5 same d2", "out", dict(input_is_split=True, gather_output=False)),
    ("k3 p1", "in", dict(input_is_split=True)),
    ("k3 p1", "in", dict(scatter_output=True)),
    ("k3 s2 p0, no bias", "in", dict(scatter_output=True)),
    ("float64 k3 d2 p1", "in", dict(input_is_split=True, scatter_output=True)),
    ("groups 4", "out", dict(input_is_split=True, gather_output=False)),
    ("groups 4", "in", dict(scatter_output=True)),
    ("depthwise", "in", dict(input_is_split=True)),
    ("3d k3 p1", "out", dict(gather_output=False)),
    ("3d k3 p1", "out", dict(input_is_split=True)),
    ("3d k3 p1", "in", dict(scatter_output=True)),
    ("3d float64 k4 s2 circular", "in", dict(input_is_split=True, scatter_output=True)),
    ("1d k5 s2 p2", "in", dict(input_is_split=True)),
    ("1d k5 s2 p2", "out", dict(gather_output=False)),
]
# Chains of layers: (dense conv kwargs, split, options, ReLU after). Every layer but the first
# takes the previous one's output layout; the last returns the whole output.
CHAINS: dict[str, list[tuple[dict, str, dict, bool]]] = {
    "out -> relu -> in": [
        (dict(in_c=7, out_c=10), "out", dict(gather_output=False), True),
        (dict(in_c=10, out_c=6, stride=2), "in", dict(input_is_split=True), False),
    ],
    "in (scatter) -> relu -> out (split input)": [
        (dict(in_c=7, out_c=10, k=1, padding=0), "in", dict(scatter_output=True), True),
        (dict(in_c=10, out_c=5), "out", dict(input_is_split=True), False),
    ],
    "out -> depthwise -> relu -> in (MobileNet block)": [
        (dict(in_c=6, out_c=12, k=1, padding=0), "out", dict(gather_output=False), False),
        (
            dict(in_c=12, out_c=12, groups=12, k=3, padding=1),
            "out",
            dict(input_is_split=True, gather_output=False),
            True,
        ),
        (dict(in_c=12, out_c=6, k=1, padding=0), "in", dict(input_is_split=True), False),
    ],
    "3d out -> relu -> in": [
        (dict(in_c=7, out_c=10, hw=(5, 4, 6)), "out", dict(gather_output=False), True),
        (dict(in_c=10, out_c=6, stride=2, hw=(5, 4, 6)), "in", dict(input_is_split=True), False),
    ],
}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: {}}


def spec_of(name: str) -> dict:
    return {**DEFAULTS, **CASES[name]}


def valid(spec: dict, split: str, options: dict, size: int) -> bool:
    """Whether the layer can be split over ``size`` ranks (else it raises; see ``errors``)."""
    if spec["groups"] > 1:
        return spec["groups"] >= size
    split_in = split == "in" or options.get("input_is_split", False)
    split_out = split == "out" or options.get("scatter_output", False)
    return (not split_in or spec["in_c"] >= size) and (not split_out or spec["out_c"] >= size)


def block(total: int, groups: int, comm: Communicator) -> slice:
    """This rank's block of ``total`` channels as a slice: a ``tensor_split`` of the channels,
    or of the ``groups`` when there are several (whole groups)."""
    units = total if groups == 1 else groups
    parts = torch.tensor_split(torch.arange(units), comm.size)
    per = total // units
    mine = parts[comm.rank]
    start = int(mine[0]) * per if len(mine) else 0
    return slice(start, start + len(mine) * per)


DENSE = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
LAYERS = {1: ChannelParallelConv1d, 2: ChannelParallelConv2d, 3: ChannelParallelConv3d}


def _conv_args(spec: dict) -> tuple:
    """nn.Conv*d's positional arguments for a case, in its order."""
    keys = ("in_c", "out_c", "k", "stride", "padding", "dilation", "groups", "bias", "padding_mode")
    return tuple(spec[key] for key in keys)


def layer_type(spec: dict) -> type[ChannelParallelConv2d]:
    """The channel-parallel layer for a case's number of spatial dimensions."""
    return LAYERS[len(spec["hw"])]


def dense_conv(spec: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return DENSE[len(spec["hw"])](*_conv_args(spec), dtype=spec["dtype"])


def parameter_results(
    layer: nn.Module, dense: nn.Module, split: str, comm: Communicator, at: str = ""
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """This rank's weight/bias and their gradients against the dense ones' block."""
    groups = dense.groups
    rows = block(dense.out_channels, 1 if groups == 1 else groups, comm)
    if split == "in" and groups == 1:
        w_block = lambda w: w[:, block(dense.in_channels, 1, comm)]  # noqa: E731
    else:
        w_block = lambda w: w[rows]  # noqa: E731
    triples = [
        (f"{at}weight", layer.weight, w_block(dense.weight)),
        (f"{at}weight grad", layer.weight.grad, w_block(dense.weight.grad)),
    ]
    if dense.bias is not None:
        b_block = (lambda b: b) if split == "in" else (lambda b: b[rows])
        triples.append((f"{at}bias", layer.bias, b_block(dense.bias)))
        triples.append((f"{at}bias grad", layer.bias.grad, b_block(dense.bias.grad)))
    return triples


def parity(
    comm: Communicator, name: str, split: str, device: str | None = None, **options
) -> list[Result]:
    """ChannelParallelConv*d over ``comm`` vs. nn.Conv*d on the whole input, same weights;
    ``device``: where the parallel layer runs."""
    spec = spec_of(name)
    dtype, groups = spec["dtype"], spec["groups"]
    dense = dense_conv(spec)
    layer = layer_type(spec).from_dense(dense, comm, split=split, **options).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, spec["in_c"], *spec["hw"], generator=g, dtype=dtype, requires_grad=True)
    y = dense(x)
    dy = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(dy)

    cols = block(spec["in_c"], groups, comm) if options.get("input_is_split") else slice(None)
    split_out = options.get("scatter_output") or not options.get("gather_output", True)
    rows = block(spec["out_c"], groups, comm) if split_out else slice(None)
    x_mine = x.detach()[:, cols].clone().to(device).requires_grad_()
    y_mine = layer(x_mine)
    y_mine.backward(dy[:, rows].to(device))
    triples = [
        ("output", y_mine, y[:, rows]),
        ("input grad", x_mine.grad, x.grad[:, cols]),
        *parameter_results(layer, dense, split, comm),
    ]
    return [(label, got, want.detach(), TOLERANCE[dtype]) for label, got, want in triples]


def chain(comm: Communicator, name: str) -> list[Result]:
    """Layers passing channel shards to each other vs. the dense convolutions in a row."""
    links = CHAINS[name]
    denses = [dense_conv({**DEFAULTS, **spec}, seed=i) for i, (spec, *_) in enumerate(links)]
    kind = layer_type({**DEFAULTS, **links[0][0]})
    layers = [
        kind.from_dense(d, comm, split=split, **options)
        for d, (_, split, options, _) in zip(denses, links, strict=True)
    ]
    g = torch.Generator().manual_seed(1)
    hw = links[0][0].get("hw", DEFAULTS["hw"])
    x = torch.randn(2, links[0][0]["in_c"], *hw, generator=g, requires_grad=True)
    x_mine = x.detach().clone().requires_grad_()
    y, y_mine = x, x_mine
    for dense, layer, (*_, relu) in zip(denses, layers, links, strict=True):
        y, y_mine = dense(y), layer(y_mine)
        if relu:
            y, y_mine = F.relu(y), F.relu(y_mine)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    y_mine.backward(dy)
    triples = [("output", y_mine, y), ("input grad", x_mine.grad, x.grad)]
    for i, (dense, layer, (_, split, *_)) in enumerate(zip(denses, layers, links, strict=True)):
        triples += parameter_results(layer, dense, split, comm, at=f"layer {i} ")
    return [(label, got, want.detach(), TOLERANCE[torch.float32]) for label, got, want in triples]


def grouped_shortcut(comm: Communicator, name: str) -> list[Result]:
    """Negative control: each rank convolves only its own input block into its own output
    block (a grouped convolution with groups=comm.size); it misses the cross-block terms."""
    spec = spec_of(name)
    dense = dense_conv(spec)
    x = torch.randn(2, spec["in_c"], *spec["hw"], generator=torch.Generator().manual_seed(1))
    rows, cols = block(spec["out_c"], 1, comm), block(spec["in_c"], 1, comm)
    bias = None if dense.bias is None else dense.bias[rows]
    w = dense.weight[rows, cols]
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(spec["hw"]) - 1]
    y_shard = conv(x[:, cols], w, bias, dense.stride, dense.padding, dense.dilation)
    sizes = comm.all_gather(torch.tensor([y_shard.shape[1]])).tolist()
    y = pkf.gather_from_group(y_shard, comm, 1, sizes)
    return [("output", y, dense(x).detach(), TOLERANCE[torch.float32])]


def round_trip(comm: Communicator, name: str, split: str) -> list[Result]:
    """from_dense then to_dense gives the dense conv back; a layer constructed under the same
    random state holds the shard of the nn.Conv*d constructed under it; both compute alike."""
    spec = spec_of(name)
    dense = dense_conv(spec, seed=3)
    kind = layer_type(spec)
    back = kind.from_dense(dense, comm, split=split).to_dense()
    torch.manual_seed(3)
    layer = kind(*_conv_args(spec), dtype=spec["dtype"], comm=comm, split=split)
    made = layer.to_dense()
    x = torch.randn(2, spec["in_c"], *spec["hw"], dtype=spec["dtype"])
    exact: dict = dict(rtol=0, atol=0)
    out: list[Result] = []
    for what, conv in (("from_dense -> to_dense", back), ("constructed -> to_dense", made)):
        same = type(conv) is type(dense) and _config(conv) == _config(dense)
        out.append((f"{what} type and config", torch.tensor(same), torch.tensor(True), exact))
        out.append((f"{what} weight", conv.weight.detach(), dense.weight.detach(), exact))
        if dense.bias is not None:
            out.append((f"{what} bias", conv.bias.detach(), dense.bias.detach(), exact))
    with torch.no_grad():
        out.append(("layer vs its to_dense", layer(x), made(x), TOLERANCE[spec["dtype"]]))
    return out


def _config(conv: nn.Module) -> tuple:
    names = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation")
    return (*(getattr(conv, n) for n in names), conv.groups, conv.padding_mode, conv.weight.dtype)


def replicated_bias(comm: Communicator) -> torch.Tensor:
    """The bias of split="in" layers constructed under a different random state per rank."""
    torch.manual_seed(100 + comm.rank)
    return ChannelParallelConv2d(7, 10, 3, comm=comm, split="in").bias.detach()


def collective_counts(
    comm: Communicator, split: str, name: str = "k3 p1", **options
) -> tuple[int, int]:
    """How many collectives one forward and one backward issue on this rank."""
    spec = spec_of(name)
    layer = layer_type(spec).from_dense(dense_conv(spec), comm, split=split, **options)
    x = torch.randn(2, spec["in_c"], *spec["hw"], requires_grad=True)
    with counting(comm) as forward:
        y = layer(x)
    with counting(comm) as backward:
        (y * y).sum().backward()
    return sum(forward.values()), sum(backward.values())


# Configurations that cannot be split over 3 ranks: (constructor args, kwargs, message part).
BAD_SPLITS = [
    ((2, 8, 3), dict(split="in"), "2 input channels cannot be split over 3 ranks"),
    ((8, 2, 3), dict(split="out"), "2 output channels cannot be split over 3 ranks"),
    ((2, 8, 3), dict(split="out", input_is_split=True), "2 input channels cannot be split"),
    ((8, 2, 3), dict(split="in", scatter_output=True), "2 output channels cannot be split"),
    ((4, 4, 3), dict(groups=2), "2 groups cannot be split into whole groups over 3 ranks"),
    ((4, 4, 3), dict(groups=2, split="in"), "use groups=1 (dense)"),
]
# Inputs that a replicated-input layer (8 -> 6, k3, split over 3 ranks) rejects.
BAD_INPUTS = [
    ((2, 7, 9, 9), "expected 8 input channels"),
    ((8, 9, 9), "expected an (N, C, H, W) input"),
    ((2, 8, 2, 9), "smaller than the dilated kernel"),
]


def errors(comm: Communicator) -> list[str]:
    """Bad arguments and inputs raise ValueError on every rank, before any collective."""
    messages = []
    for args, kwargs, part in BAD_SPLITS:
        with pytest.raises(ValueError, match=re.escape(part)) as info:
            ChannelParallelConv2d(*args, **kwargs, comm=comm)
        messages.append(str(info.value))
    for split in ("out", "in"):
        layer = ChannelParallelConv2d(8, 6, 3, comm=comm, split=split)
        for shape, part in BAD_INPUTS:
            with pytest.raises(ValueError, match=re.escape(part)) as info:
                layer(torch.zeros(shape))
            messages.append(str(info.value))
    # A shard of the wrong size: in debug mode every rank learns every rank's shard size.
    layer = ChannelParallelConv2d(10, 4, 1, comm=comm, split="in", input_is_split=True)
    wrong = torch.tensor_split(torch.zeros(1, 11, 2, 2), comm.size, dim=1)[comm.rank]
    debug, comm.debug = comm.debug, True
    try:
        with pytest.raises(ValueError, match="with input_is_split") as info:
            layer(wrong)
    finally:
        comm.debug = debug
    messages.append(str(info.value))
    return messages


# ----------------------------------------------------------------------------- transposed
TRANSPOSED = {1: ChannelParallelConvTranspose1d, 2: ChannelParallelConvTranspose2d,
              3: ChannelParallelConvTranspose3d}  # fmt: skip
DENSE_TRANSPOSED = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
# name -> (in, out channels, kernel, stride, padding, output_padding, dilation, bias, size)
TRANSPOSED_CASES: dict[str, tuple] = {
    "2d k4 s2 p1": (7, 5, 4, 2, 1, 0, 1, True, (4, 5)),
    "3d k4 s2 p1": (7, 5, 4, 2, 1, 0, 1, True, (3, 4, 3)),
    "3d k3 s2 p1 op1 d1, no bias": (6, 9, 3, 2, 1, 1, 1, False, (3, 2, 4)),
    "3d k (2,3,3) s (1,2,2) d2": (5, 7, (2, 3, 3), (1, 2, 2), 0, 0, 2, True, (3, 3, 2)),
    "3d float64 k2 s2": (4, 5, 2, 2, 0, 0, 1, True, (2, 3, 3)),
    "1d k5 s3 p2 op1": (7, 10, 5, 3, 2, 1, 1, True, (6,)),
}


def transposed_parity(comm: Communicator, name: str, split: str) -> list[Result]:
    """ChannelParallelConvTranspose*d over ``comm`` vs. nn.ConvTranspose*d on the whole input:
    output, input gradient, this rank's weight and bias and their gradients."""
    c_in, c_out, k, stride, pad, out_pad, dil, bias, size = TRANSPOSED_CASES[name]
    dtype = torch.float64 if "float64" in name else torch.float32
    torch.manual_seed(0)
    dense = DENSE_TRANSPOSED[len(size)](
        c_in, c_out, k, stride, pad, out_pad, 1, bias, dil, dtype=dtype
    )
    layer = TRANSPOSED[len(size)].from_dense(dense, comm, split=split)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, c_in, *size, generator=g, dtype=dtype, requires_grad=True)
    y = dense(x)
    dy = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(dy)
    x_mine = x.detach().clone().requires_grad_()
    y_mine = layer(x_mine)
    y_mine.backward(dy)
    # The weight (C, C'/groups, *k): "out" holds a block of dim 1, "in" a block of dim 0.
    dim, total = (1, c_out) if split == "out" else (0, c_in)
    mine = block(total, 1, comm)
    w_block = lambda w: w[:, mine] if dim == 1 else w[mine]  # noqa: E731
    triples = [
        ("output", y_mine, y),
        ("input grad", x_mine.grad, x.grad),
        ("weight", layer.weight, w_block(dense.weight)),
        ("weight grad", layer.weight.grad, w_block(dense.weight.grad)),
    ]
    if bias:
        b_block = (lambda b: b[mine]) if split == "out" else (lambda b: b)
        triples.append(("bias grad", layer.bias.grad, b_block(dense.bias.grad)))
    return [(label, got, want.detach(), TOLERANCE[dtype]) for label, got, want in triples]


# ----------------------------------------------------------------------------- the strategy
def _nothing_to_split() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Models in which the channel strategy over 4 ranks finds no layer to split."""
    return {
        "no convolutions": (nn.Sequential(nn.Flatten(), nn.Linear(24, 8)), (2, 3, 8)),
        "narrow 3-D convolutions": (
            nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv3d(3, 2, 1)),
            (1, 1, 4, 4, 4),
        ),
        "everything kept dense": (nn.Sequential(nn.Conv3d(1, 8, 1)), (1, 1, 2, 2, 2)),
    }


def channel_refusal(comm: Communicator, name: str) -> str:
    """The channel strategy's refusal of a model it cannot split, on this rank."""
    model, _ = _nothing_to_split()[name]
    keep = ["0"] if name == "everything kept dense" else []
    with pytest.raises(ValueError, match="splits nothing") as info:
        pk.parallelize(model, comm, "channel", keep_dense=keep)
    return str(info.value)


def swapped_layers(comm: Communicator) -> list[str]:
    """The classes the channel strategy puts in place of a 3-D and a 1-D network's layers."""
    model = nn.Sequential(
        nn.Conv3d(1, 6, 3, padding=1), nn.ConvTranspose3d(6, 5, 2, stride=2),
        nn.Conv3d(5, 2, 1), nn.Conv3d(2, 2, 1),  # the last: too narrow for 3 ranks, kept dense
        nn.Conv1d(2, 4, 3), nn.ConvTranspose1d(4, 2, 3),
    )  # fmt: skip
    model = pk.parallelize(model, comm, "channel")
    return [type(m).__name__ for m in model]


def volume_parity_without_input_sum(comm: Communicator, net: str, grid: dict) -> list[str]:
    """Negative control: split="out" layers whose backward leaves the partial input gradients
    unsummed (``copy_to_group`` replaced by the identity); the labels that then mismatch."""
    from cases import mismatches
    from volume_cases import volume_parity

    copy_to_group = pkf.copy_to_group
    pkf.copy_to_group = lambda x, comm: x
    try:
        triples = volume_parity(comm, net, grid, steps=1)
    finally:
        pkf.copy_to_group = copy_to_group
    return mismatches([(label, got, want, {}) for label, got, want in triples])
