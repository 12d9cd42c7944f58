"""The gateway reads a request's metric point names from a second, names-only parse (gateway/point_names.py)
instead of a Python object per point; the per-run name bound and the points-counted backlog must see exactly
what the envelopes hold. Checked on the recorded SDK streams (tests/fixtures/streams) plus the wire's odd
cases, and through ``trainguard serve`` at the fast paths' edges: a request whose envelopes all share one
name tuple taking a run exactly to its bound (accepted) and one past it (refused), and that same tuple again
after its run was forgotten (counted again from the metric store)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from tests.services.gateway.embedded_server import event, live_server
from trainguard import wire
from trainguard.v1 import events_pb2, ingest_pb2
from trainguard_server.gateway.backlog import weight
from trainguard_server.gateway.ingest import join_events
from trainguard_server.gateway.point_names import PointNames

STREAMS = Path(__file__).resolve().parents[2] / "fixtures" / "streams"


def _recorded() -> List[events_pb2.Envelope]:
    out = []
    for path in sorted(STREAMS.glob("*.jsonl")):
        with path.open() as f:
            out += [wire.envelope_from_dict(json.loads(line)) for line in f if line.strip()]
    return out


def _odd() -> List[bytes]:
    """Serialized envelopes the SDK does not send but the wire allows."""
    empty = events_pb2.Envelope(event_id="e", run_id="r")
    empty.metrics.SetInParent()                              # a metric batch of no points
    unnamed = events_pb2.Envelope(event_id="u", run_id="r")
    unnamed.metrics.points.add(value=1.0)                     # a point without a name
    unnamed.metrics.points.add(name="loss", value=2.0)
    alert = events_pb2.Envelope(event_id="a", run_id="r")
    alert.metrics.points.add(name="loss", value=float("nan"))
    alert.metrics.alert = "non_finite:loss"
    alert.metrics.recent.add(name="recent/only", value=1.0)  # context, not counted
    log = events_pb2.Envelope(event_id="l", run_id="r")
    log.log.message = "hello"
    metrics_then_log = alert.SerializeToString() + log.SerializeToString()  # merged; oneof: the log wins
    twice = events_pb2.Envelope(metrics={"points": [{"name": "x"}]}).SerializeToString() + \
        events_pb2.Envelope(metrics={"points": [{"name": "y"}]}).SerializeToString()  # merged: x, y
    return [e.SerializeToString() for e in (empty, unnamed, alert, log, events_pb2.Envelope())] + \
        [metrics_then_log, twice]


def test_shapes_hold_each_envelopes_names_and_weight() -> None:
    parts = [e.SerializeToString() for e in _recorded()] + _odd()
    raw = join_events(parts)
    request = ingest_pb2.IngestRequest.FromString(raw)
    assert request.events[-2].WhichOneof("payload") == "log"  # what the odd cases mean to the full parse
    assert [p.name for p in request.events[-1].metrics.points] == ["x", "y"]
    reader = PointNames()
    names_only = reader.names_only(raw)
    assert names_only is not None
    shapes = reader.split(names_only, len(parts))
    assert shapes is not None and len(shapes) == len(request.events)
    metric_batches = 0
    for envelope, shape in zip(request.events, shapes):
        got = reader.shape(shape)
        is_metrics = envelope.WhichOneof("payload") == "metrics"
        metric_batches += is_metrics
        assert got.metrics == is_metrics
        assert got.weight == weight(envelope)
        assert got.names == (tuple(p.name for p in envelope.metrics.points) if is_metrics else ())
    assert metric_batches > 100  # the recorded streams are mostly metric batches


def test_one_shape_for_a_request_is_recognised_and_only_then() -> None:
    def batch(names: List[str], n: int) -> bytes:
        return join_events([events_pb2.Envelope(event_id=f"{i}", metrics={"points": [
            {"name": x, "value": float(i)} for x in names]}).SerializeToString() for i in range(n)])

    reader = PointNames()
    first = reader.names_only(batch(["loss", "lr"], 3))
    assert first is not None and reader.uniform(first, 3) is None  # not seen yet
    shapes = reader.split(first, 3)
    assert shapes is not None and len(set(shapes)) == 1
    again = reader.names_only(batch(["loss", "lr"], 7))            # other values, another size
    assert again is not None and reader.uniform(again, 7) == shapes[0]
    other = reader.names_only(batch(["loss", "lr", "grad"], 7))
    assert other is not None and reader.uniform(other, 7) is None
    mixed = reader.names_only(join_events([events_pb2.Envelope(metrics={"points": [
        {"name": "loss"}, {"name": "lr"}]}).SerializeToString(), events_pb2.Envelope(
            metrics={"points": [{"name": "loss"}]}).SerializeToString()]))
    assert mixed is not None and reader.uniform(mixed, 2) is None


def _batch(run_id: str, names: List[str], step: int, n: int) -> List[Dict[str, Any]]:
    return [event(run_id, step * 100 + i, metrics={"points": [{"name": x, "value": 0.5} for x in names]})
            for i in range(n)]


def test_a_request_of_one_name_tuple_at_the_bound_and_past_it(tmp_path: Path) -> None:
    cap = 20
    with live_server(tmp_path, run_max_metric_names=cap) as live:
        base = [f"m{i:02d}" for i in range(cap - 3)]
        assert live.post_events(_batch("edge", base, 1, 50)).json()["accepted"] == 50
        assert live.post_events(_batch("edge", base, 2, 50)).json()["accepted"] == 50  # known: fast path
        exactly = [*base, "a", "b", "c"]                       # 20 names: exactly the bound
        r = live.post_events(_batch("edge", exactly, 3, 50)).json()
        assert r == {"accepted": 50, "duplicates": 0, "rejected": []}
        past = live.post_events(_batch("edge", [*base, "d"], 4, 30)).json()
        assert past["accepted"] == 0 and len(past["rejected"]) == 30
        assert {x["code"] for x in past["rejected"]} == {"too_many_metric_names"}
        assert past["rejected"][0]["message"] == (
            "events[0].metrics: run 'edge' has 20 distinct metric names and this event adds 1 new name ('d'), "
            "past the 20 a run may have (TRAINGUARD_RUN_MAX_METRIC_NAMES); nothing of this event was queued. "
            "Events naming only the run's metrics so far are accepted")
        assert live.post_events(_batch("edge", exactly, 5, 50)).json()["accepted"] == 50
        assert live.post_events(_batch("edge", exactly, 6, 50)).json()["accepted"] == 50  # the last shape
        assert len(live.post_events(_batch("edge", [*exactly, "e"], 7, 2)).json()["rejected"]) == 2
        assert live.server.gateway is not None
        assert live.server.gateway.metric_names.names("default", "edge") == cap


def test_the_same_name_tuple_after_its_run_was_forgotten_is_counted_from_the_store(tmp_path: Path) -> None:
    names = [f"n{i}" for i in range(4)]
    # room for about one run's names (each: its length + 80): the next run makes the first forgotten
    with live_server(tmp_path, run_max_metric_names=5, metric_names_memory_bytes=4 * 82 + 10) as live:
        gateway = live.server.gateway
        assert gateway is not None
        assert live.post_events(_batch("first", names, 1, 20)).json()["accepted"] == 20
        live.wait_for(lambda: len(live.get("/api/v1/runs/first/metrics/summary").json()) == 4)
        assert live.post_events(_batch("second", names, 1, 20)).json()["accepted"] == 20  # the same tuple
        assert gateway.metric_names.names("default", "first") == 0  # forgotten
        # the tuple the shape cache holds for 'first': admitted, and its run is counted again from the store
        assert live.post_events(_batch("first", names, 2, 20)).json()["accepted"] == 20
        assert gateway.metric_names.names("default", "first") == 4
        over = live.post_events(_batch("first", [*names, "p", "q"], 3, 5)).json()
        assert over["accepted"] == 0 and "has 4 distinct metric names" in over["rejected"][0]["message"]
