"""Issue 18, finding 2 through the embedded processor: project B's 10,000 one-event runs must not evict
project A's live run -- A's later NaN still raises its incident -- and B hitting its quota is visible: a
counter on /metrics and a log line. Real SQLite queue and stores, events through the real gateway."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List

import pytest

from tests.services.processor.test_poison_run import Backend, backend  # noqa: F401 -- the fixture
from trainguard_server.api.deps import Services
from trainguard_server.observability import render_prometheus

Event = Dict[str, Any]


def metric(project: str, run: str, step: int, loss: Any, t: int) -> Event:
    return {"event_id": f"{project}-{run}-{step}", "project": project, "run_id": run, "step": step,
            "time_unix_nano": t, "metrics": {"points": [{"name": "loss", "value": loss}]}}


def test_another_projects_10000_tiny_runs_do_not_evict_a_live_run(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    t0 = time.time_ns() - 250 * 10**9  # the live run is well within lost_after_s (300 s)
    backend.publish([metric("A", "live", s, 2.0 / (1 + s), t0 + s * 10**9) for s in range(20)])
    backend.publish([metric("B", f"tiny-{i}", 0, 1.0, t0 + 100 * 10**9 + i) for i in range(10_000)],
                    per_request=2_000)
    processor = backend.processor()  # the default settings: max_runs 10,000
    with caplog.at_level(logging.WARNING, logger="trainguard.processor"):
        processor.drain(120)
    assert processor.pipeline.run_state("A", "live") is not None  # evicted before the fix
    backend.publish([metric("A", "live", 20, "NaN", t0 + 200 * 10**9)])
    processor.drain(30)
    processor.checkpoint()
    incidents: List[Any] = backend.incidents.list_incidents("A").items
    assert [(i.run_id, i.subtype) for i in incidents] == [("live", "non_finite")]  # nothing before the fix
    assert any("project 'B' hit its runs quota" in r.getMessage() for r in caplog.records)
    text = render_prometheus(Services(events=backend.events, metrics=backend.metrics,
                                      incidents=backend.incidents, projects=backend.projects,
                                      queue=backend.queue, processor=processor))
    assert 'trainguard_project_quota_evictions_total{project="B",quota="runs"} 1.0' in text
    assert 'project="A"' not in text
