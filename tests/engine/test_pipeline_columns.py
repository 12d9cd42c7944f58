"""The column hook (detectors/base.py): an ``independent`` detector handed a run of one rank's envelopes in
one call (``on_metric_run``) gives exactly what calling ``on_metrics`` envelope by envelope gives -- every
record of every output, the snapshot and the quarantine of a run whose detector raises at one envelope of
the run -- because the pipeline applies each envelope's findings at that envelope's place.

The streams: the recorded GPU scenario streams (tests/scenarios/streams_gpu) as a producer that sends only
``mem/*`` and ``amp/*`` metrics (no ``memory`` events: the memory detector's metric path, where the hook
applies), the AMP-overflow recording whole (its memory events end the runs), and two ranks of one run
interleaved (the leak recording as rank 0 and again as rank 1: runs read ahead across the other rank's
envelopes). The golden digests (test_pipeline_golden.py) hold for the corpus; its streams send memory as
``memory`` events, so they do not exercise the hook -- these do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import pipeline as pipeline_mod
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.base import Detector, MetricBatch, MetricRun, RunFindings
from trainguard_engine.detectors.memory import Memory
from trainguard_engine.incidents import Finding
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RankState, RunState

PURE = pytest.mark.engine_pure("subclasses the memory detector to count the columns it is handed")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

GPU = Path(__file__).resolve().parents[1] / "scenarios" / "streams_gpu"
BY_NAME = {s.name: s for s in SCENARIOS}
Event = Dict[str, Any]


def _load(path: Path) -> List[Event]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _metrics_only(name: str) -> List[Event]:
    return [e for e in BY_NAME[name].events() if "memory" not in e]


def _two_ranks(name: str) -> List[Event]:
    """The run's metric-only stream as rank 0 and again as rank 1, interleaved event by event."""
    zero = _metrics_only(name)
    one = [dict(e, rank=1, event_id=f"{e.get('event_id', '')}-r1") for e in zero]
    return [e for pair in zip(zero, one) for e in pair]


STREAMS = {**{f"{s.name}-metrics": (lambda n=s.name: _metrics_only(n)) for s in SCENARIOS
              if s.name.startswith("gpu_") or s.name == "leak"},
           "gpu_amp_overflow-recording": lambda: _load(GPU / "gpu_amp_overflow.jsonl"),
           "gpu_leak-two-ranks": lambda: _two_ranks("gpu_leak")}


class _Counting(Memory):
    """The memory detector, counting what its column hook was handed and found (a subclass: the same
    detector)."""

    def __init__(self, seen: Dict[str, int]) -> None:
        self.seen = seen

    def on_metric_run(self, run: RunState, rank: RankState, batches: MetricRun,
                      settings: DetectionSettings) -> RunFindings:
        found = super().on_metric_run(run, rank, batches, settings)
        self.seen["runs"] += 1
        self.seen["envelopes"] += len(batches.batches)
        self.seen["later_findings"] += sum(len(f) for f in found.findings[1:])
        return found


def _outputs(events: Sequence[Event], chunk: int) -> Tuple[List[Dict[str, Any]], bytes]:
    """Every record of every output (in records of ``chunk`` envelopes) and the final snapshot."""
    pipeline = Pipeline()
    records: List[Dict[str, Any]] = []
    for i in range(0, len(events), chunk):
        out = pipeline.process(events[i:i + chunk])
        records += [r.to_dict() for r in out.runs] + [i.to_dict() for i in out.incidents]
    return records, pipeline.snapshot()


