"""Rank side of the zoo tier: one architecture under one strategy, against the dense model.

Like ``tests/network_cases.network_parity``, but for networks nobody here wrote, and it
reports instead of asserting, so that a survey can classify every case:

    every rank builds the same dense model (float64, seed 0, random weights); a deep copy goes
    through ``pk.parallelize``; both train 2 SGD steps with momentum. The parallel model gets the
    whole batch on every rank of a model-parallel group (its data group's slice with a data
    dimension, the loss scaled by data/batch as DataParallel averages). Compared each step:
    every output leaf (any nesting of tuples, lists, dicts), the input gradient, every
    parameter gradient that is whole on this rank, and after the step ``pk.to_dense(model)``'s
    whole state_dict (parameters and BatchNorm statistics).

The report of a rank (a small dict, cheap to pickle back) is one of

    {"outcome": "exact",   "checked": n}
    {"outcome": "wrong",   "checked": n, "mismatches": [first labels], "count": k}
    {"outcome": "refused", "message": str, "phase": where, "origin": file:line}
    {"outcome": "crash",   "type": name, "message": str, "phase": where, "origin": file:line}

each with "gathered": [(module path, module type, MiB per rank), ...], the modules this rank
ran on gathered whole images, from parallelkit's one warning per gathered module
(``parallelkit.spatial.fallback.gathered_message``), in the order they warned. Under
``fallback="refuse"`` the list must be empty: nothing may gather unasked.

A ValueError counts as a refusal only when parallelkit raised it; one from torch, timm or smp
is a crash. ``zoo_run.classify`` merges the ranks' reports.

``fallback`` is ``pk.parallelize``'s: "refuse" (the default, passed as no keyword at all) or
"gather" (a refused operation's smallest enclosing module runs on gathered whole images).
``tamper`` breaks the comparison on purpose (negative controls, see ``test_zoo.py``).

The pool may be larger than the strategy needs (``zoo_run.Pools`` keeps one pool of 4 ranks
for every case): the first ``size`` ranks run the case on a sub-communicator, split once per
pool and kept, and the others report ``{"outcome": "idle"}``.
"""

from __future__ import annotations

import copy
import math
import re
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.spatial.grid import gather, scatter

from zoo_cases import ARCHS, BATCH, STRATEGIES

STEPS = 2
RTOL = 1e-7
"""Norm-wise: max |got - expected| <= RTOL * max |expected| + ATOL, per tensor. Elementwise
tolerances (network_parity's) flag entries near zero that deep float64 networks reach by
cancelling large terms (1e-7 off on a tensor whose largest entry is 1e4: 1e-11 of its scale);
a real defect (a missing halo, an unsummed gradient) is off by a good fraction of the scale,
and the negative controls show a 1e-6 error is caught."""
ATOL = 1e-9
"""For tensors whose true value is zero: the gradient of a convolution bias that feeds a
BatchNorm is 0 exactly, computed as rounding noise of ~1e-12 on both sides (VGG-11-BN)."""
FIRST = 6  # mismatch labels kept in a report
TAMPERS = (None, "no-halo", "perturb-grad")
FALLBACKS = ("refuse", "gather")
PACKAGE = Path(pk.__file__).resolve().parent
GATHERED = re.compile(
    r"^spatial parallelism \(fallback='gather'\): '(?P<path>[^']*)' \((?P<type>\w+)\) runs on "
    r"the whole images, gathered on every rank: (?P<mib>[0-9.]+) MiB per rank"
)
"""parallelkit's warning for a gathered module (``spatial.fallback.gathered_message``); a
model gathered whole is named 'the model'. test_zoo.py checks the two still agree."""
Gathered = tuple[str, str, float]  # (module path, module type, MiB per rank it states)


def _rows(t: torch.Tensor, rows: Any) -> torch.Tensor:
    """This rank's samples of an output; a scalar (a loss the network returns, as
    SegResNetVAE's) is whole on every rank of a spatial grid."""
    return t[rows] if t.dim() else t


