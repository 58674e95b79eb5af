"""The promise of ``pk.parallelize`` on real networks: for every (architecture, strategy) the
outcome is exact, or a refusal that says what to do; never silently wrong, never a crash.

Today's outcomes are in ``zoo_expected.EXPECTED`` (from ``survey.py --write-expected``). A case
that breaks the promise today is a strict xfail whose reason is the defect: the tier stays
green, documents every known defect, and turns red the moment a fix lands (XPASS), so the
table gets refreshed. A case that keeps the promise must keep today's outcome too (an exact
case that starts refusing is a regression).

Under ``fallback="gather"`` (``test_exact_under_gather``) every case that is refused today under a
spatial strategy must be exact: the refused operation's smallest enclosing module runs on
gathered whole images. Its outcomes are in ``zoo_expected.EXPECTED_GATHER``, marked as above. The
test is skipped while ``pk.parallelize`` takes no ``fallback`` keyword.

Each case also counts the modules run on gathered whole images (parallelkit's one warning per
gathered module, ``Outcome.gathers``): under the default nothing may gather, so a refuse case
with a gather fails whatever its label; under gather a case that was refused must have gathered
at least one module (``survey.md`` lists them, with the memory each costs).

The negative controls show that the classifier cannot pass vacuously: a model run on each
rank's block without halo exchange, and a gradient perturbed by 1e-6 on one rank, must both
come out "wrong"; and the merging of rank reports is checked without processes.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import parallelkit as pk
from parallelkit.spatial.fallback import gathered_message

from zoo_cases import ARCHS, EXPECTED, EXPECTED_GATHER, cases, gather_cases
from zoo_parity import gathered
from zoo_run import PROMISED, Outcome, classify, elide, names_a_remedy, run_case

REFRESH = "refresh the table: .venv-zoo/bin/python tests/zoo/survey.py --write-expected"
HAS_FALLBACK = "fallback" in inspect.signature(pk.parallelize).parameters


def _cases(which: list[tuple[str, str]], expected: dict, promised: tuple[str, ...]):
    for arch, strategy in which:
        label, reason = expected.get((arch, strategy), ("exact", ""))
        marks = []
        if label not in promised:
            what = {"wrong": "silently wrong", "crash": "crashes",
                    "refused (no remedy)": "refused without saying what to do",
                    "refused": "still refused"}[label]  # fmt: skip
            marks.append(pytest.mark.xfail(strict=True, reason=f"{what} today: {reason}"))
        yield pytest.param(arch, strategy, label, id=f"{arch}-{strategy}", marks=marks)


# ----------------------------------------------------------------------------- controls
@pytest.mark.timeout(300)
def test_control_no_halo_is_wrong(pools):
    """Each rank runs the dense model on its own rows (no halo, local BatchNorm)."""
    got = run_case(pools, "smp Unet resnet18", "rows", tamper="no-halo")
    assert got.kind == "wrong", got
    assert "output" in got.reason


@pytest.mark.timeout(300)
def test_control_perturbed_gradient_is_wrong(pools):
    """One gradient entry off by 1e-6 on rank 0 only, after DataParallel averaged it, in an
    otherwise exact run: caught there, at the first step, on rank 0."""
    got = run_case(pools, "tv resnet18", "data", tamper="perturb-grad")
    assert got.kind == "wrong", got
    assert got.reason.split("first: ")[1].startswith("step 0 conv1.weight grad"), got


@pytest.mark.timeout(300)
def test_control_no_halo_is_wrong_on_volumes(pools):
    """The same on a 3-D U-Net split over depth: each rank runs it on its own planes."""
    got = run_case(pools, "monai UNet", "depth", tamper="no-halo")
    assert got.kind == "wrong", got
    assert "output" in got.reason


def _report(outcome: str, **kw) -> dict:
    base = {"exact": {"checked": 3}, "wrong": {"checked": 3, "count": 1, "mismatches": ["x"]}}
    fail = {"message": "no; use fewer ranks", "phase": "parallelize", "origin": "f.py:1 in g"}
    return {"outcome": outcome, **base.get(outcome, fail), **kw}


def test_classify_merges_rank_reports():
    assert classify([_report("exact"), _report("exact")]).kind == "exact"
    assert classify([_report("exact"), _report("wrong")]).kind == "wrong"
    refused = classify([_report("refused"), _report("refused")])
    assert refused.kind == "refused" and refused.keeps_promise
    # A refusal on some ranks only, or a different one per rank, breaks "the same everywhere".
    assert classify([_report("refused"), _report("exact")]).kind == "crash"
    assert classify([_report("refused"), _report("refused", message="other")]).kind == "crash"
    crash = _report("crash", type="TypeError")
    assert classify([crash, _report("exact")]).kind == "crash"
    assert classify([crash, crash]).reason.startswith("TypeError")
    assert not Outcome("refused", "AdaptiveAvgPool2d(7) is not supported").keeps_promise
    assert Outcome("refused", "AdaptiveAvgPool2d(7) is not supported").label == (
        "refused (no remedy)"
    )
    # A long refusal keeps its end, where the remedy usually is.
    long = "parameters " + "['a.weight', " * 100 + "] got no gradient; pass find_unused=True"
    assert len(elide(long)) < 320 and names_a_remedy(elide(long))
    assert not Outcome("wrong", "x").keeps_promise and not Outcome("crash", "x").keeps_promise


def test_classify_counts_gathers_apart_from_the_label():
    one = [("stages.2.1", "MobileVitBlock", 0.5)]
    got = classify([_report("exact", gathered=one), _report("exact", gathered=one)])
    assert (got.label, got.gathers, got.gathered) == ("exact", 1, tuple(one))
    assert classify([_report("exact"), _report("exact")]).gathers == 0
    # A gather on one rank only still counts.
    assert classify([_report("refused"), _report("refused", gathered=one)]).gathers == 1
    assert Outcome("exact").gathers is None  # not counted: read back from EXPECTED


def test_gather_warning_is_parsed():
    """The warning parallelkit emits for a gathered module, read back as zoo_parity reads it:
    if its wording changes, the count would silently read 0 everywhere."""
    conv = nn.Conv2d(2, 3, 1).double()
    x = torch.zeros(2, 2, 16, 16, dtype=torch.float64)
    message = gathered_message("stages.0.attn", conv, (x,), conv(x))
    assert gathered(message) == ("stages.0.attn", "Conv2d", round(2 * 5 * 256 * 8 / 2**20, 1))
    assert gathered(gathered_message("", conv, (x,), conv(x)))[0] == "the model"
    assert gathered("some other warning") is None


# ----------------------------------------------------------------------------- the zoo
# One pool of ranks serves every case, whatever the order (zoo_run.Pools).
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "strategy", "expected"), list(_cases(cases(), EXPECTED, PROMISED))
)
def test_exact_or_refused(pools, arch, strategy, expected):
    got = run_case(pools, arch, strategy)
    assert got.gathers == 0, f"gathered unasked under the default: {got.gathered}"
    assert got.kind in PROMISED, f"{got.kind}: {got.reason}"
    if got.kind == "refused":
        assert names_a_remedy(got.reason), f"the refusal does not say what to do: {got.reason}"
    assert got.label == expected, (
        f"{arch} under {strategy} is now {got.label} ({got.reason}), expected {expected}; "
        + REFRESH
    )


@pytest.mark.skipif(
    not HAS_FALLBACK,
    reason="pk.parallelize has no fallback= keyword yet (inspect.signature); the gather cases "
    "run once it does",
)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "strategy", "expected"), list(_cases(gather_cases(), EXPECTED_GATHER, ("exact",)))
)
def test_exact_under_gather(pools, arch, strategy, expected):
    """Refused under ``fallback="refuse"``, so exact under ``fallback="gather"``."""
    got = run_case(pools, arch, strategy, fallback="gather")
    assert got.kind == "exact", f"{got.label}: {got.reason}"
    assert got.gathers, "exact under gather, refused under refuse, yet nothing gathered"


def test_every_case_has_an_expected_outcome():
    assert set(EXPECTED) == set(cases()), REFRESH
    if HAS_FALLBACK:
        assert set(EXPECTED_GATHER) == set(gather_cases()), REFRESH
    assert len(ARCHS) >= 47
    assert {a.source for a in ARCHS.values()} == {"torchvision", "timm", "smp", "monai"}
    assert sum(a.volume for a in ARCHS.values()) >= 12  # at least 12 3-D networks
