"""The query API over real recorded runs: answers, pagination, precise 4xx, and tenant isolation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from fastapi.testclient import TestClient

from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_server.api.app import create_app
from trainguard_server.api.deps import Services
from trainguard_server.config import Settings
from trainguard_server.gateway.http import ingest_router
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.storage.memory import (
    MemoryEventStore,
    MemoryIncidentStore,
    MemoryMetricStore,
    MemoryProjectStore,
)

STREAMS = Path(__file__).resolve().parents[2] / "fixtures" / "streams"


def _load(name: str, project: str) -> List[Dict[str, Any]]:
    events = []
    for line in (STREAMS / f"{name}.jsonl").read_text().splitlines():
        event = json.loads(line)
        event["project"] = project
        events.append(event)
    return events


class World:
    """Two projects' worth of real runs, ingested through the gateway and processed."""

    def __init__(self) -> None:
        self.projects = MemoryProjectStore()
        self.queue = MemoryQueue()
        self.services = Services(events=MemoryEventStore(), metrics=MemoryMetricStore(),
                                 incidents=MemoryIncidentStore(), projects=self.projects, queue=self.queue)
        settings = Settings(max_past_age_s=10 * 365 * 86400.0)  # the recorded streams are from the past
        self.gateway = Gateway(self.queue, self.projects, settings)
        self.processor = EmbeddedProcessor(self.queue, self.services.events, self.services.metrics,
                                           self.services.incidents)
        self.services.gateway = self.gateway
        self.services.processor = self.processor
        self.services.settings = settings
        self.tokens: Dict[str, Dict[str, str]] = {}
        for project in ("alpha", "beta"):
            self.tokens[project] = {kind: self.projects.create_token(project, kind)
                                    for kind in ("ingest", "read")}
        self.ingest("alpha", ["healthy", "diverging", "crashing"])
        self.ingest("beta", ["crashing_2rank"])
        self.client = TestClient(create_app(self.services, ingest_router(self.gateway)))

    def ingest(self, project: str, names: List[str]) -> None:
        for name in names:
            request = ingest_pb2.IngestRequest(
                events=[wire.envelope_from_dict(e) for e in _load(name, project)])
            result = self.gateway.ingest(self.tokens[project]["ingest"], request)
            assert not result.rejected, result.rejected
        self.processor.drain()

    def get(self, path: str, project: str = "alpha", kind: str = "read", **params: Any) -> Any:
        return self.client.get(path, params=params,
                               headers={"Authorization": f"Bearer {self.tokens[project][kind]}"})


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    yield World()


def test_runs_incidents_and_clusters_of_real_runs(world: World) -> None:
    runs = {r["run_name"].split("-")[-1] if r["run_name"] else r["run_id"]: r
            for r in world.get("/api/v1/runs").json()["items"]}
    statuses = sorted(r["status"] for r in runs.values())
    assert statuses == ["failed", "finished", "finished"]
    incidents = world.get("/api/v1/incidents").json()["items"]
    kinds = sorted(f"{i['category']}/{i['subtype']}" for i in incidents)
    assert kinds == ["gradient/explosion", "process/exception"]
    one = world.get(f"/api/v1/incidents/{incidents[0]['incident_id']}").json()
    assert one["evidence"] and one["timeline"] and one["checks"]
    [cluster] = world.get("/api/v1/clusters").json()["items"]
    assert world.get(f"/api/v1/clusters/{cluster['fingerprint']}").json()["count"] == 1


def test_metrics_are_downsampled_keeping_spikes_and_non_finite_values(world: World) -> None:
    [diverging] = [r for r in world.get("/api/v1/runs").json()["items"] if "diverging" in r["run_name"]]
    body = world.get(f"/api/v1/runs/{diverging['run_id']}/metrics", names="loss", max_points=5).json()
    buckets = body["series"]["loss"]["0"]
    assert 1 <= len(buckets) <= 5
    assert sum(b["nonfinite"] for b in buckets) >= 1
    full = world.get(f"/api/v1/runs/{diverging['run_id']}/metrics", names="loss", max_points=10_000).json()
    finite_max = max(b["max"] for b in full["series"]["loss"]["0"] if isinstance(b["max"], float))
    assert max(b["max"] for b in buckets if isinstance(b["max"], float)) == finite_max  # the spike survives


def test_pagination_is_complete_and_stable(world: World) -> None:
    seen: List[str] = []
    cursor = None
    while True:
        page = world.get("/api/v1/runs", limit=1, **({"cursor": cursor} if cursor else {})).json()
        seen.extend(r["run_id"] for r in page["items"])
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) == 3


