"""A filter value the API does not know is a 400 naming the values it knows, on every route that filters: a
typo (``status=opne``, ``kinds=exeption``) must not read as "nothing matched". Before (stop 41, found by
bench/hostile_probe.py), ``GET /api/v1/runs/{run}/incidents?status=<anything>`` and
``GET /api/v1/runs/{run}/events?kinds=<anything>`` answered 200 with an empty page, while
``/api/v1/incidents`` and ``/api/v1/runs`` already refused an unknown status. Against ``trainguard serve``
(EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server

live = module_live_server()


@pytest.fixture(scope="module")
def run(live: LiveServer) -> str:
    events = [event("filters", step) for step in range(4)]
    events.append(event("filters", 4, metrics={"points": [{"name": "loss", "value": "NaN"}]}))
    crash = event("filters", 5, exception={"type": "ValueError", "message": "boom"})
    del crash["metrics"]
    events.append(crash)
    assert live.post_events(events).json()["accepted"] == 6
    live.wait_for(lambda: bool(live.get("/api/v1/runs/filters/incidents").json().get("items")))
    live.wait_for(lambda: bool(live.get("/api/v1/runs/filters/events").json().get("items")))
    return "filters"


@pytest.mark.parametrize("value", ["opne", "NaN", "OPEN", "open,resolved", "x" * 500])
def test_an_unknown_incident_status_of_a_run_is_400(live: LiveServer, run: str, value: str) -> None:
    r = live.get(f"/api/v1/runs/{run}/incidents", status=value)
    assert r.status_code == 400, r.text  # was 200 with no items
    assert r.json()["detail"] == "status must be one of open, ongoing, resolved"


@pytest.mark.parametrize("value", ["exeption", "NaN", "exception,alert", "Exception", "unknown"])
def test_an_unknown_event_kind_is_400(live: LiveServer, run: str, value: str) -> None:
    r = live.get(f"/api/v1/runs/{run}/events", kinds=value)
    assert r.status_code == 400, r.text  # was 200 with no items
    detail = r.json()["detail"]
    assert detail.startswith("kinds: ") and "metrics, exception, lifecycle, heartbeat, log, memory" in detail


def test_known_values_still_filter(live: LiveServer, run: str) -> None:
    assert live.get(f"/api/v1/runs/{run}/incidents", status="open").json()["items"]
    assert live.get(f"/api/v1/runs/{run}/incidents", status="resolved").json()["items"] == []
    kinds = [e["kind"] for e in live.get(f"/api/v1/runs/{run}/events", kinds="exception, log").json()["items"]]
    assert kinds == ["exception"]
    assert live.get(f"/api/v1/runs/{run}/events", kinds="log").json()["items"] == []
    assert live.get(f"/api/v1/runs/{run}/events", kinds=",").status_code == 200  # no kind named: all
