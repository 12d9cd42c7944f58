"""Gate baselines per project (stop 44): a project holds at most ``project_max_baselines`` (a new name past it
is 409 naming the setting; redefining one is always allowed), one can be deleted (``DELETE
/api/v1/baselines/{name}``: 204, then 404), and a baseline name with a '/' reaches no other project's
baseline: project ``t``'s ``x/y`` was the store key of project ``t/x``'s ``y``, and ``POST /api/v1/gate``
with it resolved the other tenant's baseline and went on to the candidate (reason: "still running")."""

from __future__ import annotations

from typing import Any, Dict, Iterator

import httpx
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server

LIMIT = 3


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("baseline-tenants"), project_max_baselines=LIMIT) as server:
        r = server.post_events([event("base-run", step) for step in range(3)])
        assert r.status_code == 200, r.text
        server.wait_for(lambda: server.get("/api/v1/runs/base-run").status_code == 200)
        yield server


def _put(live: LiveServer, name: str, headers: Dict[str, str], run: str = "base-run") -> httpx.Response:
    return live.client.put(f"/api/v1/baselines/{name}", json={"runs": [run]}, headers=headers)


def _names(live: LiveServer) -> Any:
    r = live.get("/api/v1/baselines", limit=500)
    assert r.status_code == 200, r.text
    return [b["name"] for b in r.json()["items"]]


def test_a_project_holds_at_most_its_bound_and_deleting_one_makes_room(live: LiveServer) -> None:
    for k in range(LIMIT):
        assert _put(live, f"keep-{k}", live.read_headers).status_code == 200
    r = _put(live, "one-too-many", live.read_headers)  # was: stored, without bound
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert f"project_max_baselines={LIMIT}" in detail and "TRAINGUARD_PROJECT_MAX_BASELINES" in detail, detail
    assert "DELETE /api/v1/baselines/" in detail, detail
    assert "one-too-many" not in _names(live)
    assert _put(live, "keep-0", live.read_headers).status_code == 200  # redefining one is always allowed
    r = live.client.delete("/api/v1/baselines/keep-1", headers=live.read_headers)
    assert r.status_code == 204, r.text
    assert live.client.delete("/api/v1/baselines/keep-1", headers=live.read_headers).status_code == 404
    assert live.get("/api/v1/baselines/keep-1").status_code == 404
    assert _put(live, "one-more", live.read_headers).status_code == 200
    assert sorted(_names(live)) == ["keep-0", "keep-2", "one-more"]


def test_deleting_needs_a_token_of_the_project(live: LiveServer) -> None:
    other = live.server.stores.projects.create_token("baseline-other", "read")
    headers = {"Authorization": f"Bearer {other}"}
    assert live.client.delete("/api/v1/baselines/keep-2", headers=headers).status_code == 404
    assert live.client.delete("/api/v1/baselines/keep-2").status_code == 401
    assert "keep-2" in _names(live)


def test_a_name_with_a_slash_reaches_no_other_projects_baseline(live: LiveServer) -> None:
    projects = live.server.stores.projects
    ingest_sub = projects.create_token("t/x", "ingest")
    sub = {"Authorization": f"Bearer {projects.create_token('t/x', 'read')}"}
    parent = {"Authorization": f"Bearer {projects.create_token('t', 'read')}"}
    r = live.client.post("/v1/ingest", json={"events": [event("sub-run", step) for step in range(3)]},
                         headers={"Authorization": f"Bearer {ingest_sub}"})
    assert r.status_code == 200, r.text
    live.wait_for(lambda: live.client.get("/api/v1/runs/sub-run", headers=sub).status_code == 200)
    ingest_parent = projects.create_token("t", "ingest")
    r = live.client.post("/v1/ingest", json={"events": [event("parent-run", step) for step in range(3)]},
                         headers={"Authorization": f"Bearer {ingest_parent}"})
    assert r.status_code == 200, r.text
    live.wait_for(lambda: live.client.get("/api/v1/runs/parent-run", headers=parent).status_code == 200)
    assert _put(live, "y", sub, run="sub-run").status_code == 200  # project t/x's baseline y
    r = live.client.post("/api/v1/gate", json={"baseline": "x/y", "candidate": "parent-run"}, headers=parent)
    assert r.status_code == 200, r.text
    verdict = r.json()
    assert verdict["verdict"] == "undecided" and "no baseline 'x/y'" in verdict["reason"], verdict
    assert not verdict["plot"], verdict
