"""One project cannot queue more than TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS events ahead of the processor: a
tenant flooding faster than the processor works is answered 429 (nothing of the refused request queued)
while another project's events are still admitted, and the flood's events are admitted again once the
processor caught up -- nothing acknowledged is lost (docs/security.md: one project's backlog delayed another's
NaN-loss incident from 0.4 s to ~28 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from tests.services.gateway.embedded_server import event, live_server
from trainguard_server.gateway.backlog import ProjectBacklog


def test_the_count_admits_up_to_the_bound_per_project_and_releases_what_was_processed() -> None:
    depth = [5]
    backlog = ProjectBacklog(limit=10, retry_after_s=1.5, depth=lambda: depth[0])
    assert backlog.admit("a", 8) is None and backlog.waiting("a") == 8
    assert backlog.admit("a", 3) == 1.5 and backlog.waiting("a") == 8   # refused: counts nothing
    assert backlog.admit("b", 10) is None                                # another project's own bound
    assert backlog.admit("a", 2) is None and backlog.waiting("a") == 10
    backlog.processed({"a": 4, "b": 10})  # what the processor hands it: a chunk's events per project
    assert (backlog.waiting("a"), backlog.waiting("b")) == (6, 0)
    assert backlog.admit("b", 500) is None  # nothing waiting: one request larger than the bound goes alone
    assert backlog.admit("b", 1) == 1.5
    backlog.release("b", 10_000)
    assert backlog.waiting("b") == 0        # never below zero
    assert backlog.admit("c", 30) is None and backlog.full("c") and not backlog.full("a")
    depth[0] = 0                            # the queue is empty: what is counted can only be stale
    assert backlog.admit("a", 9) is None and backlog.waiting("a") == 9
    assert not backlog.full("c") and backlog.waiting("c") == 0
    assert ProjectBacklog(limit=0, retry_after_s=1.0, depth=lambda: 1).admit("a", 10**9) is None  # off


def _post(live: Any, token: str, events: List[Dict[str, Any]]) -> Any:
    return live.client.post("/v1/ingest", content=json.dumps({"events": events}).encode(),
                            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def test_a_flooding_project_is_held_at_its_bound_while_another_is_admitted(tmp_path: Path) -> None:
    with live_server(tmp_path / "data", project_max_backlog_events=60) as live:
        server = live.server
        other = server.stores.projects.create_token("other", "ingest")
        processor = server.processor
        assert processor is not None
        with processor._lock:  # the processor is busy elsewhere: nothing leaves the queue meanwhile
            assert _post(live, live.ingest_token, [event("flood", i) for i in range(50)]).status_code == 200
            refused = _post(live, live.ingest_token, [event("flood", i) for i in range(50, 70)])
            assert refused.status_code == 429, refused.text
            assert "has 50 events waiting for the processor, at most 60" in refused.json()["detail"]
            assert "TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS" in refused.json()["detail"]
            assert int(refused.headers["Retry-After"]) >= 1
            assert _post(live, other, [event("healthy", i) for i in range(40)]).status_code == 200
            assert _post(live, live.ingest_token, [event("flood", i) for i in range(50, 60)]).status_code == 200
            at_bound = live.client.post("/v1/ingest", content=b"{not json", headers={
                "Authorization": f"Bearer {live.ingest_token}", "Content-Type": "application/json"})
            assert at_bound.status_code == 429, at_bound.text  # refused before its body is even decoded
        assert "trainguard_ingest_backlog_limited_total 2" in live.client.get("/metrics").text
        # the processor caught up: the refused request, sent again, is admitted
        live.wait_for(lambda: _post(live, live.ingest_token,
                                    [event("flood", i) for i in range(50, 70)]).status_code == 200)

        def steps(run: str) -> int:
            answer = live.get(f"/api/v1/runs/{run}/metrics", names="loss", max_points=1000)
            if answer.status_code != 200:
                return -1
            return sum(b["count"] for by_rank in answer.json()["series"].values() for buckets in by_rank.values()
                       for b in buckets)

        live.wait_for(lambda: steps("flood") == 70)  # every acknowledged event of the flood, once
