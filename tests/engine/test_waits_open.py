"""``correlate.waits_open``: the pipeline skips ``check_lagging`` and ``check_silent_peers`` while no open,
unexplained incident of the kinds they read is in the run (issue 15 (a): env500 called both on every event
of a run whose one incident is an open loss plateau). The skip must change nothing:

* without such an incident, both checks return no finding and write nothing, whatever the time (checked
  on every corpus scenario, after each event, at the event's time and far past every grace);
* the pipeline that always calls both (the gate forced True: the behaviour before) yields the same
  incidents and the same snapshot on every corpus scenario, events then ``advance`` as a runtime judges;
* the comparison has teeth: with the gate forced False the rank-lost and lagging-rank scenarios change.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, SCENARIOS
from trainguard_engine import correlate
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RunState

PURE = pytest.mark.engine_pure("replaces correlate.waits_open under the pipeline and deep-copies run states")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings(stall_min_s=5.0)
"""The stall floor the dist scenarios are judged with (tests/engine/test_comm_scenarios.py)."""
SETTLE_S = 60.0
NAMES = tuple(s.name for s in SCENARIOS)

Event = Dict[str, Any]


def _last_ns(events: Sequence[Event]) -> int:
    return max(int(e.get("time_unix_nano") or 0) for e in events)


def _judged(events: Sequence[Event]) -> Tuple[List[Dict[str, Any]], bytes]:
    pipeline = Pipeline(SETTINGS)
    pipeline.process(events)
    pipeline.advance(_last_ns(events) + int(SETTLE_S * 1e9))
    return [i.to_dict() for i in pipeline.incidents()], pipeline.snapshot()


def _state(run: RunState) -> str:
    return json.dumps(run.to_json(), sort_keys=True, default=repr)


@PURE
@pytest.mark.parametrize("name", NAMES)
def test_without_an_open_wait_neither_check_finds_or_writes_anything(name: str) -> None:
    events = BY_NAME[name].events()
    pipeline = Pipeline(SETTINGS)
    grace_ns = int(max(SETTINGS.rank_lost_grace_s, 1.0) * 1e9)
    checked = 0
    for ev in events:
        pipeline.process([ev])
        now = int(ev.get("time_unix_nano") or 0)
        for run in pipeline._runs.values():
            if not run.incidents or correlate.waits_open(run):
                continue
            for at in (now, now + grace_ns + 1, now + 10 ** 6 * grace_ns):
                twin = copy.deepcopy(run)
                before = _state(twin)
                assert correlate.check_lagging(twin, at, SETTINGS) == []
                assert correlate.check_silent_peers(twin, at, SETTINGS) == []
                assert _state(twin) == before
                checked += 1
    expected = BY_NAME[name].expected
    if expected is not None and expected not in correlate.PEER_FAILURES + correlate.WAITED_ON:
        assert checked  # its incident opened the gate's closed side: the checks above ran


def test_the_gate_opens_on_an_open_peer_failure_and_closes_when_it_is_resolved() -> None:
    events = BY_NAME["dist_rank_lost"].events()
    pipeline = Pipeline(SETTINGS)
    pipeline.process(events)
    pipeline.advance(_last_ns(events) + int(SETTLE_S * 1e9))
    (run,) = pipeline._runs.values()
    open_waits = [st for st in run.incidents.values() if st.is_open and not st.record.explained_by
                  and (st.record.category, st.record.subtype) in correlate.PEER_FAILURES]
    assert open_waits and correlate.waits_open(run)
    twin = copy.deepcopy(run)
    for st in twin.incidents.values():
        st.record.status = "resolved"
    assert not correlate.waits_open(twin)


@pytest.mark.parametrize("name", NAMES)
def test_always_calling_both_checks_gives_the_same_incidents_and_snapshot(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events = BY_NAME[name].events()
    gated = _judged(events)
    monkeypatch.setattr(correlate, "waits_open", lambda run: True)
    assert _judged(events) == gated


@PURE
@pytest.mark.parametrize("name", ["dist_rank_lost", "dist_timeout"])
def test_the_comparison_has_teeth_a_gate_that_never_opens_changes_the_outcome(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events = BY_NAME[name].events()
    gated = _judged(events)
    monkeypatch.setattr(correlate, "waits_open", lambda run: False)
    assert _judged(events) != gated
