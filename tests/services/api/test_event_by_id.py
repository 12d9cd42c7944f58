"""One event of a run by its id: ``GET /api/v1/runs/{run}/events/{event_id}``. An incident's evidence names
the event it rests on, and the dashboard's traceback panel looked for it in the first page of the run's
exceptions (``limit=200``): since pages end at ``api_max_page_bytes`` (8 MiB, H26) a run with many fat
exceptions may hold it on a later page, and the panel then showed another exception. Scoped like every read:
another project's read token, another run, an unknown id all answer 404. Against ``trainguard serve``
(EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

from typing import Any, Dict, Iterator

import httpx
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server


def _exception(run_id: str, step: int, message: str) -> Dict[str, Any]:
    e = event(run_id, step, severity="ERROR")
    e.pop("metrics")
    e["exception"] = {"type": "RuntimeError", "message": message,
                      "frames": [{"filename": "/app/train.py", "module": "train", "function": "step",
                                  "lineno": 7, "in_app": True}]}
    return e


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def test_an_event_is_read_by_its_id_within_its_project_and_run(live: LiveServer) -> None:
    sent = [_exception("by-id", s, f"boom {s}") for s in range(3)]
    assert live.post_events(sent).json()["accepted"] == 3
    live.post_events([event("by-id-other", 0)])
    target = sent[1]["event_id"]
    live.wait_for(lambda: live.get(f"/api/v1/runs/by-id/events/{target}").status_code == 200)  # was 404 (no route)
    body = live.get(f"/api/v1/runs/by-id/events/{target}").json()
    assert (body["event_id"], body["run_id"], body["kind"], body["step"]) == (target, "by-id", "exception", 1)
    assert body["payload"]["exception"]["message"] == "boom 1" and "boom 1" in body["text"]
    # the same shape as the run's page of events gives it
    listed = [e for e in live.get("/api/v1/runs/by-id/events", kinds="exception").json()["items"]
              if e["event_id"] == target]
    assert listed == [body]
    # another run, an unknown id, another project: 404 (nothing said about the event); no token: 401
    live.wait_for(lambda: live.get("/api/v1/runs/by-id-other").status_code == 200)
    r = live.get(f"/api/v1/runs/by-id-other/events/{target}")
    assert (r.status_code, r.json()) == (404, {"detail": f"event {target!r} not found"})
    assert live.get("/api/v1/runs/by-id/events/nope").status_code == 404
    assert live.get("/api/v1/runs/nope/events/" + target).status_code == 404
    assert live.get("/api/v1/runs/by-id/events/" + "x" * 5000).status_code == 404
    other = live.server.stores.projects.create_token("other", "read")
    r = live.client.get(f"/api/v1/runs/by-id/events/{target}", headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 404
    assert httpx.get(f"{live.url}/api/v1/runs/by-id/events/{target}").status_code == 401
    ingest = live.client.get(f"/api/v1/runs/by-id/events/{target}",
                             headers={"Authorization": f"Bearer {live.ingest_token}"})
    assert ingest.status_code == 403
