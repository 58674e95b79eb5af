"""Step time, besides token mixing: a rank's compute, the activations it exchanges (halos,
region ends, channel collectives), and the reductions (BatchNorm statistics, DataParallel's
bucketed all-reduce, the part of it backward does not hide).

Each term follows what ``pk.parallelize`` runs per strategy (the table in
:mod:`parallelkit.plan.cost`); a message costs ``latency + bytes / bandwidth`` of the link.
"""

from __future__ import annotations

from parallelkit.plan.grids import Option
from parallelkit.plan.measure import Profile
from parallelkit.plan.network import Network
from parallelkit.plan.shares import F32, MIB, halo_bytes, spatial_share
from parallelkit.plan.walk import Layer, Net

BUCKET_BYTES = 25 * MIB  # DataParallel's default bucket_cap_mb


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
