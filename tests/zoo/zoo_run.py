"""Parent side of the zoo tier: run one case on a pool of ranks and merge the ranks' reports
into one outcome. Shared by ``survey.py`` and ``test_zoo.py``, so the table and the tests
classify alike.

    exact    every rank matched the dense model everywhere
    refused  every rank raised the same ValueError from parallelkit
    wrong    it ran, and some rank's numbers (or output shapes) differ from the dense ones
    crash    anything else: another exception, ranks that disagree, a rank that died or hung

The promise of ``pk.parallelize`` holds for a case when it is exact, or refused with a
message that says what to do (:func:`names_a_remedy`).

Apart from the kind, an outcome carries what the case gathered: the modules that ran on
gathered whole images (``zoo_parity``'s "gathered", one warning each) and their count. They
do not enter the label: EXPECTED records kinds, and the count is checked on its own (0 under
``fallback="refuse"``, at least 1 for a case that gather turned from refused into exact).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from parallelkit.testing import RankError, Ranks

from zoo_cases import STRATEGIES
from zoo_parity import Gathered, zoo_parity

CASE_TIMEOUT_S = 180.0
"""Deadline of one case on the pool; a case past it is a crash (hang), never a wait."""
COMM_TIMEOUT_S = 30.0
"""Collective timeout inside the ranks: a rank left alone in a collective (its peer raised
or returned) fails after this, well within the case's deadline."""

_REMEDY = re.compile(
    r"\b(use|pass|choose|set|keep_dense|fewer|larger|smaller|instead|replace|remove|pad|"
    r"wrap|convert|split the)\b",
    re.IGNORECASE,
)


PROMISED = ("exact", "refused")
"""The labels that keep the promise; "refused (no remedy)", "wrong" and "crash" break it."""


@dataclass(frozen=True)
class Outcome:
    kind: str  # "exact" | "refused" | "wrong" | "crash"
    reason: str = ""
    gathers: int | None = None
    """Modules run on gathered whole images (warnings of one rank, the most any rank saw);
    None where not counted: an outcome read back from EXPECTED, or ranks that did not report."""
    gathered: tuple[Gathered, ...] = ()
    """Those modules: (path, type, MiB per rank stated by the warning), in the order run."""

    @property
    def label(self) -> str:
        """The kind, with a refusal that does not say what to do told apart: what the table
        and EXPECTED record (reasons there may be shortened, the label is judged whole)."""
        if self.kind == "refused" and not names_a_remedy(self.reason):
            return "refused (no remedy)"
        return self.kind

    @property
    def keeps_promise(self) -> bool:
        return self.label in PROMISED


def names_a_remedy(message: str) -> bool:
    """Does a refusal say what to do (use / pass / choose / keep_dense / fewer ranks ...)?"""
    return bool(_REMEDY.search(message))


def classify(reports: list[dict]) -> Outcome:
    """One outcome from every rank's report (``zoo_parity``'s dicts, in rank order), with the
    gathers of the rank that saw the most (every rank gathers the same modules)."""
    outcome = _kind(reports)
    most = max((tuple(map(tuple, r.get("gathered", ()))) for r in reports), key=len, default=())
    return replace(outcome, gathers=len(most), gathered=most)


