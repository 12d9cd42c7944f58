"""processor/decode.py: one pass from queue bytes to envelope dicts and points, equal to the generic path;
read_request's plain metric batches (ReadEnvelopes) equal to their dicts, and the pipeline's outputs the same
given either.

Every recorded stream of the golden set (scenario corpus, demo fixtures, NCCL jobs) goes through the wire
as the gateway publishes it; the fast decoder must give, envelope by envelope, exactly the dict of
``wire.envelope_to_dict`` and the points of ``extract.metric_points`` (non-finite values included).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest

from tests.engine.test_pipeline_golden import streams
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine.extract import is_raw_context, metric_points
from trainguard_engine.pipeline import Pipeline, ReadEnvelope
from trainguard_server.processor.decode import decode_request, read_request

STREAMS = streams()


def _same_points(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (n1, s1) == (n2, s2) and (v1 == v2 or (math.isnan(v1) and math.isnan(v2)))
        for (n1, s1, v1), (n2, s2, v2) in zip(a, b))


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_fast_decode_equals_generic(name: str) -> None:
    events, _settings = STREAMS[name]
    envelopes: List[Dict[str, Any]] = events()
    request = wire.prepare_batch(envelopes).request
    value = request.SerializeToString()
    fast, points = decode_request(value)
    generic = [wire.envelope_to_dict(m) for m in ingest_pb2.IngestRequest.FromString(value).events]
    assert len(fast) == len(generic) == len(points)
    for got, want, pts in zip(fast, generic, points):
        assert got == want
        assert list(got) == list(want)  # the same key order (stored payloads are serialised as given)
        assert _same_points(pts, metric_points(want) if "metrics" in want else None)


def test_non_finite_and_own_steps() -> None:
    """A batch spanning steps with NaN/Inf values and a zero value: the cases the fast path spells out."""
    from trainguard.core import events as ev

    ident = {"project": "p", "run_id": "r", "rank": 3, "world_size": 4}
    body = {"points": [{"name": "loss", "value": "NaN", "step": 7}, {"name": "grad/global_norm",
                                                                    "value": "Infinity"},
                       {"name": "lr", "value": 0.0, "step": 9}, {"name": "", "value": 1.0},
                       {"name": "x", "value": "-Infinity", "step": -1}]}
    envelope = ev.envelope(ident, "metrics", body, step=5, time_unix_nano=1, event_id="e1")
    value = wire.prepare_batch([envelope]).request.SerializeToString()
    (got,), (pts,) = decode_request(value)
    (msg,) = ingest_pb2.IngestRequest.FromString(value).events
    want = wire.envelope_to_dict(msg)
    assert got == want and list(got) == list(want)
    assert _same_points(pts, metric_points(want))
    assert [(n, s) for n, s, _v in pts] == [("loss", 7), ("grad/global_norm", 5), ("lr", 9), ("x", 5)]


def _read_equals_dict(read: Any, want: Dict[str, Any]) -> None:
    """A ReadEnvelope of read_request: its raw and body equal the generic dict's, and what the pipeline
    reads from it is what it reads from that dict."""
    from trainguard_engine.pipeline import _parse

    assert isinstance(read, ReadEnvelope)
    assert dict(read.raw) == want and list(read.raw) == list(want) and len(read.raw) == len(want)
    assert read.raw == want
    assert all(key in read.raw for key in want) and "exception" not in read.raw and "nope" not in read.raw
    assert read.raw.get("alert") is None and read.raw.get("severity", "x") == want.get("severity", "x")
    assert dict(read.body) == want["metrics"] and list(read.body) == list(want["metrics"])
    assert read.body.get("alert") is None and read.body.get("recent") is None
    assert ("points" in read.body) == ("points" in want["metrics"])
    parsed = _parse(want)
    for field in ReadEnvelope.__slots__:
        if field not in ("raw", "body"):
            assert getattr(read, field) == getattr(parsed, field), field
    assert read.kind == parsed.kind == "metrics"


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_read_request_equals_generic(name: str) -> None:
    """Plain metric batches come as ReadEnvelopes equal to their dicts; every other envelope as its dict;
    the points as decode_request gives them."""
    events, _settings = STREAMS[name]
    value = wire.prepare_batch(events()).request.SerializeToString()
    got, points = read_request(value)
    dicts, want_points = decode_request(value)
    assert len(got) == len(dicts) == len(points)
    plain = 0
    for envelope, want, pts, want_pts in zip(got, dicts, points, want_points):
        assert _same_points(pts, want_pts)
        if isinstance(envelope, ReadEnvelope):
            plain += 1
            assert not want["metrics"].get("alert") and not want["metrics"].get("recent")
            assert not is_raw_context(want)  # the processor's raw split skips them
            _read_equals_dict(envelope, want)
        else:
            assert envelope == want and list(envelope) == list(want)
            assert "metrics" not in want or want["metrics"].get("alert") or want["metrics"].get("recent")
    if any("metrics" in d and not d["metrics"].get("alert") for d in dicts):
        assert plain


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_pipeline_reads_the_same(name: str) -> None:
    """The pipeline given read_request's envelopes emits what it emits given the dicts (record by record,
    in chunks as the processor calls it), and ends in the same state."""
    events, settings = STREAMS[name]
    envelopes = events()
    values = [wire.prepare_batch(envelopes[i:i + 7]).request.SerializeToString()
              for i in range(0, len(envelopes), 7)]
    by_dict, by_read = Pipeline(settings), Pipeline(settings)
    for i in range(0, len(values), 5):
        dicts: List[Any] = []
        reads: List[Any] = []
        pts: List[Any] = []
        for value in values[i:i + 5]:
            d, p = decode_request(value)
            r, _p = read_request(value)
            dicts += d
            reads += r
            pts += p
        assert by_dict.process(dicts, pts) == by_read.process(reads, pts)
    assert by_dict.snapshot() == by_read.snapshot()


def test_read_plain_batch_cases() -> None:
    """Non-finite values, own steps, a nameless point, a zero value; an alert batch and a batch without a
    run id stay dicts."""
    from trainguard.core import events as ev

    ident = {"project": "p", "run_id": "r", "rank": 3, "world_size": 4}
    body = {"points": [{"name": "loss", "value": "NaN", "step": 7}, {"name": "grad/global_norm",
                                                                    "value": "Infinity"},
                       {"name": "lr", "value": 0.0, "step": 9}, {"name": "", "value": 1.0}]}
    plain = ev.envelope(ident, "metrics", body, step=5, time_unix_nano=1, event_id="e1")
    empty = ev.envelope(ident, "metrics", {"points": []}, step=6, time_unix_nano=2, event_id="e2")
    alert = ev.envelope(ident, "metrics", dict(body, alert="non_finite:loss"), step=5, time_unix_nano=3,
                        event_id="e3")
    no_run = ev.envelope(dict(ident, run_id=""), "metrics", body, step=5, time_unix_nano=4, event_id="e4")
    value = wire.prepare_batch([plain, empty, alert, no_run]).request.SerializeToString()
    got, points = read_request(value)
    generic = [wire.envelope_to_dict(m) for m in ingest_pb2.IngestRequest.FromString(value).events]
    _read_equals_dict(got[0], generic[0])
    _read_equals_dict(got[1], generic[1])
    assert generic[1]["metrics"] == {} and "points" not in got[1].body and points[1] == []
    assert got[2] == generic[2] and got[3] == generic[3]
    assert [(n, s) for n, s, _v in points[0]] == [("loss", 7), ("grad/global_norm", 5), ("lr", 9)]
    with pytest.raises(KeyError):
        got[0].raw["exception"]
