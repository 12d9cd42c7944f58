"""The column hook's read-ahead (``Pipeline._run_ahead``) on what the processor hands the pipeline (issue 15,
stop 42): envelopes it read itself (``ReadEnvelope``, with their points) are taken as they are, the route of a
list of point names is looked up in the routes of the event's settings, and an alert or a non-finite value
stops the run -- inline, without ``_read`` / ``_route`` / ``_notable``. It must change nothing: a pipeline
whose memory detector is handed runs of envelopes gives, piece by piece, the outputs and snapshots of one
that calls it envelope by envelope, on records decoded as the processor decodes them (ReadEnvelopes beside
dicts: alerts, memory events, other runs and projects with other settings interleaved, another host, NaN and
inf values, malformed events), and on the same events as dicts."""

from __future__ import annotations

import json
import math
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest.mock import patch

import pytest

from tests.engine.test_amp_steady import _amp_stream
from trainguard import wire
from trainguard_engine import pipeline as pipeline_mod
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.memory import Memory
from trainguard_engine.pipeline import Pipeline, ReadEnvelope
from trainguard_server.processor import decode

PURE = pytest.mark.engine_pure("counts calls of Memory.on_metric_run through patch.object")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

Event = Dict[str, Any]
SETTINGS = DetectionSettings()
PROJECTS = {"q": DetectionSettings.from_overrides({"history_len": 24})}


def _mixed(seed: int) -> List[Event]:
    """Two AMP runs (projects p and q: q has its own settings) interleaved in stretches, with alerts, memory
    events, another host, a point of another name list, NaN / inf values and a malformed envelope."""
    rng = random.Random(seed)
    a = _amp_stream(seed)
    b = [dict(e, project="q", run_id=f"q-{seed}", event_id=f"q{e.get('event_id', '')}") for e in _amp_stream(seed + 1)]
    out: List[Event] = []
    while a or b:
        src = a if (rng.random() < 0.7 and a) or not b else b
        take = src[:rng.choice([1, 3, 20, 80])]
        del src[:len(take)]
        for event in take:
            r = rng.random()
            if r < 0.02:
                event = dict(event, metrics=dict(event["metrics"], alert="loss_spike"))
            elif r < 0.03:
                points = [dict(p) for p in event["metrics"]["points"]]
                points[0]["value"] = rng.choice([math.nan, math.inf])
                event = dict(event, metrics={"points": points})
            elif r < 0.04:
                event = dict(event, host="other")
            elif r < 0.05:
                event = dict(event, metrics={"points": event["metrics"]["points"] + [
                    {"name": "throughput/samples_per_s", "value": 5.0}]})
            out.append(event)
            if r > 0.99:
                out.append({k: v for k, v in event.items() if k != "metrics"} |
                           {"event_id": f"m{len(out)}", "memory": {"allocated": 10 ** 9, "reserved": 2 * 10 ** 9}})
            elif r > 0.985:
                out.append({"project": "p", "run_id": event["run_id"], "metrics": {"points": []}, "step": "x"})
    return out


def _records(events: Sequence[Event], per: int) -> Iterator[Tuple[List[Any], List[Optional[Any]]]]:
    """``events`` as the processor reads them: wire records of ``per`` envelopes, each decoded by
    ``decode.read_request`` (plain metric batches become ReadEnvelopes with their points); an envelope the wire
    cannot carry (the malformed one) stays a dict without points."""
    for lo in range(0, len(events), per):
        envelopes: List[Any] = []
        points: List[Optional[Any]] = []
        for event in events[lo:lo + per]:
            try:
                value = wire.prepare_batch([event]).request.SerializeToString()
            except Exception:
                envelopes.append(event)
                points.append(None)
                continue
            e, p = decode.read_request(value)
            envelopes.extend(e)
            points.extend(p)
        yield envelopes, points