def zoo_parity(
    comm: Communicator,
    arch: str,
    strategy: str,
    tamper: str | None = None,
    fallback: str = "refuse",
) -> dict[str, Any]:
    """This rank's report on ``arch`` under ``strategy`` (a key of ``STRATEGIES``)."""
    if tamper not in TAMPERS:
        raise ValueError(f"zoo_parity: tamper must be one of {TAMPERS}, got {tamper!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"zoo_parity: fallback must be one of {FALLBACKS}, got {fallback!r}")
    comm = _first_ranks(comm, STRATEGIES[strategy][0])
    if comm is None:
        return {"outcome": "idle"}
    state = {"phase": "build", "checked": 0, "bad": []}
    # "always": Python's registry would otherwise hide a warning this worker showed before.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = _report(comm, arch, strategy, tamper, fallback, state)
    report["gathered"] = [g for w in seen if (g := gathered(str(w.message))) is not None]
    return report


def gathered(message: str) -> Gathered | None:
    """(path, type, MiB per rank) of parallelkit's warning for a gathered module, else None."""
    m = GATHERED.match(message)
    return None if m is None else (m["path"], m["type"], float(m["mib"]))


def _report(
    comm: Communicator,
    arch: str,
    strategy: str,
    tamper: str | None,
    fallback: str,
    state: dict,
) -> dict[str, Any]:
    try:
        _run(comm, arch, strategy, tamper, fallback, state)
    except ValueError as e:
        ours, origin = _origin(e)
        return _failure("refused" if ours else "crash", e, state, origin)
    except Exception as e:
        return _failure("crash", e, state, _origin(e)[1])
    if state["bad"]:
        return {"outcome": "wrong", "checked": state["checked"],
                "mismatches": state["bad"][:FIRST], "count": len(state["bad"])}  # fmt: skip
    return {"outcome": "exact", "checked": state["checked"]}


_SUBCOMMS: dict[tuple[int, int], Communicator | None] = {}
"""(id of the pool's communicator, size) -> this rank's communicator of the first ``size`` ranks
(None on the others). Split once per worker: ``split`` is a collective and makes new groups."""


def _first_ranks(comm: Communicator, size: int) -> Communicator | None:
    if comm.size == size:
        return comm
    if comm.size < size:
        raise AssertionError(f"the case needs {size} ranks, the pool has {comm.size}")
    key = (id(comm), size)
    if key not in _SUBCOMMS:
        inside = comm.rank < size
        sub = comm.split(0 if inside else 1, comm.rank)
        _SUBCOMMS[key] = sub if inside else None
    return _SUBCOMMS[key]


def _run(
    comm: Communicator,
    arch: str,
    strategy: str,
    tamper: str | None,
    fallback: str,
    state: dict,
) -> None:
    case = ARCHS[arch]
    _, dims = STRATEGIES[strategy]
    torch.manual_seed(0)
    dense = case.build().to(torch.float64).train()

    state["phase"] = "parallelize"
    grid = pk.Grid(comm, **dims)
    model = copy.deepcopy(dense)
    if tamper == "no-halo":
        model = _NoHalo(model, grid.spatial_comm, grid.spatial)
    else:
        # The keyword only when it asks for something: "refuse" is the default, and a
        # parallelize without the keyword still runs every refuse case.
        extra = {} if fallback == "refuse" else {"fallback": fallback}
        model = pk.parallelize(model, grid, grid, **extra)
    rows = torch.arange(BATCH).tensor_split(grid.data)[grid.coords[0]]
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for step in range(min(STEPS, case.steps)):
        at = f"step {step}"
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(BATCH, *case.shape, generator=gen, dtype=torch.float64)

        state["phase"] = f"{at} dense"
        x_dense = x.clone().requires_grad_()
        opt_dense.zero_grad()
        torch.manual_seed(1000 + step)  # draws in the forward (a VAE's noise) alike in both
        out = dense(x_dense)
        leaves = _leaves(out, "output")
        targets = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in leaves.items()}
        (_loss(leaves, targets) / BATCH).backward()

        state["phase"] = f"{at} forward"
        x_mine = x[rows].clone().requires_grad_()
        opt.zero_grad()
        torch.manual_seed(1000 + step)
        out_mine = model(x_mine)
        mine = _leaves(out_mine, "output")
        shapes_ok = _same_shapes(comm, mine, {k: _rows(v, rows) for k, v in leaves.items()}, state,
                                 at)  # fmt: skip
        if not shapes_ok:
            return  # every rank stops here: backward on wrong shapes would only crash
        _compare(state, [(f"{at} {k}", mine[k], _rows(leaves[k].detach(), rows)) for k in leaves])

        state["phase"] = f"{at} backward"
        # DataParallel averages over the data group: scale so the mean is the batch's gradient.
        loss_mine = _loss(mine, {k: _rows(v, rows) for k, v in targets.items()}) * grid.data / BATCH
        loss_mine.backward()
        if tamper == "perturb-grad" and comm.rank == 0:
            p = next(p for p in model.parameters() if p.grad is not None)
            p.grad[(0,) * p.grad.dim()] += 1e-6 * (1 + p.grad.abs().max())
        _compare(state, [(f"{at} input grad", x_mine.grad, x_dense.grad[rows] * grid.data)])
        _compare(state, _grads(at, model, dense))

        state["phase"] = f"{at} optimizer step and to_dense"
        opt_dense.step()
        opt.step()
        now = pk.to_dense(model).state_dict()
        expected = dense.state_dict()
        for key in expected.keys() - now.keys():
            state["bad"].append(f"{at} {key} missing from to_dense")
        # Compared at once, before anything steps again: no copies needed.
        _compare(state, [(f"{at} {k}", now[k], v) for k, v in expected.items() if k in now])


