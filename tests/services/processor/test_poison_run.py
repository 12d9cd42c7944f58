"""Issue 18, finding 1 through the embedded processor: a poison run of one project (LR 5e-324 -> 1.0, then a
NaN loss) must not stop the checkpoint -- and so the queue commits -- of every project; a run whose state
still cannot be serialised is quarantined (logged, on /metrics) while the others commit. Real SQLite queue
and stores, envelopes published through the real gateway."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.engine.test_pipeline_poison import healthy_run, poison_run
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_server.api.deps import Services
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.observability import render_prometheus
from trainguard_server.processor.embedded import PARTS_PREFIX, EmbeddedProcessor
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.sqlite import (
    SqliteEventStore,
    SqliteIncidentStore,
    SqliteMetricStore,
    SqliteProjectStore,
)

Event = Dict[str, Any]


class Backend:
    """The embedded backend's parts on one directory: queue, stores, a gateway with a token per project."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.queue = SqliteQueue(root / "queue.db")
        self.projects = SqliteProjectStore(root / "projects.db")
        self.events = SqliteEventStore(root / "events.db")
        self.metrics = SqliteMetricStore(root / "metrics.db")
        self.incidents = SqliteIncidentStore(root / "incidents.db")
        # the new-run rate limit off: these tests flood the *processor* with runs (its quotas are the subject)
        self.gateway = Gateway(self.queue, self.projects, Settings(max_past_age_s=10 * 365 * 86400.0,
                                                                   project_new_runs_per_s=0))
        self.tokens: Dict[str, str] = {}

    def publish(self, events: List[Event], per_request: int = 10) -> None:
        """Each project's events with its own token, ``per_request`` envelopes a request."""
        for project in dict.fromkeys(e["project"] for e in events):
            mine = [e for e in events if e["project"] == project]
            if project not in self.tokens:
                self.tokens[project] = self.projects.create_token(project, "ingest")
            for i in range(0, len(mine), per_request):
                request = ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(e)
                                                           for e in mine[i:i + per_request]])
                assert not self.gateway.ingest(self.tokens[project], request).rejected

    def processor(self) -> EmbeddedProcessor:
        return EmbeddedProcessor(self.queue, self.events, self.metrics, self.incidents, snapshot_every_s=0.0)

    def close(self) -> None:
        for part in (self.queue, self.projects, self.events, self.metrics, self.incidents):
            part.close()


@pytest.fixture
def backend(tmp_path: Path) -> Any:
    b = Backend(tmp_path)
    yield b
    b.close()


def _now(events: List[Event]) -> List[Event]:
    """The events shifted to end now (the gateway refuses events from the future)."""
    import time

    shift = time.time_ns() - 60 * 10**9 - max(e["time_unix_nano"] for e in events)
    return [dict(e, time_unix_nano=e["time_unix_nano"] + shift) for e in events]


def _interleaved() -> Tuple[List[Event], List[Event]]:
    return _now(poison_run("hostile", "poison")), _now(healthy_run("calm", "calm"))


def test_a_poison_run_does_not_stop_the_checkpoint_of_every_project(backend: Backend) -> None:
    poison, calm = _interleaved()
    backend.publish(poison)
    backend.publish(calm)
    processor = backend.processor()
    processor.drain(30)
    processor.checkpoint()  # raised ValueError before the fix: nothing committed, for any project
    assert backend.queue.depth() == 0
    (incident,) = backend.incidents.list_incidents("hostile").items
    assert incident.trigger["lr_growth"] == "Infinity"
    saved = backend.incidents.state_keys(PARTS_PREFIX)
    assert any("calm" in k for k in saved) and any("poison" in k for k in saved)
    # a restart continues from the saved state: nothing is redelivered, both runs are known
    again = backend.processor()
    assert again.pipeline.run_state("calm", "calm") is not None
    assert again.pipeline.run_state("hostile", "poison") is not None
    assert again.run_once(0.0) == 0


def test_a_run_that_cannot_be_serialised_is_quarantined_logged_and_counted(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    poison, calm = _interleaved()
    backend.publish(poison[:-1] + calm[:-1])
    processor = backend.processor()
    processor.drain(30)
    state = processor.pipeline.run_state("hostile", "poison")
    assert state is not None
    state.ranks[0].detectors["probe"] = {"ratio": float("inf")}  # a compute site a future bug leaves raw
    backend.publish([poison[-1], calm[-1]])  # both runs change: both are due at the next checkpoint
    with caplog.at_level(logging.ERROR, logger="trainguard.processor"):
        processor.drain(30)
        processor.checkpoint()
    assert backend.queue.depth() == 0  # every project's records committed
    assert any("'poison'" in r.getMessage() and "quarantined" in r.getMessage() for r in caplog.records)
    text = render_prometheus(Services(events=backend.events, metrics=backend.metrics,
                                      incidents=backend.incidents, projects=backend.projects,
                                      queue=backend.queue, processor=processor))
    assert "trainguard_runs_quarantined_total 1.0" in text
    # its incident is kept; the calm run's state is saved and restored
    assert [i.subtype for i in backend.incidents.list_incidents("hostile").items] == ["non_finite"]
    again = backend.processor()
    assert again.pipeline.run_state("calm", "calm") is not None
    assert again.pipeline.run_state("hostile", "poison") is None