@pytest.mark.parametrize("path,params,status,detail", [
    ("/api/v1/runs", {"cursor": "garbage"}, 400, "invalid cursor"),
    ("/api/v1/runs", {"status": "exploded"}, 400,
     "status must be one of running, finished, failed, stalled, lost"),
    ("/api/v1/runs", {"limit": 0}, 422, "query.limit: Input should be greater than or equal to 1"),
    ("/api/v1/runs", {"limit": 10**6}, 422, "query.limit: Input should be less than or equal to 500"),
    ("/api/v1/runs/nope", {}, 404, "run 'nope' not found"),
    ("/api/v1/runs/nope/metrics", {}, 404, "run 'nope' not found"),
    ("/api/v1/incidents/nope", {}, 404, "incident 'nope' not found"),
    ("/api/v1/clusters/nope", {}, 404, "cluster 'nope' not found"),
    ("/api/v1/search", {"q": "a OR b"}, 400, None),
    ("/api/v1/search", {}, 422, "query.q: Field required"),
])
def test_bad_queries_get_precise_errors(world: World, path: str, params: Dict[str, Any], status: int,
                                        detail: Any) -> None:
    response = world.get(path, **params)
    assert response.status_code == status, response.text
    if detail is not None:
        assert response.json()["detail"] == detail
    else:
        assert response.json()["detail"]


def test_metrics_query_bounds(world: World) -> None:
    run_id = world.get("/api/v1/runs").json()["items"][0]["run_id"]
    huge = world.get(f"/api/v1/runs/{run_id}/metrics", max_points=10**9)
    assert huge.status_code == 422
    assert huge.json()["detail"] == "query.max_points: Input should be less than or equal to 10000"
    backwards = world.get(f"/api/v1/runs/{run_id}/metrics", start_step=10, end_step=2)
    assert (backwards.status_code, backwards.json()["detail"]) == (400, "end_step must be >= start_step")


@pytest.mark.parametrize("headers,status,detail", [
    ({}, 401, "missing Authorization: Bearer <read token>"),
    ({"Authorization": "Basic abc"}, 401, "Authorization must be 'Bearer <read token>'"),
    ({"Authorization": "Bearer tg_read_0000000000000000_" + "0" * 48}, 401, "unknown or revoked token"),
])
def test_tokens_are_required(world: World, headers: Dict[str, str], status: int, detail: str) -> None:
    response = world.client.get("/api/v1/runs", headers=headers)
    assert (response.status_code, response.json()["detail"]) == (status, detail)


def test_an_ingest_token_cannot_read(world: World) -> None:
    response = world.get("/api/v1/runs", kind="ingest")
    assert (response.status_code, response.json()["detail"]) == (
        403, "ingest tokens cannot read; use a read token")


def test_tenant_isolation(world: World) -> None:
    alpha_runs = [r["run_id"] for r in world.get("/api/v1/runs").json()["items"]]
    beta_runs = [r["run_id"] for r in world.get("/api/v1/runs", project="beta").json()["items"]]
    assert alpha_runs and beta_runs and not set(alpha_runs) & set(beta_runs)
    for run_id in alpha_runs:
        assert world.get(f"/api/v1/runs/{run_id}", project="beta").status_code == 404
        assert world.get(f"/api/v1/runs/{run_id}/metrics", project="beta").status_code == 404
        assert world.get(f"/api/v1/runs/{run_id}/incidents", project="beta").status_code == 404
        assert world.get(f"/api/v1/runs/{run_id}/events", project="beta").status_code == 404
    for incident in world.get("/api/v1/incidents").json()["items"]:
        assert world.get(f"/api/v1/incidents/{incident['incident_id']}", project="beta").status_code == 404
    beta_incidents = world.get("/api/v1/incidents", project="beta").json()["items"]
    assert {i["run_id"] for i in beta_incidents} <= set(beta_runs)
    for cluster in world.get("/api/v1/clusters").json()["items"]:
        fingerprint = cluster["fingerprint"]
        beta_view = world.get(f"/api/v1/clusters/{fingerprint}", project="beta")
        # the same code crashed in both projects: each sees only its own runs
        if beta_view.status_code == 200:
            assert not set(beta_view.json()["runs"]) & set(alpha_runs)
    hits = world.get("/api/v1/search", project="beta", q="shapes").json()["items"]
    assert hits and {h["event"]["run_id"] for h in hits} <= set(beta_runs)


def test_health_metrics_and_openapi(world: World) -> None:
    assert world.client.get("/healthz").json() == {"status": "ok"}
    text = world.client.get("/metrics").text
    for name in ("trainguard_ingest_events_total", "trainguard_queue_depth",
                 "trainguard_processed_events_total", "trainguard_processing_lag_seconds"):
        assert f"\n{name}" in "\n" + text
    spec = world.client.get("/openapi.json").json()
    assert "/api/v1/runs/{run_id}/metrics" in spec["paths"] and "/v1/ingest" in spec["paths"]


def test_readyz_reflects_the_processor(world: World) -> None:
    assert world.client.get("/readyz").status_code == 503  # the module's processor is drained by hand
    assert "processor thread is not running" in world.client.get("/readyz").json()["problems"]
    world.processor.start()
    try:
        assert world.client.get("/readyz").json() == {"status": "ready"}
    finally:
        world.processor.stop()


def test_an_expired_token_is_refused_with_when(world: World) -> None:
    token = world.projects.create_token("alpha", "read", expires_ns=1_700_000_000 * 10**9)
    response = world.client.get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 401
    assert response.json()["detail"] == "token expired at 2023-11-14T22:13:20Z: create a new one"