@PURE
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_runs_of_envelopes_give_what_one_envelope_at_a_time_gives(name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    events = STREAMS[name]()
    seen = {"runs": 0, "envelopes": 0, "later_findings": 0}
    counting = _Counting(seen)
    monkeypatch.setattr(pipeline_mod, "DETECTORS", tuple(counting if isinstance(d, Memory) else d
                                                         for d in pipeline_mod.DETECTORS))
    by_runs = [_outputs(events, chunk) for chunk in (50, len(events))]
    assert seen["envelopes"] > seen["runs"] > 0  # the hook was handed runs of several envelopes
    monkeypatch.setattr(_Counting, "independent", False)
    one_by_one = [_outputs(events, chunk) for chunk in (50, len(events))]
    assert by_runs == one_by_one
    assert any(records for records, _snapshot in by_runs)


@PURE
def test_findings_on_later_envelopes_of_a_run_are_exercised(monkeypatch: pytest.MonkeyPatch) -> None:
    """At least one stream above has findings on an envelope after the first of its run (else the
    comparison would not show that they are applied at their place)."""
    seen = {"runs": 0, "envelopes": 0, "later_findings": 0}
    monkeypatch.setattr(pipeline_mod, "DETECTORS", tuple(_Counting(seen) if isinstance(d, Memory) else d
                                                         for d in pipeline_mod.DETECTORS))
    for name in ("gpu_fragmentation-metrics", "gpu_leak-metrics", "gpu_oom-metrics"):
        Pipeline().process(STREAMS[name]())
    assert seen["later_findings"] > 0


class _Faulty(Detector):
    """An independent detector with a bug one run's data meets at step 40 (a stand-in for a detector bug
    still unknown), called on the leak stream's ``mem/*`` envelopes."""

    name = "faulty-probe"
    kinds = ("memory/leak",)
    section = "memory"
    names_only = True
    independent = True

    def wants(self, rank: RankState, names: Any, settings: Any) -> bool:
        return "mem/rss" in names

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch, settings: Any) -> Sequence[Finding]:
        if batch.step >= 40:
            raise ZeroDivisionError("float division by zero")
        return []


def _quarantined_both_ways(monkeypatch: pytest.MonkeyPatch, probe: type, events: List[Dict[str, Any]]
                           ) -> List[Tuple[Any, ...]]:
    """``events`` through a pipeline with ``probe`` added, declared independent and then not: the quarantine
    reason, the run and incident records and the counters of each, asserted equal."""
    monkeypatch.setattr(pipeline_mod, "DETECTORS", (*pipeline_mod.DETECTORS, probe()))
    results = []
    for independent in (True, False):
        monkeypatch.setattr(probe, "independent", independent)
        pipeline = Pipeline()
        out = pipeline.process(events)
        (gone,) = pipeline.take_quarantined()
        results.append((gone.reason, [r.to_dict() for r in out.runs], [i.to_dict() for i in out.incidents],
                        pipeline.counters))
    assert results[0] == results[1]
    return results


@PURE
def test_a_hook_that_raises_inside_a_run_quarantines_at_that_envelope(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _metrics_only("leak")
    results = _quarantined_both_ways(monkeypatch, _Faulty, events)
    assert "ZeroDivisionError" in results[0][0] and "step 40" in results[0][0]
    assert results[0][3]["late"] > 0  # the run's later envelopes were dropped, as before


class _Picky(Detector):
    """An independent detector whose ``wants`` has a bug one list of metric names meets."""

    name = "picky-probe"
    kinds = ("memory/leak",)
    section = "memory"
    names_only = True
    independent = True

    def wants(self, rank: RankState, names: Any, settings: Any) -> bool:
        if "probe/odd" in names:
            raise KeyError("probe/odd")
        return "mem/rss" in names

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch, settings: Any) -> Sequence[Finding]:
        return []


@PURE
def test_an_event_read_ahead_raises_at_its_own_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of names first seen inside a run read ahead, whose routing raises (the detector's
    ``wants``), quarantines the run at that envelope -- not at the envelope that read it ahead."""
    events = _metrics_only("leak")
    at = next(i for i, e in enumerate(events) if i > len(events) // 2 and "metrics" in e
              and [p["name"] for p in e["metrics"]["points"]] == ["loss", "lr"])
    odd = json.loads(json.dumps(events[at]))
    odd["metrics"]["points"].append({"name": "probe/odd", "value": 1.0})
    events = [*events[:at], odd, *events[at + 1:]]
    results = _quarantined_both_ways(monkeypatch, _Picky, events)
    assert "KeyError" in results[0][0] and f"step {odd['step']}" in results[0][0]
