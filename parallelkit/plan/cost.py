"""The cost model: step time (compute, exchange, reductions) and peak memory per rank of one
network under one process grid, from the walk's layers, a compute profile and a network.

Pure arithmetic: no torch, no processes, so every term can be tested by hand. What each
strategy does per step follows ``pk.parallelize`` (``parallelkit/parallel/parallelize.py``):

    grid            compute per rank                  exchange                  reductions
    data  d         the layers on batch/d images       -                         gradients: one
                                                                                 bucketed all-reduce
                                                                                 (25 MiB buckets)
                                                                                 overlapped with
                                                                                 backward
    spatial         region layers on the rank's block  per conv/pool: halo rows  parameter grads:
    z x r x c       (its share of D x H x W), the      along each split          shares summed by
                    rest whole                         dimension, forward and    DataParallel over
                                                       back (geometry.Window     data x z x r x c in
                                                       .plan); gather at region  overlapped buckets;
                                                       end (none for per-pixel   InstanceNorm and
                                                       outputs with blocks in)   GroupNorm stats
                                                                                 over z x r x c
    channel k       convolutions by k (their output    per conv: all-gather of   -
                    or input channels), the rest whole y (fwd), all-reduce of
                                                       dx (bwd)
    every grid      BatchNorm over data x spatial: one all-gather of (n, mean, M2) forward, one
                    all-reduce of two sums backward (SyncBatchNorm)

Token mixing (the walk's :class:`~parallelkit.plan.walk.Mixing` records; a column of its own,
``tokens``), under s > 1 spatial ranks, as ``parallelkit/spatial/rules/tokens.py`` runs it:

    self-attention, heads    the head all-to-all (DeepSpeed-Ulysses): q, k, v and the output
    divide by s, no mask     each cross once forward and once backward, (s-1)/s of the rank's
                             block of each; the rank holds its h/s heads of all L tokens
    self-attention, else     the ring: s-1 shifts of the key/value block forward; backward s-1
                             shifts of it with its gradients and one of the gradients home;
                             two key/value blocks in flight
    keys of another map,     an all-gather of each (reduce-scatter of its gradient); the whole
    the explicit q @ k^T     keys and values held
    contractions, maps over  an all-reduce of the (small) result, forward
    the token axis
    a matrix along one       BAT's p @ x, a Linear along W: each rank's partial map (whole along
    spatial dimension        it) reduce-scattered forward, all-gathered backward
    rows of other blocks     a flip along a split dimension or a grid_sample: a block of rows
    read (fetch)             fetched forward, its gradient sent home backward; a running sum
                             along one: each block's last row gathered (as a reduce)
    a map cut into groups    where a rank's block is not whole groups (windows of 7 on blocks
    (window partitions)      of 18 + 17 rows), the rows past the last whole group go to the
                             neighbour, forward and (their gradient) back

A sample has 1, 2 or 3 spatial dimensions; a spatial grid splits a volume's D by ``depth``, H
by ``rows`` and W by ``cols`` (an image's H and W by rows and cols, a signal's L by rows), as
:class:`parallelkit.spatial.grid.SpatialGrid` does.

Ranks that outnumber the cores share them: compute (and a local network's messages) slow by
``(ranks + other processes' load) / cores``. Memory per rank: the process baseline,
parameters + gradients + momentum (+ DataParallel's flat bucket buffers), the samples (the
input and its labels: whole on every rank of a spatial group, or with ``blocks_in``, as
``pk.parallelize(..., spatial_input="blocks")`` takes them, only the rank's block), the
activations autograd keeps (each leaf's output, the rank's share of it under spatial
parallelism plus the fetched halo block each convolution off the edge path saves), and the
largest activation gradient twice (backward's working set).

Legend: ``b`` samples per rank, ``s`` spatial ranks (depth x rows x cols), ``k`` channel
ranks, ``d`` data ranks; activations are fp32, per-pixel labels int64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from parallelkit.dims import GridDims
from parallelkit.geometry import (
    Window,
    blocks,
    received_rows,
    starts,
    transposed_halo,
    transposed_needs,
)
from parallelkit.plan.measure import Profile
from parallelkit.plan.network import Network
from parallelkit.plan.walk import Layer, Mixing, Net

F32 = 4
I64 = 8  # a label: one per sample, or one per pixel (voxel) of a per-pixel network
MIB = 1 << 20
BUCKET_BYTES = 25 * MIB  # DataParallel's default bucket_cap_mb
SAMPLES = "input and labels"  # the memory part that blocks in divides
MIXING = "token mixing"  # the memory part of the token collectives' buffers


@dataclass(frozen=True)
class Option(GridDims):
    """A process grid the planner weighs: ``data x depth x rows x cols x channel`` ranks."""

    @property
    def ranks(self) -> int:
        return self.size

    @property
    def spatial(self) -> int:  # type: ignore[override]
        """Ranks that split one sample: ``depth * rows * cols`` (GridDims' ``spatial_size``;
        the planner counts them where GridDims lists them)."""
        return self.spatial_size

    def parts(self, dims: int) -> tuple[int, ...]:
        """Blocks along each spatial dimension of a sample with ``dims`` of them (D H W order):
        a volume's ``(depth, rows, cols)``, an image's ``(rows, cols)``, a signal's
        ``(rows,)`` (``parallelkit.spatial.grid.SpatialGrid.axes``)."""
        return ((self.rows,), (self.rows, self.cols), (self.depth, self.rows, self.cols))[dims - 1]


def options(ranks: int, dims: int = 2) -> list[Option]:
    """Every grid of ``ranks`` ranks that ``pk.parallelize`` takes for samples with ``dims``
    spatial dimensions: depth only for volumes (3), columns for images and volumes (spatial
    and channel parallelism are not combined)."""
    out = []
    for d in _divisors(ranks):
        rest = ranks // d
        for z in _divisors(rest) if dims == 3 else [1]:
            for r in _divisors(rest // z):
                for c in _divisors(rest // z // r) if dims >= 2 else [1]:
                    k = rest // z // r // c
                    if z * r * c > 1 and k > 1:
                        continue
                    out.append(Option(d, r, c, k, depth=z))
    return out


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


@dataclass(frozen=True)
class Machine:
    """Where the ranks run: ``cores`` they share (None: one device each, no sharing), the
    memory of a rank's process before any model (interpreter, torch, parallelkit), the
    memory a step takes beyond its tensors (see :func:`calibrate`), and the memory of a
    rank's device, when it has a limit the plan should check."""

    cores: float | None = None
    baseline_mib: float = 0.0
    # What a real step holds beyond the model's tensors (allocator caches, kernels'
    # workspaces): a 1-rank step's measured peak less this model's prediction for it.
    overhead_mib: float = 0.0
    # Cores that other processes keep busy meanwhile; they share the cores fairly (Linux's
    # scheduler), so each rank gets cores / (ranks + other_load) of one when oversubscribed.
    other_load: float = 0.0
    # Memory of one rank's device (None: not checked); a grid needing more is marked
    # as not fitting.
    device_mib: float | None = None

    def slowdown(self, ranks: int) -> float:
        """How much longer a rank's compute takes than on a core of its own."""
        if self.cores is None:
            return 1.0
        return max(1.0, (ranks + self.other_load) / self.cores)


