"""Plain bodies (issue 15, stop 44): a :class:`~trainguard_engine.pipeline.ReadEnvelope` whose ``body`` is of a
type registered in ``PLAIN_BODIES`` (the processor's ``decode.PlainBatch``: a metric batch without alert or
recent context, by construction) is not asked for ``alert`` / ``recent``; every other body is, as before.

What would be wrong about that fast path, and the test that says so:
- a registered type that does hold an alert or a context (the processor's PlainBatch answers None to both
  for every envelope it reads: checked on the benchmark's recorded streams and on alert / context / NaN
  envelopes through the wire);
- any other body not asked (a dict body, also inside a ReadEnvelope the runtime read itself): an alert's
  replay is still dropped by id, a context still fills the history, the column hook's read-ahead still
  stops at an alert and is never started on one -- each checked with envelopes as dicts and as ReadEnvelopes;
- the fast path not taken (the processor's envelopes asked after all): no PlainBatch.get call while a
  pipeline folds them;
- a different result: the processor's envelopes give, piece by piece, the outputs and snapshots (restored
  every third piece) of the same envelopes as dicts (every body asked).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple
from unittest.mock import patch

import pytest

from tests.engine.test_run_ahead_read import _mixed, _records
from trainguard import wire
from trainguard_engine import extract
from trainguard_engine import pipeline as pipeline_mod
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.memory import Memory
from trainguard_engine.pipeline import PLAIN_BODIES, Pipeline, ReadEnvelope
from trainguard_server.processor import decode

PURE = pytest.mark.engine_pure("counts the column hook's runs through patch.object on Memory")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]


def _metrics(step: int, rank: int = 0, event_id: str = "", **batch: Any) -> Event:
    points = [{"name": "loss", "value": 2.0 - step / 1000}, {"name": "amp/scale", "value": 65536.0}]
    return {"project": "p", "run_id": "r", "rank": rank, "step": step, "host": "h", "pid": 1,
            "time_unix_nano": 10 ** 18 + step * 10 ** 9 + rank, "event_id": event_id or f"e{rank}-{step}",
            "metrics": dict({"points": points}, **batch)}


def _as_read(events: Sequence[Event]) -> Tuple[List[Any], List[Optional[Any]]]:
    """``events`` as ReadEnvelopes the runtime read itself (dict bodies), with their points."""
    envelopes: List[Any] = []
    points: List[Optional[Any]] = []
    for event in events:
        ev = pipeline_mod._parse(event)
        envelopes.append(ev)
        points.append(extract.metric_points(event) if ev.kind == "metrics" else None)
    return envelopes, points


def test_the_processor_registers_its_plain_batch() -> None:
    assert decode.PlainBatch in PLAIN_BODIES
    assert dict not in PLAIN_BODIES


def test_every_plain_batch_read_holds_no_alert_and_no_context() -> None:
    """On wire records holding plain batches, alerts, contexts, NaN / inf values, memory events and malformed
    envelopes: every body of a registered type answers None."""
    values: List[bytes] = []
    for event in _mixed(3):
        try:
            values.append(wire.prepare_batch([event]).request.SerializeToString())
        except Exception:
            continue
    context = _metrics(5, recent=[{"name": "loss", "step": 3, "value": 1.5}])
    alert = _metrics(6, alert="loss_spike")
    values += [wire.prepare_batch([context, alert, _metrics(7)]).request.SerializeToString()]
    plain = other = 0
    for value in values:
        for reader in (decode.read_request, decode.read_request_protobuf):
            envelopes, _points = reader(value)
            for env in envelopes:
                if type(env) is ReadEnvelope and type(env.body) in PLAIN_BODIES:
                    plain += 1
                    assert env.body.get("alert") is None and env.body.get("recent") is None
                    assert not env.raw["metrics"].get("alert") and not env.raw["metrics"].get("recent")
                elif isinstance(env, dict) and "metrics" in env:
                    other += 1
    assert plain > 500 and other >= 4


def _duplicates(events: List[Any], points: Optional[List[Any]]) -> Dict[str, int]:
    pipe = Pipeline(SETTINGS)
    pipe.process(events, points)
    return dict(pipe.counters)


@pytest.mark.parametrize("read", [False, True])
def test_an_alert_replayed_is_dropped_whatever_carries_it(read: bool) -> None:
    events = [_metrics(s) for s in range(1, 6)]
    events.append(_metrics(6, alert="loss_spike", event_id="alert-6"))
    events.append(_metrics(6, alert="loss_spike", event_id="alert-6"))  # its replay
    events.append(_metrics(7, event_id="plain-7"))
    events.append(_metrics(7, event_id="plain-7"))  # a plain batch's replay: folded again (idempotent)
    envelopes, points = _as_read(events) if read else (events, None)
    counters = _duplicates(envelopes, points)
    assert counters["duplicates"] == 1
    assert counters["events"] == len(events)


@pytest.mark.parametrize("read", [False, True])
def test_a_context_fills_the_history_whatever_carries_it(read: bool) -> None:
    events = [_metrics(s) for s in (10, 11)]
    events.append(_metrics(12, alert="loss_spike", recent=[{"name": "loss", "step": 4, "value": 7.5},
                                                            {"name": "loss", "step": 5, "value": 7.25}]))
    envelopes, points = _as_read(events) if read else (events, None)
    pipe = Pipeline(SETTINGS)
    pipe.process(envelopes, points)
    (run,) = pipe._runs.values()
    history = run.ranks[0].history["loss"]
    assert history[4] == (7.5, 0) and history[5] == (7.25, 0)


def _handed(envelopes: List[Any], points: Optional[List[Any]]) -> List[List[str]]:
    """The event ids of each run of envelopes the memory detector's column hook was handed."""
    runs: List[List[str]] = []
    saved = Memory.on_metric_run

    def recording(self: Memory, run: Any, rank: Any, batches: Any, settings: Any) -> Any:
        runs.append([b.event_id for b in batches.batches])
        return saved(self, run, rank, batches, settings)

    with patch.object(Memory, "on_metric_run", recording):
        Pipeline(SETTINGS).process(envelopes, points)
    return runs


