"""The processor hands the gateway's per-project backlog (its ``processed`` hook) ``backlog_counts``: a
chunk's events per project, a plain metric batch weighed by its point count instead of by its rendered JSON
mapping. It equals what ``dict_weight`` gives over the envelopes' JSON mappings, and what the gateway
admitted (``weight`` of each message), on every recorded stream and on batches with no points, nameless
points and many points; and a processor with the hook releases exactly what the gateway admitted."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping

import pytest

from tests.engine.test_pipeline_golden import streams
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine.pipeline import ReadEnvelope
from trainguard_server.gateway.backlog import ProjectBacklog, dict_weight, weight
from trainguard_server.processor.decode import read_request
from trainguard_server.processor.embedded import EmbeddedProcessor, backlog_counts
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.storage.memory import MemoryEventStore, MemoryIncidentStore, MemoryMetricStore


def _counts(envelopes: Iterable[Mapping[str, Any]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for env in envelopes:  # the envelopes' JSON mappings, weighed one by one
        project = str(env.get("project", ""))
        out[project] = out.get(project, 0) + dict_weight(env)
    return out


def _as_mappings(envelopes: Iterable[Any]) -> List[Mapping[str, Any]]:
    return [e.raw if isinstance(e, ReadEnvelope) else e for e in envelopes]


def _admitted(value: bytes) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for env in ingest_pb2.IngestRequest.FromString(value).events:
        out[env.project] = out.get(env.project, 0) + weight(env)
    return out


def _odd_request() -> bytes:
    """Plain metric batches with no points, nameless points, 5,000 points; one with an alert (not plain)."""
    request = ingest_pb2.IngestRequest()
    shapes = [((), ""), (("", "loss", ""), ""), (tuple(f"m{k}" for k in range(5000)), ""), (("loss",), "nan"),
              (("a", "b"), "")]
    for i, (names, alert) in enumerate(shapes):
        env = request.events.add(event_id=f"e{i}", project="p2" if i % 2 else "p1", run_id="r", step=3,
                                 time_unix_nano=10**18 + i)
        env.metrics.SetInParent()
        for name in names:
            env.metrics.points.add(name=name, value=1.0)
        if alert:
            env.metrics.alert = alert
    return request.SerializeToString()


@pytest.mark.parametrize("name", sorted(streams()))
def test_backlog_counts_what_the_json_mappings_count(name: str) -> None:
    events, _settings = streams()[name]
    envelopes = events()
    for i in range(0, len(envelopes), 50):
        value = wire.prepare_batch(envelopes[i:i + 50]).request.SerializeToString()
        read, _points = read_request(value)
        assert backlog_counts(read) == _counts(_as_mappings(read)) == _admitted(value)


def test_odd_batches_count_as_their_mappings_and_as_the_gateway_admits() -> None:
    value = _odd_request()
    read, _points = read_request(value)
    assert sum(isinstance(e, ReadEnvelope) for e in read) == 4
    got = backlog_counts(read)
    assert got == _counts(_as_mappings(read)) == _admitted(value) == {"p1": 1 + 5000 + 2, "p2": 3 + 1}


def test_a_processor_releases_what_was_admitted() -> None:
    """Through a processor (memory stores): every admitted event is released once processed."""
    queue = MemoryQueue()
    backlog = ProjectBacklog(1_000_000, 1.0, queue.depth)
    value = _odd_request()
    for project, n in _admitted(value).items():
        assert backlog.admit(project, n) is None
    queue.publish("r", [value])
    processor = EmbeddedProcessor(queue, MemoryEventStore(), MemoryMetricStore(), MemoryIncidentStore(),
                                  processed=backlog.processed)
    processor.drain(timeout=10)
    assert backlog.waiting("p1") == 0 and backlog.waiting("p2") == 0