@dataclass
class Estimate:
    """Predicted step (seconds) and peak memory per rank (MiB) of one grid."""

    option: Option
    compute_s: float = 0.0
    exchange_s: float = 0.0
    reductions_s: float = 0.0
    memory_mib: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # With blocks in: the peak memory per rank the same grid needs with whole samples in.
    whole_in_mib: float | None = None
    tokens_s: float = 0.0  # the token-mixing collectives (attention, contractions over tokens)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exchange_s + self.reductions_s + self.tokens_s

    @property
    def peak_mib(self) -> float:
        return sum(self.memory_mib.values())

    @property
    def feasible(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------- geometry
def block_share(size: Sequence[int], parts: Sequence[int]) -> float:
    """The largest share of a sample of spatial ``size`` that one rank holds when each
    dimension is split into ``parts`` blocks (``torch.tensor_split``: the first ones larger)."""
    share = 1.0
    for n, p in zip(size, parts, strict=True):
        share *= max(b - a for a, b in blocks(n, p)) / n
    return share


def spatial_share(layer: Layer, opt: Option) -> float:
    """The largest share of the layer's output that one rank computes (1 outside the region):
    its block of the map, or of the map flattened into its tokens."""
    if not layer.spatial or opt.spatial == 1 or layer.dims < 1:
        return 1.0
    if layer.tokens:
        return block_share(layer.tokens, opt.parts(len(layer.tokens)))
    return block_share(layer.out_shape[1:], opt.parts(layer.dims))


def halo_rows(layer: Layer, dim: int, parts: int) -> tuple[int, int]:
    """(rows the busiest rank receives from others, input rows it then holds) along spatial
    ``dim`` (0 the first: a volume's D, an image's H) of ``layer`` split over ``parts`` ranks;
    (0, whole input) when nothing is split."""
    n, m = layer.in_shape[1 + dim], layer.out_shape[1 + dim]
    sizes = [b - a for a, b in blocks(n, parts)]
    if parts == 1:
        return 0, n
    if layer.kind == "convT":
        k, s, p, _, d = layer.window[dim]
        out = [b - a for a, b in blocks(m, parts)]
        want = [
            transposed_needs(o, o + sz, n, k, s, p, d)
            for o, sz in zip(starts(out), out, strict=True)
        ]
    else:
        k, s, lo, hi, d = layer.window[dim]
        _, _, want = Window(k, s, lo, hi, d).plan(n, parts)
    got = received_rows(sizes, want)
    r = max(range(parts), key=lambda i: got[i])
    return got[r], max(hi - lo for lo, hi in want)


def halo_bytes(layer: Layer, opt: Option, images: float) -> float:
    """Bytes the busiest rank receives in the layer's forward halo exchange.

    The exchange runs one dimension after another, the last first (W, then H, then D:
    :mod:`parallelkit.spatial.edges`), each on the block already extended along the
    dimensions exchanged before it, so the edges and corners ride along: along dimension i
    the received rows are as wide as the block along the earlier dimensions and as the
    extended block along the later ones.
    """
    if not layer.window or not layer.spatial or opt.spatial == 1:
        return 0.0
    size, parts = layer.in_shape[1:], opt.parts(layer.dims)
    received = [halo_rows(layer, i, p)[0] for i, p in enumerate(parts)]
    block = [math.ceil(n / p) for n, p in zip(size, parts, strict=True)]
    extended = [b + r for b, r in zip(block, received, strict=True)]
    total = 0
    for i, rows in enumerate(received):
        # exchanged after this dimension: the bare block; before it: the extended one
        total += rows * math.prod(block[:i]) * math.prod(extended[i + 1 :])
    return images * layer.in_shape[0] * F32 * total


# ---------------------------------------------------------------------------- time
def _channel_split(layer: Layer, k: int) -> str | None:
    """How ``pk.parallelize`` splits the layer over ``k`` channel ranks (parallelize's
    ``_channel_layer``): "out", "in", or None (stays dense)."""
    if k == 1 or layer.kind not in ("conv", "convT"):
        return None
    out_c, in_c = layer.out_shape[0], layer.in_shape[0]
    if layer.kind == "convT":
        return None if layer.groups != 1 else "out" if out_c >= k else "in" if in_c >= k else None
    if layer.groups != 1 and layer.groups < k:
        return None
    if out_c >= k:
        return "out"
    return "in" if in_c >= k and layer.groups == 1 else None


def compute_seconds(net: Net, prof: Profile, opt: Option, batch: int) -> float:
    """One rank's compute for one step of ``net`` (all its passes and its optimizer step),
    on a core of its own."""
    b = batch / opt.data
    per_image = 0.0
    for layer, t in zip(net.layers, prof.layer_s, strict=True):
        share = spatial_share(layer, opt)
        if _channel_split(layer, opt.channel):
            share /= opt.channel
        per_image += t * share
    per_image += prof.other_s / opt.spatial  # elementwise work in the region, mostly
    return net.passes * b * per_image + params_per_rank(net, opt) * prof.optimizer_s_per_param


def params_per_rank(net: Net, opt: Option) -> float:
    """Parameters one rank holds: channel-split convolutions hold 1/k of their weights."""
    split = sum(layer.params for layer in net.layers if _channel_split(layer, opt.channel))
    return net.params - split + split / opt.channel


def output_blocks(net: Net, blocks_in: bool) -> bool:
    """Whether the network's output stays split (``spatial_output="blocks"``): a per-pixel
    output scored against labels that came in as blocks (the loss on blocks, reduced exactly,
    as ``parallelkit train``'s segmentation does), so no rank gathers it."""
    return blocks_in and net.per_pixel


def exchange_seconds(
    net: Net, opt: Option, batch: int, link: Network, blocks_in: bool = False
) -> float:
    """Activation traffic of one step: halos and region ends (spatial), gathered and reduced
    activations (channel). With ``blocks_in`` a per-pixel output is not gathered
    (:func:`output_blocks`)."""
    b, s, k = batch / opt.data, opt.spatial, opt.channel
    total, in_region = 0.0, False
    for i, layer in enumerate(net.layers):
        if s > 1 and layer.spatial and layer.window:
            nbytes = halo_bytes(layer, opt, b)
            # forward fetch and backward return; each from up to two neighbours per dim
            total += 2 * (2 * link.latency_s + nbytes / link.bandwidth_Bps)
        if s > 1 and in_region and not layer.spatial:  # the region ends: gather or global pool
            total += link.all_gather(b * layer.in_numel * F32, s)
        in_region = layer.spatial
        split = _channel_split(layer, k)
        x_bytes, y_bytes = b * layer.in_numel * F32, b * layer.out_numel * F32
        needs_dx = i > 0 or net.input_grad
        if split == "out":
            total += link.all_gather(y_bytes, k) + (link.all_reduce(x_bytes, k) if needs_dx else 0)
        elif split == "in":
            total += link.all_reduce(y_bytes, k) + (link.all_gather(x_bytes, k) if needs_dx else 0)
    if s > 1 and in_region and not output_blocks(net, blocks_in):  # split to the end: gathered
        total += link.all_gather(b * net.layers[-1].out_numel * F32, s)
    return net.passes * total


def reduction_seconds(
    net: Net, prof: Profile, opt: Option, batch: int, link: Network, backward_s: float
) -> float:
    """BatchNorm statistics and DataParallel's all-reduce (over data x spatial: under spatial
    parallelism it sums the parameters' gradient shares); InstanceNorm and GroupNorm statistics
    (each sample's, over the spatial group: two means forward, two sums backward)."""
    group, b = opt.data * opt.spatial, batch / opt.data
    per_pass = 0.0
    for layer in net.layers:
        c = layer.out_shape[0]
        if layer.kind == "norm" and group > 1:
            per_pass += link.all_gather(3 * c * F32 * group, group) + link.all_reduce(
                2 * c * F32, group
            )
        elif layer.kind == "sample_norm" and layer.spatial and opt.spatial > 1:
            per_pass += 4 * link.all_reduce(b * c * F32, opt.spatial)
    total = net.passes * per_pass
    if opt.data > 1 or opt.spatial > 1:
        total += data_parallel_exposed(net, prof, opt, link, backward_s)
    return total


def data_parallel_exposed(
    net: Net, prof: Profile, opt: Option, link: Network, backward_s: float
) -> float:
    """Seconds of DataParallel's all-reduce (over data x spatial) not hidden behind backward:
    buckets of 25 MiB fill in reverse layer order as backward reaches them (spread over
    ``backward_s`` like the layers' compute) and go out one after another."""
    group = opt.data * opt.spatial
    layers = [(layer, t) for layer, t in zip(net.layers, prof.layer_s, strict=True) if layer.params]
    total_t = sum(t for _, t in layers) or 1.0
    clock, fill, free = 0.0, 0.0, 0.0
    scale = params_per_rank(net, opt) / max(net.params, 1)
    for layer, t in reversed(layers):
        clock += backward_s * t / total_t
        fill += layer.params * scale * F32
        if fill >= BUCKET_BYTES:
            free = max(free, clock) + link.all_reduce(fill, group)
            fill = 0.0
    if fill:
        free = max(free, backward_s) + link.all_reduce(fill, group)
    return max(0.0, free - backward_s)


# ---------------------------------------------------------------------------- token mixing
@dataclass(frozen=True)
class Traffic:
    """One token-mixing call on the busiest rank, one forward + backward pass: the bytes it
    sends, its message steps (each costs the link's latency once), the bytes it holds beyond
    its block, and whether those stay until backward (else only while the call runs)."""

    nbytes: float
    messages: int
    held: float
    saved: bool


def mixing_pattern(m: Mixing, s: int) -> str:
    """The collective ``m`` uses on ``s`` spatial ranks, as the library's rule picks it:
    "heads" (the head all-to-all) where the heads divide among the ranks and nothing masks,
    "ring" for other self-attention, else the record's kind ("gather", "reduce", "fetch",
    "axis", "move")."""
    if m.kind != "attention":
        return m.kind
    return "heads" if not m.masked and m.heads >= s and m.heads % s == 0 else "ring"


def mixing_traffic(m: Mixing, opt: Option, images: float) -> Traffic:
    """What token-mixing call ``m`` moves and holds on one rank of ``opt`` for ``images``
    samples (see the module docstring; nothing without a spatial split)."""
    s = opt.spatial
    if s == 1:
        return Traffic(0.0, 0, 0.0, True)
    share = block_share(m.tokens, opt.parts(len(m.tokens)))  # of the queries' tokens
    whole = [images * n * F32 for n in m.numel]
    pattern = mixing_pattern(m, s)
    if pattern == "heads":  # q, k, v, out: each all-to-all'ed forward, its gradient backward
        sent = 2 * (s - 1) / s * sum(b * share for b in whole)
        return Traffic(sent, 8 * (s - 1), sum(whole) / s, True)
    if pattern == "ring":
        kv = (whole[1] + whole[2]) * share
        return Traffic(kv * (3 * s - 2), 2 * s - 1, 2 * kv, False)
    if pattern == "move":
        return _moved(m, opt, whole[0])
    if pattern == "axis":  # each rank's partial map reduce-scattered, all-gathered backward
        parts = opt.parts(len(m.tokens))
        d = m.along[0]
        if parts[d] == 1:
            return Traffic(0.0, 0, 0.0, False)
        others = block_share(m.tokens[:d] + m.tokens[d + 1 :], parts[:d] + parts[d + 1 :])
        partial = whole[0] * others
        return Traffic(2 * (parts[d] - 1) / parts[d] * partial, 2 * (parts[d] - 1), partial, False)
    if pattern == "fetch":  # a block's rows in, forward; their gradient back
        split = sum(opt.parts(len(m.tokens))[d] > 1 for d in m.along)
        fetched = share * whole[0] if split else 0.0
        return Traffic(2 * fetched, 2 * split, fetched, True)
    if pattern == "gather":  # each tensor: all-gather forward, reduce-scatter backward
        return Traffic(2 * (s - 1) / s * sum(whole), 2 * (s - 1) * len(whole), sum(whole), True)
    return Traffic(2 * (s - 1) / s * whole[0], 2 * (s - 1), whole[0], True)  # all-reduce


def _moved(m: Mixing, opt: Option, nbytes: float) -> Traffic:
    """A reshape into groups (see :class:`Mixing`): along each split dimension of the map
    that it cuts, the rows the busiest rank sends to reach whole groups of the groups'
    tensor_split, of a tensor of ``nbytes``; once forward, once backward (the gradient)."""
    parts = opt.parts(len(m.tokens))
    sent, messages = 0.0, 0
    for d, (n, p, g) in enumerate(zip(m.tokens, parts, m.groups, strict=True)):
        have, want = blocks(n, p), [(a * g, b * g) for a, b in blocks(n // g, p)]
        rows = max(h1 - h0 - max(0, min(h1, w1) - max(h0, w0))
                   for (h0, h1), (w0, w1) in zip(have, want, strict=True))  # fmt: skip
        if rows:
            share = block_share(m.tokens[:d] + m.tokens[d + 1 :], parts[:d] + parts[d + 1 :])
            sent += 2 * rows / n * share * nbytes
            messages += 2
    return Traffic(sent, messages, sent / 2, False)


def mixing_seconds(net: Net, opt: Option, batch: int, link: Network) -> float:
    """The token-mixing collectives of one step: ``latency`` per message step and
    ``bytes / bandwidth``, as every other message of this model."""
    b = batch / opt.data
    per_pass = 0.0
    for m in net.mixing:
        t = mixing_traffic(m, opt, b)
        per_pass += t.messages * link.latency_s + t.nbytes / link.bandwidth_Bps
    return net.passes * per_pass


def mixing_bytes(net: Net, opt: Option, batch: int) -> float:
    """What the token collectives hold on one rank at the peak: the gathered keys and values
    and the heads' tensors, kept for backward, and the largest ring's blocks in flight."""
    held = [mixing_traffic(m, opt, batch / opt.data) for m in net.mixing]
    saved = sum(t.held for t in held if t.saved)
    return min(net.passes, 2) * saved + max((t.held for t in held if not t.saved), default=0.0)


# ---------------------------------------------------------------------------- memory
def sample_bytes(net: Net, opt: Option, batch: int, blocks_in: bool = False) -> float:
    """The samples one rank holds: its images' input (fp32) and labels (int64: one per pixel
    for a per-pixel network, else one per sample).

    Without ``blocks_in`` every rank of a spatial group holds each whole sample (``pk
    .parallelize``'s default ``spatial_input="whole"``: the region cuts its block from it);
    with ``blocks_in``, only its block of each (``spatial_input="blocks"``, a block reader's
    output), labels alike.
    """
    if not net.input_shape:
        return 0.0
    b, size = batch / opt.data, net.input_shape[1:]
    share = block_share(size, opt.parts(len(size))) if blocks_in and size else 1.0
    labels = math.prod(size) if net.per_pixel else 1
    return b * (math.prod(net.input_shape) * F32 + labels * I64) * share


def activation_bytes(net: Net, opt: Option, batch: int) -> float:
    """What autograd keeps for backward on one rank: every leaf's output (its block under
    spatial parallelism), plus the fetched input block each spatial convolution saves."""
    b, total = batch / opt.data, 0.0
    for layer in net.layers:
        share = spatial_share(layer, opt)
        if not layer.inplace:
            total += b * layer.out_numel * F32 * share
        if opt.spatial > 1 and layer.spatial and layer.window and not _edge_path(layer, opt):
            parts = opt.parts(layer.dims)
            held = [halo_rows(layer, i, p)[1] for i, p in enumerate(parts)]
            total += b * layer.in_shape[0] * math.prod(held) * F32
    return total


def _edge_path(layer: Layer, opt: Option) -> bool:
    """A convolution that saves no fetched block (``parallelkit.spatial.edges.plan``):
    stride 1 and equal padding along every dimension, "same" padding ``p >= 1`` along every
    split one, whose blocks all hold at least ``p`` rows; a transposed convolution whose
    blocks all hold the rows their neighbours want (``transposed_plan``)."""
    parts = opt.parts(layer.dims) if layer.dims else ()
    if layer.kind not in ("conv", "convT") or not any(p > 1 for p in parts):
        return False
    if layer.kind == "convT":
        return all(
            p == 1 or transposed_halo(n, m, p, k, s, pad, d) is not None
            for (k, s, pad, _, d), p, n, m in zip(
                layer.window, parts, layer.in_shape[1:], layer.out_shape[1:], strict=True
            )
        )
    return all(
        s == 1 and lo == hi and (p == 1 or (lo >= 1 and d * (k - 1) == 2 * lo and n // p >= lo))
        for (k, s, lo, hi, d), p, n in zip(layer.window, parts, layer.in_shape[1:], strict=True)
    )


def memory(
    nets: Sequence[Net], opt: Option, batch: int, machine: Machine, blocks_in: bool = False
) -> dict[str, float]:
    """Peak memory per rank, MiB, by part (``blocks_in``: see :func:`sample_bytes`)."""
    params = sum(params_per_rank(net, opt) for net in nets)
    state = params * F32 * (3 + (1 if opt.data > 1 or opt.spatial > 1 else 0))
    samples = sum(sample_bytes(net, opt, batch, blocks_in) for net in nets)
    live = sum(min(net.passes, 2) * activation_bytes(net, opt, batch) for net in nets)
    largest = max(
        layer.out_numel * spatial_share(layer, opt) for net in nets for layer in net.layers
    )
    working = 2 * batch / opt.data * largest * F32
    return {
        "baseline": machine.baseline_mib,
        "parameters, gradients, optimizer": state / MIB,
        SAMPLES: samples / MIB,
        "activations": live / MIB,
        "backward working set": working / MIB,
        MIXING: sum(mixing_bytes(net, opt, batch) for net in nets) / MIB,
        "allocator and workspaces": machine.overhead_mib,
    }


# ---------------------------------------------------------------------------- one grid
def estimate(
    nets: Sequence[Net],
    profiles: Sequence[Profile],
    opt: Option,
    batch: int,
    link: Network,
    machine: Machine,
    blocks_in: bool = False,
) -> Estimate:
    """Step time and memory per rank of ``nets`` (one training step runs them all) on ``opt``;
    ``blocks_in``: each rank passes only its block of every sample (:func:`sample_bytes`).

    Grids that ``pk.parallelize`` takes but this batch does not fit, or whose memory per rank
    exceeds ``machine.device_mib``, are kept, with the reason in ``problems``; they rank last.
    """
    est = Estimate(opt)
    if batch % opt.data:
        est.problems.append(f"global batch {batch} does not split over {opt.data} data ranks")
    if problem := _grid_problem(nets, opt):
        est.problems.append(problem)
    slow = machine.slowdown(opt.ranks)
    link_slow = slow if link.shares_cores else 1.0
    for net, prof in zip(nets, profiles, strict=True):
        compute = compute_seconds(net, prof, opt, batch)
        backward = compute * 2 / 3 / net.passes * slow  # the last pass's backward
        est.compute_s += compute * slow
        est.exchange_s += exchange_seconds(net, opt, batch, link, blocks_in) * link_slow
        est.reductions_s += reduction_seconds(net, prof, opt, batch, link, backward) * link_slow
        est.tokens_s += mixing_seconds(net, opt, batch, link) * link_slow
    est.memory_mib = memory(nets, opt, batch, machine, blocks_in)
    if blocks_in:
        est.whole_in_mib = sum(memory(nets, opt, batch, machine).values())
    if machine.device_mib is not None and est.peak_mib > machine.device_mib:
        est.problems.append(
            f"does not fit: {est.peak_mib:.0f} MiB per rank, the device holds "
            f"{machine.device_mib:.0f} MiB"
        )
    return est


def sample_dims(nets: Sequence[Net]) -> int:
    """Spatial dimensions of the samples ``nets`` take: 3 for volumes, 2 for images (also when
    no network records its input), 1 for signals."""
    return max((len(net.input_shape) - 1 for net in nets if net.input_shape), default=2)


def _grid_problem(nets: Sequence[Net], opt: Option) -> str | None:
    """Why ``opt`` cannot split these samples, if it cannot: ``depth`` splits a volume's D,
    ``cols`` an image's or a volume's W (a signal's L goes by rows)."""
    dims = sample_dims(nets)
    if (opt.depth > 1 and dims < 3) or (opt.cols > 1 and dims < 2):
        return f"{opt.label} cannot split samples with {dims} spatial dimension(s)"
    return None


def calibrate(nets: Sequence[Net], batch: int, machine: Machine, peak_mib: float) -> Machine:
    """``machine`` with the overhead that makes the 1-rank prediction at ``batch`` equal
    ``peak_mib``, a 1-rank step's measured peak (never below zero)."""
    bare = replace(machine, overhead_mib=0.0)
    predicted = sum(memory(nets, Option(), batch, bare).values())
    over = max(0.0, peak_mib - predicted)
    return replace(machine, overhead_mib=over)


def rank(estimates: Sequence[Estimate]) -> list[Estimate]:
    """Feasible grids fastest first, then the infeasible ones."""
    return sorted(estimates, key=lambda e: (not e.feasible, e.step_s))