def _kind(reports: list[dict]) -> Outcome:
    kinds = {r["outcome"] for r in reports}
    if kinds == {"exact"}:
        return Outcome("exact")
    if kinds == {"refused"}:
        messages = {r["message"] for r in reports}
        if len(messages) == 1:
            r = reports[0]
            return Outcome("refused", f"{elide(r['message'])} [{r['phase']}; {r['origin']}]")
        return Outcome("crash", "ranks refused with different messages: " + " | ".join(
            f"rank {i}: {r['message']}" for i, r in enumerate(reports)))  # fmt: skip
    if kinds <= {"exact", "wrong"}:
        bad = next(r for r in reports if r["outcome"] == "wrong")
        ranks = [i for i, r in enumerate(reports) if r["outcome"] == "wrong"]
        return Outcome(
            "wrong",
            f"{bad['count']} of {bad['checked']} comparisons differ on rank(s) {ranks}; first: "
            + "; ".join(bad["mismatches"]),
        )
    crash = next((r for r in reports if r["outcome"] == "crash"), None)
    if crash is not None and all(r["outcome"] == "crash" for r in reports):
        return Outcome("crash", _crash_text(crash))
    parts = []
    for i, r in enumerate(reports):
        text = _crash_text(r) if r["outcome"] == "crash" else r.get("message", "")
        parts.append(f"rank {i} {r['outcome']}" + (f": {text}" if text else ""))
    return Outcome("crash", "ranks disagree: " + " | ".join(parts))


def elide(text: str, most: int = 300) -> str:
    """``text`` cut in the middle to at most about ``most`` characters: a refusal names the
    culprits first and says what to do last (DataParallel's list of unused parameters)."""
    if len(text) <= most:
        return text
    return text[: most // 3] + " ... " + text[-(most - most // 3) :]


def _crash_text(r: dict) -> str:
    message = r["message"].splitlines()[0] if r["message"] else ""
    return f"{r['type']}: {message[:200]} [{r['phase']}; {r['origin']}]"


def run_case(
    pools: Callable[[int], Ranks],
    arch: str,
    strategy: str,
    tamper: str | None = None,
    fallback: str = "refuse",
) -> Outcome:
    """``arch`` under ``strategy`` on the first ranks of a pool of at least the strategy's size
    (``pools(n)``), with ``pk.parallelize(..., fallback=fallback)``."""
    size, _ = STRATEGIES[strategy]
    pool = pools(size)
    try:
        reports = pool.run(zoo_parity, arch, strategy, tamper, fallback, timeout=CASE_TIMEOUT_S)
        reports = reports[:size]  # the ranks beyond the case's report "idle"
    except RankError as e:  # a rank died, hung or raised outside zoo_parity's net
        first = str(e).splitlines()
        return Outcome("crash", "ranks did not all report: " + " ".join(first[:3])[:300])
    outcome = classify(reports)
    if outcome.kind == "crash" and not healthy(pool):
        pool.close()  # the next case starts afresh
    return outcome


def healthy(pool: Ranks) -> bool:
    """After a crash: do the ranks still agree on a collective? Restarting a pool costs ~10 s
    per rank (torch, torchvision, timm, smp imports), so a pool is kept when it still works."""
    try:
        sums = pool.run(_rank_sum, timeout=COMM_TIMEOUT_S + 10)
    except RankError:
        return False
    return sums == [sum(range(pool.size))] * pool.size


def _rank_sum(comm) -> int:
    import torch

    return int(comm.all_reduce(torch.tensor([float(comm.rank)]), "sum").item())


class Pools:
    """``pools(n)``: a pool of at least n gloo ranks, started on first use and kept across
    cases; a case runs on its first n ranks (``zoo_parity`` splits them off once).

    One pool at a time, of ``least`` ranks or more: a 2-rank case runs on the 4-rank pool
    rather than on a pool of its own, so however the cases are ordered (pytest's selection,
    the gather cases after the refuse ones) the ranks start once, paying the imports of
    torch, torchvision, timm and smp (~20-40 s) once. A request for more ranks than the pool
    has replaces it (each rank holds a few GB after a large model, so two pools would crowd
    the machine). Callers that know their largest case pass it as ``least``.
    """

    def __init__(self, least: int = 1) -> None:
        self.least = least
        self._pool: Ranks | None = None

    def __call__(self, n: int) -> Ranks:
        # A pool closed after a crash starts afresh on its next run (Ranks.run).
        if self._pool is not None and self._pool.size < n:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = Ranks(max(n, self.least), "gloo", comm_timeout=COMM_TIMEOUT_S)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
