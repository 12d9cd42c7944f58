"""A verdict of the product on one wild log, and its score against the log's label.

The verdict is what a user reads first: the **top incident** of the run -- the most severe incident that
no other one explains (``explained_by`` empty), the earliest first among equals (the order
``trainguard replay`` prints them in). Scores:

* category / subtype: the top incident's ``category`` / ``category/subtype`` equal the label's kind;
* culprit: the top incident's ``lead_rank`` equals ``culprit_rank`` (only where the label names one);
* root vs consequence (only multi-rank logs that show a consequence): the top incident is the root
  cause, i.e. its kind is the label's kind, not one of the consequences;
* imported: the import sent at least one log or exception event (a log that imports nothing can tell
  nothing).
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .corpus import Case, Label

SEVERITY_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}


@dataclass(frozen=True)
class Verdict:
    """What the product said about one log (what ``verdicts.json`` records)."""

    kind: str                    # the top incident's category/subtype; "" when there is none
    lead_rank: Optional[int]
    imported: bool               # at least one log or exception event was sent
    kinds: Tuple[str, ...] = ()  # every incident's kind, top first (the rest for the report)

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "lead_rank": self.lead_rank, "imported": self.imported,
                "kinds": list(self.kinds)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Verdict:
        return cls(kind=doc["kind"], lead_rank=doc["lead_rank"], imported=doc["imported"],
                   kinds=tuple(doc.get("kinds", ())))


def ordered(incidents: Iterable[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """Incidents no other one explains, most severe first, earliest first among equals."""
    own = [i for i in incidents if not i.get("explained_by")]
    return sorted(own, key=lambda i: (SEVERITY_ORDER.get(str(i.get("severity", "")), 9),
                                      int(i.get("first_ns") or 0)))


def verdict_of(incidents: Sequence[Mapping[str, Any]], built: Mapping[str, int]) -> Verdict:
    """The verdict of a run's incidents; ``built``: the import's envelope counts by kind."""
    top = ordered(incidents)
    kinds = tuple(f"{i['category']}/{i['subtype']}" for i in top)
    lead = top[0].get("lead_rank") if top else None
    return Verdict(kind=kinds[0] if kinds else "", lead_rank=lead if isinstance(lead, int) else None,
                   imported=built.get("log", 0) + built.get("exception", 0) > 0, kinds=kinds)


def replay_local(case: Case, data_dir: Optional[Path] = None) -> Verdict:
    """Import ``case``'s log with ``trainguard replay``'s defaults into a data directory (in process: the
    same gateway, processor and pipeline as ``trainguard serve``) and return the verdict."""
    from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

    with tempfile.TemporaryDirectory(prefix="tg-wild-") as tmp:
        backend = LocalBackend(Path(data_dir or tmp))
        try:
            run_id = f"wild-{case.case_id}"
            summary = Importer(ReplayOptions(run_id=run_id, logs=[(0, case.log)]), backend).run()
            backend.finish()
            return verdict_of(backend.incidents(run_id), summary.built)
        finally:
            backend.close()


def replay_all(cases: Sequence[Case], data_dir: Optional[Path] = None) -> Dict[str, Verdict]:
    """:func:`replay_local` for many cases through ONE in-process backend (one data directory, one processor):
    each log is imported as its own run (``wild-<id>``), the processor drained once, then each run's
    incidents read. Runs share nothing in the engine (state is per run), so the verdicts are the ones
    :func:`replay_local` gives one by one (tests/services/replay/test_wild_corpus.py checks every one against
    the recorded verdicts) -- without a data directory, stores and processor thread per log."""
    from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

    with tempfile.TemporaryDirectory(prefix="tg-wild-") as tmp:
        backend = LocalBackend(Path(data_dir or tmp))
        try:
            built = {case.case_id: Importer(ReplayOptions(run_id=f"wild-{case.case_id}",
                                                          logs=[(0, case.log)]), backend).run().built
                     for case in cases}
            backend.finish()
            return {case_id: verdict_of(backend.incidents(f"wild-{case_id}"), counts)
                    for case_id, counts in built.items()}
        finally:
            backend.close()


@dataclass
class Score:
    """One case's score: None where the label does not test that line."""

    case_id: str
    part: str
    label: Label
    verdict: Verdict
    category: bool = False
    subtype: bool = False
    culprit: Optional[bool] = None
    root: Optional[bool] = None

    @property
    def imported(self) -> bool:
        return self.verdict.imported


def score(case: Case, verdict: Verdict) -> Score:
    """How ``verdict`` does on ``case``'s label."""
    label = case.label
    got_category = verdict.kind.split("/", 1)[0] if verdict.kind else ""
    return Score(case.case_id, case.part, label, verdict,
                 category=got_category == label.category, subtype=verdict.kind == label.kind,
                 culprit=None if label.culprit_rank is None else verdict.lead_rank == label.culprit_rank,
                 root=(verdict.kind == label.kind) if label.root_vs_consequence else None)


@dataclass
class Tally:
    """Counts of one group of scores."""

    n: int = 0
    category: int = 0
    subtype: int = 0
    culprit_n: int = 0
    culprit: int = 0
    root_n: int = 0
    root: int = 0
    nothing: int = 0
    misses: List[str] = field(default_factory=list)

    def add(self, s: Score) -> None:
        self.n += 1
        self.category += s.category
        self.subtype += s.subtype
        if s.culprit is not None:
            self.culprit_n += 1
            self.culprit += s.culprit
        if s.root is not None:
            self.root_n += 1
            self.root += s.root
        self.nothing += not s.imported
        if not s.subtype:
            self.misses.append(f"{s.case_id}: {s.label.kind} -> {s.verdict.kind or 'nothing'}")


def pct(k: int, n: int) -> str:
    return f"{100.0 * k / n:5.1f} % ({k}/{n})" if n else "   -  (0/0)"


def tallies(scores: Iterable[Score]) -> Dict[Tuple[str, str], Tally]:
    """Per (part, group): group is "ALL", a category, or a kind."""
    out: Dict[Tuple[str, str], Tally] = defaultdict(Tally)
    for s in scores:
        for group in ("ALL", s.label.category, s.label.kind):
            out[(s.part, group)].add(s)
    return out


def report(scores: Sequence[Score], *, show_misses: Sequence[str] = ("tune",)) -> str:
    """The per-part table: right category, right subtype, culprit, root vs consequence, imports of
    nothing; misses listed for the parts in ``show_misses`` (never the held-out part by default)."""
    t = tallies(scores)
    lines = []
    for part in ("tune", "heldout"):
        groups = sorted(g for p, g in t if p == part)
        if not groups:
            continue
        lines.append(f"== {part} ==")
        lines.append(f"{'group':28} {'n':>4}  {'category':>16}  {'subtype':>16}  {'culprit':>16}  "
                     f"{'root vs conseq.':>16}  nothing")
        for g in ["ALL"] + [g for g in groups if g != "ALL"]:
            x = t[(part, g)]
            name = g if g == "ALL" or "/" not in g else "  " + g
            lines.append(f"{name:28} {x.n:4}  {pct(x.category, x.n):>16}  {pct(x.subtype, x.n):>16}  "
                         f"{pct(x.culprit, x.culprit_n):>16}  {pct(x.root, x.root_n):>16}  {x.nothing}")
        if part in show_misses:
            lines.extend(f"  miss {m}" for m in t[(part, "ALL")].misses)
    return "\n".join(lines)
