"""Fuzz: the engine Pipeline (engine/src/trainguard_engine/pipeline.py) on arbitrary envelopes.

Contract under test (the pipeline's module docstring, issue 18 finding 1): the pipeline never raises on
input -- an envelope it cannot read is counted (``malformed``), a run whose processing or state breaks is
quarantined (``runs_quarantined``) -- and every record it emits, :meth:`Pipeline.snapshot` and every part of
:meth:`Pipeline.changed_parts` serialise as strict JSON (``allow_nan=False``); a snapshot restores to a
pipeline whose snapshot is the same. Envelopes that went through the wire schema (what the processor hands
the pipeline: ``wire.envelope_to_dict`` of a validated protobuf) are legitimate input: none of them may
quarantine a run (that would be a detector or classifier bug met by real data).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.budget import examples
from tests.fuzz.strategies import INT64, METRIC_NAMES, doubles, envelope_dicts, json_values
from trainguard import wire
from trainguard_engine.pipeline import Pipeline, PipelineOutput

# per test, full / ci profile (tests/fuzz/budget.py): TRAINGUARD_FUZZ_PROFILE=full runs 300 (the count before
# stop 37); the ci count keeps the file near 15 s on the 2-core CI machine (it took 31-53 s at 300)
EXAMPLES = examples(300, ci=100)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
T0 = 1_764_000_000 * 10**9
TRIED: Dict[str, int] = {}
FIGURES: Counter[str] = Counter()  # events, records emitted, counters summed over all examples

QUARANTINED: Counter[str] = Counter()  # why runs were quarantined (arbitrary input only), first words


@dataclass(frozen=True)
class Advance:
    """A step of a fuzzed sequence that advances processing time (``Pipeline.advance``)."""

    now_ns: int


Step = Union[Dict[str, Any], Advance]  # an envelope to process, or a processing time to advance to


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    """Print the examples each fuzz test of this file tried (the issue-18 note quotes them)."""
    yield
    print(f"\npipeline fuzz, examples per test: {TRIED}; totals: {dict(sorted(FIGURES.items()))}; "
          f"quarantined (arbitrary input): {dict(QUARANTINED)}")


def _through_wire(event: Dict[str, Any]) -> Dict[str, Any]:
    """``event`` as the processor hands it to the pipeline: parsed into the protobuf, back to a dict."""
    return wire.envelope_to_dict(wire.envelope_from_dict(event))


@st.composite
def _job_streams(draw: Any) -> List[Step]:
    """Envelopes from the wire schema, half the time shaped like a job's stream: a few runs and ranks,
    steps and times going forward (with jumps), so that state accumulates and detectors fire; processing
    time advances in between (sometimes far, sometimes backwards, sometimes to the int64 edges)."""
    events = draw(st.lists(envelope_dicts(), min_size=3, max_size=60))
    if draw(st.booleans()):
        runs = draw(st.lists(st.sampled_from(["job-a", "job-b", "job-c"]), min_size=1, max_size=2))
        for i, event in enumerate(events):
            event["run_id"] = draw(st.sampled_from(runs))
            event["project"] = ""
            event["rank"] = draw(st.integers(0, 3))
            event["step"] = i + draw(st.sampled_from([0, 0, 0, 1000, -1, 2**40]))
            event["time_unix_nano"] = T0 + i * 10**9 + draw(st.sampled_from([0, 0, 0, 10**12, -(10**12)]))
    steps: List[Step] = [_through_wire(e) for e in events]
    for _ in range(draw(st.integers(0, 3))):
        when = draw(st.one_of(st.integers(T0, T0 + 10**15), st.sampled_from([0, INT64[1], INT64[0], T0])))
        steps.insert(draw(st.integers(0, len(steps))), Advance(when))
    return steps


@st.composite
def _metric_series(draw: Any) -> List[Step]:
    """One run's metric series over 10-120 steps: values of a few metrics (loss, LR, grad norm, loss scale)
    from the whole double range, NaN and Infinity included -- the sequences the numeric detectors and the
    poison run of issue 18 (LR 5e-324 -> 1.0, then a NaN loss) are made of."""
    names = draw(st.lists(st.sampled_from(METRIC_NAMES), min_size=1, max_size=3, unique=True))
    n = draw(st.integers(10, 120))
    series = {name: draw(st.lists(doubles(), min_size=n, max_size=n)) for name in names}
    ranks = draw(st.integers(1, 2))
    steps: List[Step] = []
    for i in range(n):
        for rank in range(ranks):
            steps.append(_through_wire({
                "event_id": f"e{i}r{rank}", "run_id": "series", "rank": rank, "world_size": ranks,
                "step": i, "time_unix_nano": T0 + i * 10**9,
                "metrics": {"points": [{"name": name, "value": series[name][i]} for name in names]}}))
    return steps


def _strict(doc: Any, what: str) -> None:
    """``doc`` serialises as strict JSON."""
    try:
        json.dumps(doc, allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise AssertionError(f"{what} is not strict JSON: {exc}: {doc!r}"[:3000]) from None


def _check_output(out: PipelineOutput) -> None:
    for record in [*out.runs, *out.incidents, *out.clusters]:
        _strict(record.to_dict(), f"{type(record).__name__} record")
    FIGURES["runs_emitted"] += len(out.runs)
    FIGURES["incidents_emitted"] += len(out.incidents)
    FIGURES["clusters_emitted"] += len(out.clusters)


def _check_state(pipeline: Pipeline, parts_restore: bool = True) -> None:
    """The snapshot and the changed parts are strict JSON; the snapshot (and, with ``parts_restore``, the
    parts) restore to a pipeline with that snapshot."""
    blob = pipeline.snapshot()
    _strict(json.loads(blob), "Pipeline.snapshot()")
    parts = {name: part for name, part in pipeline.changed_parts().items() if part is not None}
    for name, part in parts.items():
        _strict(json.loads(part), f"changed part {name}")
    pipeline.parts_saved()
    assert Pipeline.restore(blob, pipeline.settings).snapshot() == blob
    if parts_restore:
        assert Pipeline.restore_parts(parts, pipeline.settings).snapshot() == blob


def _run(steps: Sequence[Any], chunk: Optional[int] = None) -> Pipeline:
    """Feed ``steps`` (envelopes, and :class:`Advance`) one by one, or ``chunk`` envelopes at a time."""
    pipeline = Pipeline()
    pending: List[Any] = []
    for item in steps:
        if isinstance(item, Advance):
            if pending:
                _check_output(pipeline.process(pending))
                pending = []
            _check_output(pipeline.advance(item.now_ns))
            continue
        pending.append(item)
        if chunk is None or len(pending) >= chunk:
            _check_output(pipeline.process(pending))
            pending = []
    if pending:
        _check_output(pipeline.process(pending))
    _check_output(pipeline.advance(T0 + 10**13))
    FIGURES["events"] += pipeline.counters["events"]
    for name in ("malformed", "duplicates", "late", "runs_quarantined", "nonfinite_encoded"):
        FIGURES[name] += pipeline.counters[name]
    QUARANTINED.update(re.sub(r": .*(?= \(at )", "", q.reason.split(" raised ", 1)[-1], flags=re.S)[:120]
                       for q in pipeline.quarantined)
    return pipeline


@FUZZ
@given(_job_streams(), st.sampled_from([None, 1, 7]))
def test_envelopes_from_the_wire_schema(steps: List[Step], chunk: Optional[int]) -> None:
    """Wire-valid envelopes: no exception, no quarantined run, strict-JSON records, snapshot and parts."""
    TRIED["envelopes_from_the_wire_schema"] = TRIED.get("envelopes_from_the_wire_schema", 0) + 1
    pipeline = _run(steps, chunk)
    assert pipeline.counters["runs_quarantined"] == 0, pipeline.quarantined
    assert pipeline.counters["events"] == sum(1 for s in steps if not isinstance(s, Advance))
    _check_state(pipeline)


@FUZZ
@given(_metric_series())
def test_metric_series(steps: List[Step]) -> None:
    """Long metric series with any values: no exception, no quarantined run, strict JSON everywhere."""
    TRIED["metric_series"] = TRIED.get("metric_series", 0) + 1
    pipeline = _run(steps, chunk=16)
    assert pipeline.counters["runs_quarantined"] == 0, pipeline.quarantined
    _check_state(pipeline)


@FUZZ
@given(st.lists(st.one_of(envelope_dicts(wild=0.2), json_values(finite=False)), max_size=25))
def test_arbitrary_dicts(events: List[Any]) -> None:
    """Anything at all as envelopes (wrong types, NaN floats, huge ints, non-dicts): never an exception;
    what cannot be read is counted; the state still serialises."""
    TRIED["arbitrary_dicts"] = TRIED.get("arbitrary_dicts", 0) + 1
    pipeline = _run(events)
    counters = pipeline.counters
    assert counters["events"] == len(events)
    assert all(v >= 0 for v in counters.values()), counters
    _check_state(pipeline)  # quarantines included: see test_quarantine_inside_cluster_observe


def test_quarantine_inside_cluster_observe() -> None:
    """Falsifying example of test_arbitrary_dicts (restore_parts(changed_parts()) != restore(snapshot())): an
    exception event raising inside clusters.observe had already added its cluster without marking it
    unsaved (fixed: clusters.observe does what can fail before it changes anything)."""
    pipeline = Pipeline()
    pipeline.process([{"run_id": "r", "exception": {"hints": [{"frame_index": []}]}}])
    assert pipeline.counters["runs_quarantined"] == 1  # the event's malformed hint: a documented outcome
    blob = pipeline.snapshot()
    parts = {name: part for name, part in pipeline.changed_parts().items() if part is not None}
    assert Pipeline.restore_parts(parts, pipeline.settings).snapshot() == blob
