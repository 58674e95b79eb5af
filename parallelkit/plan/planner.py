"""The plan: every grid for N ranks, costed and ranked, as a table and as JSON.

    nets = walk.build("resnet18", 224)
    profiles = [measure.measure(net, batch=2) for net in nets]     # or measure.from_flops
    p = plan(nets, profiles, batch=8, ranks=4, link=network.probe(), machine=Machine(cores=2))
    print(table(p)); p.recommended.option                            # Option(data=2, rows=2, ...)
    Plan.from_dict(json.loads(json.dumps(p.to_dict())))             # the same plan

The inputs are all injectable, so tests build a plan from made-up profiles and networks and no
test ever times anything; ``parallelkit plan`` (:mod:`parallelkit.plan.command`) measures them.

Volumes plan the same way: networks walked at ``(C, D, H, W)`` get grids with a ``depth``
dimension too (:func:`parallelkit.plan.grids.options`). ``blocks_in=True`` plans
``pk.parallelize(..., spatial_input="blocks")``: each rank holds only its block of every
input and label (the table's "input MiB" column), and beside each grid's memory the table
shows what it would need with whole samples in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from parallelkit.plan.cost import Estimate, estimate, rank, sample_dims
from parallelkit.plan.grids import Option, options
from parallelkit.plan.machine import Machine
from parallelkit.plan.measure import Profile
from parallelkit.plan.memory import SAMPLES
from parallelkit.plan.network import Network
from parallelkit.plan.walk import Net, Shape


@dataclass
class Plan:
    """Ranked estimates (fastest feasible first) and what they were computed from."""

    model: str
    image_size: int | Shape  # a side (square images), or every side: (H, W), (D, H, W)
    batch: int
    ranks: int
    link: Network
    machine: Machine
    compute: str  # where the compute profile came from
    estimates: list[Estimate] = field(default_factory=list)
    blocks_in: bool = False  # each rank holds only its block of every sample

    @property
    def size_text(self) -> str:
        """The sample's size as ``224x224`` or ``64x64x64``."""
        size = self.image_size
        return "x".join(map(str, (size, size) if isinstance(size, int) else size))

    @property
    def recommended(self) -> Estimate:
        """The fastest grid that the batch fits (the first of the ranking)."""
        return self.estimates[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "image_size": size if isinstance(size := self.image_size, int) else list(size),
            "batch": self.batch,
            "ranks": self.ranks,
            "network": self.link.as_dict(),
            "machine": asdict(self.machine),
            "compute": self.compute,
            "blocks_in": self.blocks_in,
            "recommended": _estimate_dict(self.recommended, self.batch),
            "ranking": [_estimate_dict(e, self.batch) for e in self.estimates],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        ests = [
            Estimate(
                Option(**e["grid"]),
                e["compute_s"],
                e["exchange_s"],
                e["reductions_s"],
                dict(e["memory_mib"]),
                list(e["problems"]),
                e.get("whole_in_mib"),
                e.get("tokens_s", 0.0),
            )
            for e in d["ranking"]
        ]
        size = d["image_size"]
        return cls(
            d["model"],
            size if isinstance(size, int) else tuple(size),
            d["batch"],
            d["ranks"],
            Network(**d["network"]),
            Machine(**d["machine"]),
            d["compute"],
            ests,
            d.get("blocks_in", False),
        )


def _estimate_dict(e: Estimate, batch: int) -> dict[str, Any]:
    return {
        "strategy": e.option.strategy,
        "grid": asdict(e.option),
        "label": e.option.label,
        "step_s": e.step_s,
        "compute_s": e.compute_s,
        "exchange_s": e.exchange_s,
        "reductions_s": e.reductions_s,
        "tokens_s": e.tokens_s,
        "images_per_s": batch / e.step_s if e.step_s > 0 else None,
        "memory_mib": e.memory_mib,
        "peak_mib": e.peak_mib,
        "whole_in_mib": e.whole_in_mib,
        "feasible": e.feasible,
        "problems": e.problems,
    }


def plan(
    nets: Sequence[Net],
    profiles: Sequence[Profile],
    batch: int,
    ranks: int,
    link: Network,
    machine: Machine,
    model: str = "model",
    image_size: int | Shape = 0,
    grids: Sequence[Option] | None = None,
    blocks_in: bool = False,
) -> Plan:
    """Cost every grid of ``ranks`` ranks (or ``grids``: by default those for the networks'
    spatial dimensions) and rank them; ``blocks_in``: every rank passes only its blocks."""
    if batch < 1 or ranks < 1:
        raise ValueError(f"plan: batch and ranks must be positive, got {batch} and {ranks}")
    grids = options(ranks, sample_dims(nets)) if grids is None else grids
    ests = rank([estimate(nets, profiles, g, batch, link, machine, blocks_in) for g in grids])
    sources = ", ".join(sorted({p.source for p in profiles}))
    return Plan(model, image_size, batch, ranks, link, machine, sources, ests, blocks_in)


# ---------------------------------------------------------------------------- the table
def table(p: Plan) -> str:
    """The ranking as aligned text, and the recommendation under it."""
    link, m = p.link, p.machine
    cores = "each rank on its own device" if m.cores is None else f"{m.cores:g} cores shared"
    if m.device_mib is not None:
        cores += f" of {m.device_mib:.0f} MiB"
    head = [
        f"parallelkit plan: {p.model} {p.size_text}, global batch {p.batch}, {p.ranks} ranks",
        f"network: {link.name}: {link.latency_s * 1e6:.1f} us latency, "
        f"{link.bandwidth_Bps / 1e9:.3g} GB/s; compute: {p.compute}; {cores}; "
        f"process baseline {m.baseline_mib:.0f} MiB",
        "samples in: blocks (spatial_input='blocks'): a rank holds only its block of each input "
        "and label; 'whole in' is the same grid's MiB/rank with whole samples"
        if p.blocks_in
        else "samples in: whole on every rank of a spatial group (--blocks-in: only its block)",
        "",
    ]
    # token mixing: a column where the networks have any (attention, contractions over tokens)
    tokens = any(e.tokens_s for e in p.estimates)
    cols = [
        "#",
        "strategy",
        "grid",
        "step s",
        "compute",
        "exchange",
        "reductions",
        *(["tokens"] if tokens else []),
        "images/s",
        "MiB/rank",
        *(["whole in"] if p.blocks_in else []),
        "input MiB",
        "note",
    ]
    rows = []
    for i, e in enumerate(p.estimates, 1):
        rows.append(
            [
                str(i),
                e.option.strategy,
                e.option.label,
                f"{e.step_s:.3f}",
                f"{e.compute_s:.3f}",
                f"{e.exchange_s:.3f}",
                f"{e.reductions_s:.3f}",
                *([f"{e.tokens_s:.3f}"] if tokens else []),
                f"{p.batch / e.step_s:.2f}" if e.step_s else "-",
                f"{e.peak_mib:.0f}",
                *([f"{e.whole_in_mib or 0:.0f}"] if p.blocks_in else []),
                _mib(e.memory_mib.get(SAMPLES, 0.0)),
                "; ".join(e.problems),
            ]
        )
    widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(cols)]
    fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    best = p.recommended
    whole = f" ({best.whole_in_mib:.0f} with whole samples in)" if p.blocks_in else ""
    tail = [
        "",
        f"recommended: {best.option.strategy} ({best.option.label}): {best.step_s:.3f} s per "
        f"step, {p.batch / best.step_s:.2f} images/s, {best.peak_mib:.0f} MiB per rank{whole}"
        if best.feasible
        else "recommended: none (no grid fits; see the notes)",
    ]
    return "\n".join([*head, fmt(cols), *(fmt(r) for r in rows), *tail])


def _mib(x: float) -> str:
    """MiB for a column: whole MiB, or two figures below 10 (a small image's input)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"
