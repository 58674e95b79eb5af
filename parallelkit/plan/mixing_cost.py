"""Token mixing's cost: what each call that mixes a split sample's tokens (the walk's
:class:`~parallelkit.plan.walk.Mixing` records) sends, in how many message steps, and holds,
as ``parallelkit/spatial/rules/tokens.py`` runs it on ``s`` spatial ranks (the token table
in :mod:`parallelkit.plan.cost`): the head all-to-all, the ring, all-gathers, all-reduces,
the reduce-scatter along one dimension, row fetches, and the moves to whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelkit.geometry import blocks
from parallelkit.plan.grids import Option
from parallelkit.plan.network import Network
from parallelkit.plan.shares import F32, block_share
from parallelkit.plan.walk import Mixing, Net


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