# ----------------------------------------------------------------------------- outputs
def _leaves(out: Any, label: str) -> dict[str, torch.Tensor]:
    """Tensor leaves of any nesting of tuples, lists (namedtuples too) and dicts, by path."""
    if isinstance(out, torch.Tensor):
        return {label: out}
    if isinstance(out, dict):
        items = out.items()
    elif isinstance(out, tuple) and hasattr(out, "_fields"):
        items = zip(out._fields, out, strict=True)
    elif isinstance(out, list | tuple):
        items = enumerate(out)
    elif out is None:
        return {}
    else:
        raise TypeError(f"{label}: output of type {type(out).__name__} is not a tensor nesting")
    leaves: dict[str, torch.Tensor] = {}
    for k, v in items:
        leaves.update(_leaves(v, f"{label}[{k}]"))
    return leaves


def _loss(leaves: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample squared error summed over the batch, each leaf weighted by 1 / its size per
    sample: separable over samples, so slices of the batch add up to the whole."""
    total = torch.zeros((), dtype=torch.float64)
    for k, v in leaves.items():
        per_sample = max(1, v[0].numel()) if v.dim() else 1
        total = total + (v - targets[k]).square().sum() / per_sample
    return total


def _same_shapes(comm, mine: dict, expected: dict, state: dict, at: str) -> bool:
    """Output leaves and shapes as the dense model's, agreed on by every rank (a rank that
    stopped alone would leave the others waiting in backward's collectives)."""
    bad = [f"{at} {k} missing" for k in expected.keys() - mine.keys()]
    bad += [f"{at} {k} extra" for k in mine.keys() - expected.keys()]
    bad += [
        f"{at} {k} shape {tuple(mine[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in mine and mine[k].shape != v.shape
    ]
    state["bad"] += bad
    state["checked"] += len(expected)
    flag = comm.all_reduce(torch.tensor([float(bool(bad))], dtype=torch.float64), "max")
    if flag.item() and not bad:
        state["bad"].append(f"{at} output shapes wrong on another rank")
    return not flag.item()


# ----------------------------------------------------------------------------- comparison
def _compare(state: dict, triples: list[tuple[str, Any, torch.Tensor]]) -> None:
    for label, got, expected in triples:
        state["checked"] += 1
        if got is None:
            state["bad"].append(f"{label}: no gradient")
        elif (why := _differs(got.detach(), expected.detach())) is not None:
            state["bad"].append(f"{label}: {why}")


def _differs(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Why ``got`` is not ``expected`` within the norm-wise tolerance, or None."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{got.dtype} {tuple(got.shape)} != {expected.dtype} {tuple(expected.shape)}"
    if not expected.is_floating_point():
        return None if torch.equal(got, expected) else f"{got.tolist()} != {expected.tolist()}"
    if got.numel() == 0:
        return None
    # Fast path, two passes and no masks (the comparisons were half of a case's time): where
    # both maxima are finite, every entry of both tensors is, and the test below is the same.
    diff = torch.linalg.vector_norm(got - expected, float("inf")).item()
    scale = torch.linalg.vector_norm(expected, float("inf")).item()
    if math.isfinite(diff) and math.isfinite(scale) and diff <= RTOL * scale + ATOL:
        return None
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(got), finite):
        return "non-finite entries differ"
    diff = (got - expected)[finite].abs().max().item() if finite.any() else 0.0
    scale = expected[finite].abs().max().item() if finite.any() else 0.0
    if diff <= RTOL * scale + ATOL:
        return None
    share = diff / scale if scale else float("inf")
    return f"max |diff| {diff:.3g} = {share:.2g} of max |expected|"


def _grads(at: str, model: nn.Module, dense: nn.Module) -> list:
    """(label, parallel grad, dense grad) of every parameter this rank holds whole, matched by
    dense name; wrappers (DataParallel, SpatialRegion) add "module" to the path."""
    wanted = dict(dense.named_parameters())
    out = []
    for name, p in model.named_parameters():
        key = name
        while key not in wanted and key.startswith("module."):
            key = key[len("module.") :]
        q = wanted.get(key)
        if q is not None and p.shape == q.shape and q.grad is not None:
            out.append((f"{at} {key} grad", p.grad, q.grad))
    return out


# ----------------------------------------------------------------------------- failures
def _origin(e: BaseException) -> tuple[bool, str]:
    """(raised inside parallelkit, "file:line in function") of the frame that raised; the
    file relative to its package root."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False, "?"
    f = frames[-1]
    path = Path(f.filename).resolve()
    ours = PACKAGE in path.parents
    if ours:
        shown = str(path.relative_to(PACKAGE.parent))
    elif "site-packages" in path.parts:
        shown = "/".join(path.parts[path.parts.index("site-packages") + 1 :])
    else:
        shown = path.name
    return ours, f"{shown}:{f.lineno} in {f.name}"


def _failure(kind: str, e: BaseException, state: dict, origin: str) -> dict[str, Any]:
    message = str(e)  # its end often says what to do: cut in the middle, if at all
    if len(message) > 2000:
        message = message[:600] + " ... " + message[-1200:]
    report = {"outcome": kind, "message": message, "phase": state["phase"], "origin": origin}
    if kind == "crash":
        report["type"] = type(e).__name__
    return report


# ----------------------------------------------------------------------------- controls
class _NoHalo(nn.Module):
    """Negative control: each rank runs the dense model on its own block of the image, with
    no halo exchange and local BatchNorm statistics, and the blocks are gathered again. Its
    numbers must come out "wrong"; if they did not, the comparison would be vacuous."""

    def __init__(self, module: nn.Module, comm: Communicator, grid: tuple[int, int]) -> None:
        super().__init__()
        self.module, self.comm, self.grid = module, comm, grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather(self.module(scatter(x, self.comm, self.grid)), self.comm, self.grid)

    def to_dense(self) -> nn.Module:
        return self.module


# ----------------------------------------------------------------------------- memory


def largest_saved(comm: Communicator, arch: str, strategy: str) -> dict[str, Any]:
    """The largest tensor (elements) that one forward saves for backward on this rank, of the
    dense model on the whole batch and of ``pk.parallelize``'s under ``strategy``, and the
    modules it gathered: what a block of split samples costs against a whole sample.
    Parameters (saved by linear maps) are left out: they are whole on every rank anyway."""
    comm = _first_ranks(comm, STRATEGIES[strategy][0])
    if comm is None:
        return {"outcome": "idle"}
    torch.manual_seed(0)
    dense = ARCHS[arch].build().to(torch.float64).train()
    grid = pk.Grid(comm, **STRATEGIES[strategy][1])
    model = pk.parallelize(copy.deepcopy(dense), grid, grid)
    x = torch.randn(BATCH, *ARCHS[arch].shape, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)  # fmt: skip
    report: dict[str, Any] = {"outcome": "measured"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for name, net in (("dense", dense), ("split", model)):
            params = {p.data_ptr() for p in net.parameters()}
            largest = [0]

            def pack(t: torch.Tensor, params: set = params, largest: list = largest) -> Any:
                if t.data_ptr() not in params:
                    largest[0] = max(largest[0], t.numel())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = net(x.clone().requires_grad_())
            sum(v.sum() for v in _leaves(out, "output").values()).backward()
            report[name] = largest[0]
    report["gathered"] = [g for w in seen if (g := gathered(str(w.message))) is not None]
    return report