def _compare(events: List[Event], per: int, read: bool) -> int:
    """Runs of envelopes vs one by one, piece by piece (snapshots restored every third piece); how many
    envelopes the hook was handed after the first of their run."""
    handed = [0]
    saved = Memory.on_metric_run

    def counting(self: Memory, run: Any, rank: Any, batches: Any, settings: Any) -> Any:
        handed[0] += len(batches.batches) - 1
        return saved(self, run, rank, batches, settings)

    pieces = list(_records(events, per)) if read else [(events[lo:lo + per], None)
                                                       for lo in range(0, len(events), per)]
    fast, slow = Pipeline(SETTINGS, PROJECTS), Pipeline(SETTINGS, PROJECTS)
    for k, (envelopes, points) in enumerate(pieces):
        with patch.object(Memory, "on_metric_run", counting):
            out_fast = fast.process(envelopes, points)
        with patch.object(Memory, "independent", False):
            out_slow = slow.process(envelopes, points)
        assert out_fast == out_slow, k
        blob = fast.snapshot()
        assert blob == slow.snapshot(), k
        if k % 3 == 2:
            fast, slow = Pipeline.restore(blob, SETTINGS, PROJECTS), Pipeline.restore(blob, SETTINGS, PROJECTS)
    assert fast.incidents() == slow.incidents()
    assert fast.counters == slow.counters
    return handed[0]


@PURE
@pytest.mark.parametrize("seed", range(12))
def test_read_records_give_what_one_envelope_at_a_time_gives(seed: int) -> None:
    events = _mixed(seed)
    assert _compare(events, 97 + seed, read=True) > 100


@PURE
@pytest.mark.parametrize("seed", range(0, 12, 3))
def test_dicts_give_what_one_envelope_at_a_time_gives(seed: int) -> None:
    assert _compare(_mixed(seed), 61, read=False) > 100


def test_the_streams_hold_what_the_read_ahead_must_stop_at() -> None:
    events = _mixed(1)
    envelopes = [e for piece in _records(events, 200) for e in piece[0]]
    plain = [e for e in envelopes if type(e) is ReadEnvelope]
    assert len(plain) > len(envelopes) // 2
    dicts = [e for e in envelopes if type(e) is not ReadEnvelope]
    assert any(e.get("metrics", {}).get("alert") for e in dicts)
    assert any("memory" in e for e in dicts)
    assert any(e.project == "q" for e in plain) and any(e.host == "other" for e in plain)
    text = json.dumps(events, allow_nan=True)
    assert "NaN" in text and "Infinity" in text


@PURE
def test_a_route_missing_from_the_settings_routes_is_made() -> None:
    """A read-ahead envelope whose name list has no route yet (the routes were started afresh) gets one made
    by _route, as before."""
    events = _mixed(2)[:300]
    with patch.object(pipeline_mod, "ROUTES_MAX", 1):
        assert _compare(events, 300, read=True) > 10


@pytest.mark.parametrize("seed", range(0, 12, 2))
def test_read_records_give_what_their_dicts_give(seed: int) -> None:
    """The pipeline takes a ReadEnvelope with its points as it is (no _read; stop 42): the decoded records
    give, piece by piece, the outputs and snapshots their envelopes' dicts (``raw``) give without points."""
    pieces = list(_records(_mixed(seed), 89 + seed))
    read, plain = Pipeline(SETTINGS, PROJECTS), Pipeline(SETTINGS, PROJECTS)
    taken = 0
    for k, (envelopes, points) in enumerate(pieces):
        taken += sum(type(e) is ReadEnvelope for e in envelopes)
        out_read = read.process(envelopes, points)
        out_plain = plain.process([e.raw if type(e) is ReadEnvelope else e for e in envelopes])
        assert out_read == out_plain, k
        blob = read.snapshot()
        assert blob == plain.snapshot(), k
        if k % 3 == 2:
            read, plain = Pipeline.restore(blob, SETTINGS, PROJECTS), Pipeline.restore(blob, SETTINGS, PROJECTS)
    assert read.counters == plain.counters and taken > 300
