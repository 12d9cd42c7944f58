"""A project's backlog counts a metric batch one per point: a project sending few envelopes of many points
each (20 runs x 5,000 metric names per step: 100,000 points per request, counted as 20 events) was never held
by TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS, and another project's NaN-loss incident waited 7-12 s behind it
(bench/state_inflation.py, loaded 2-core machine). Now such a project is answered 429 once its points reach
the bound, while another project is admitted, and what the processor worked is released point for point.
Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from tests.services.gateway.embedded_server import event, live_server
from trainguard.v1 import events_pb2
from trainguard_server.gateway.backlog import ProjectBacklog, dict_weight, weight


def _wide(run_id: str, step: int, points: int) -> Dict[str, Any]:
    return event(run_id, step, metrics={"points": [{"name": f"layer/{i:04d}", "value": 1.0}
                                                   for i in range(points)]})


def _post(live: Any, token: str, events: List[Dict[str, Any]]) -> Any:
    return live.client.post("/v1/ingest", content=json.dumps({"events": events}).encode(),
                            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def test_an_envelope_weighs_its_points_the_same_on_both_sides() -> None:
    wide = events_pb2.Envelope(event_id="a", run_id="r")
    wide.metrics.points.add(name="x", value=1.0)
    wide.metrics.points.add(name="y", value=2.0)
    assert weight(wide) == dict_weight({"metrics": {"points": [{"name": "x"}, {"name": "y"}]}}) == 2
    empty = events_pb2.Envelope(event_id="b", run_id="r")
    empty.metrics.SetInParent()
    assert weight(empty) == dict_weight({"metrics": {}}) == 1
    log = events_pb2.Envelope(event_id="c", run_id="r")
    log.log.message = "hello"
    assert weight(log) == dict_weight({"log": {"message": "hello"}}) == 1
    backlog = ProjectBacklog(limit=10, retry_after_s=1.0, depth=lambda: 1)
    assert backlog.admit("a", 8) is None
    backlog.processed({"a": dict_weight({"metrics": {"points": [{}] * 5}}) + dict_weight({"log": {}})})
    assert backlog.waiting("a") == 2


def test_a_project_of_wide_metric_batches_is_held_at_its_bound_in_points(tmp_path: Path) -> None:
    with live_server(tmp_path / "data", project_max_backlog_events=1000) as live:
        other = live.server.stores.projects.create_token("other", "ingest")
        processor = live.server.processor
        assert processor is not None
        with processor._lock:  # the processor is busy elsewhere: nothing leaves the queue meanwhile
            first = _post(live, live.ingest_token, [_wide(f"wide-{r}", 1, 100) for r in range(8)])
            assert first.status_code == 200 and first.json()["accepted"] == 8
            refused = _post(live, live.ingest_token, [_wide(f"wide-{r}", 2, 100) for r in range(3)])
            assert refused.status_code == 429, refused.text  # was 200: 11 events of a bound of 1,000
            assert refused.json()["detail"].startswith(
                "project 'default' has 800 events waiting for the processor, at most 1000 may "
                "(TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS; a metric batch counts one per point): nothing of this "
                "request was queued")
            assert _post(live, other, [_wide("healthy", 1, 100)]).status_code == 200
        # the processor worked the 800 points: the refused request, sent again, is admitted
        live.wait_for(lambda: _post(live, live.ingest_token,
                                    [_wide(f"wide-{r}", 2, 100) for r in range(3)]).status_code == 200)