@PURE
@pytest.mark.parametrize("read", [False, True])
def test_the_read_ahead_stops_at_an_alert_and_never_starts_on_one(read: bool) -> None:
    events = [_metrics(s) for s in range(1, 9)]
    events.append(_metrics(9, alert="loss_spike", event_id="alert-9"))  # stops the run of 1..8
    events += [_metrics(s) for s in range(10, 14)]
    events.insert(0, _metrics(0, alert="loss_spike", event_id="alert-0"))  # never the start of a run
    envelopes, points = _as_read(events) if read else (events, None)
    runs = _handed(envelopes, points)
    assert runs, "the column hook was never handed a run"
    handed = [e for run in runs for e in run]
    assert "alert-0" not in handed and "alert-9" not in handed
    assert ["e0-1", "e0-2", "e0-3", "e0-4", "e0-5", "e0-6", "e0-7", "e0-8"] in runs
    assert ["e0-10", "e0-11", "e0-12", "e0-13"] in runs


def test_the_processor_envelopes_are_not_asked() -> None:
    """The fast path is taken: folding what read_request hands out calls no PlainBatch.get."""
    asked = [0]
    saved = decode.PlainBatch.get

    def counting(self: decode.PlainBatch, key: Any, default: Any = None) -> Any:
        asked[0] += 1
        return saved(self, key, default)

    pieces = list(_records(_mixed(5), 80))
    assert sum(type(e) is ReadEnvelope for envelopes, _p in pieces for e in envelopes) > 500
    pipe = Pipeline(SETTINGS)
    with patch.object(decode.PlainBatch, "get", counting):
        for envelopes, points in pieces:
            pipe.process(envelopes, points)
    assert asked[0] == 0


@pytest.mark.parametrize("seed", range(4))
def test_plain_bodies_give_what_asked_bodies_give(seed: int) -> None:
    """read_request's envelopes (plain bodies not asked) vs the same envelopes as their dicts (every body
    asked), piece by piece, snapshots restored every third piece."""
    events = _mixed(seed)
    pieces = list(_records(events, 70 + seed))
    fast, slow = Pipeline(SETTINGS), Pipeline(SETTINGS)
    for k, (envelopes, points) in enumerate(pieces):
        dicts = [wire.envelope_to_dict(e.raw._message()) if type(e) is ReadEnvelope else e
                 for e in envelopes]
        out_fast = fast.process(envelopes, points)
        out_slow = slow.process(dicts)
        assert out_fast == out_slow, k
        blob = fast.snapshot()
        assert blob == slow.snapshot(), k
        if k % 3 == 2:
            fast, slow = Pipeline.restore(blob, SETTINGS), Pipeline.restore(blob, SETTINGS)
    assert fast.counters == slow.counters
