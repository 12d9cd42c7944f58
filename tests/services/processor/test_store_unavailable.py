"""A store unavailable (DESIGN §6 failure paths, issue 5 "Faults"): the processor backs off, commits
nothing it could not store, and when the store is back it processes those records -- each event stored
exactly once, the verdict unchanged. Against the real Elasticsearch API (noida-db), stopped and restarted
mid-stream; the queue is the embedded SQLite one, read back after the processor's own commits."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.elasticsearch import NoidaElasticsearch
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.elasticsearch import ElasticsearchEventStore
from trainguard_server.storage.sqlite import SqliteIncidentStore, SqliteMetricStore, SqliteProjectStore

STREAM = Path(__file__).resolve().parents[2] / "scenarios" / "streams" / "crash.jsonl"


def test_an_unavailable_event_store_delays_processing_and_loses_nothing(tmp_path: Path) -> None:
    elastic = NoidaElasticsearch(tmp_path / "es").start()
    port = elastic.port
    events_store = ElasticsearchEventStore(hosts=[elastic.url], index_prefix="fault", replicas=0,
                                           max_retries=1, initial_backoff_s=0.05, max_backoff_s=0.1,
                                           request_timeout=2.0)
    queue = SqliteQueue(tmp_path / "queue.db")
    projects = SqliteProjectStore(tmp_path / "projects.db")
    processor = EmbeddedProcessor(queue, events_store, SqliteMetricStore(tmp_path / "metrics.db"),
                                  SqliteIncidentStore(tmp_path / "incidents.db"), snapshot_every_s=0.0)
    gateway = Gateway(queue, projects, Settings(max_past_age_s=10 * 365 * 86400.0))
    token = projects.create_token("p", "ingest")
    envelopes = [json.loads(line) for line in STREAM.read_text().splitlines() if line.strip()]
    for e in envelopes:
        e["project"] = "p"
    raw = [e for e in envelopes if "exception" in e or "lifecycle" in e or "log" in e]
    assert raw  # the crash's exception and lifecycle events are raw context
    try:
        elastic.stop()  # the store goes away before anything is processed
        result = gateway.ingest(token, ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(e)
                                                                         for e in envelopes]))
        assert not result.rejected
        depth = queue.depth()
        assert depth > 0
        failed = 0
        for _ in range(3):
            try:
                processor.run_once(timeout=0.1)
            except Exception:
                failed += 1
        assert failed >= 1 and processor.stats.events == 0
        processor.checkpoint()
        assert queue.depth() == depth  # nothing committed while the store was away
        assert processor.incidents.list_incidents("p").items == []

        elastic = NoidaElasticsearch(tmp_path / "es", port=port).start()  # back, same address, same data
        deadline = time.monotonic() + 30
        while queue.depth() and time.monotonic() < deadline:
            try:
                processor.run_once(timeout=0.1)
            except Exception:
                pass
            processor.checkpoint()
        assert queue.depth() == 0
        assert processor.stats.store_retries >= 1
        for e in raw:  # every raw-context event stored, once
            assert events_store.get("p", e["event_id"]) is not None
        listed = events_store.list_for_run("p", envelopes[0]["run_id"], limit=1000).items
        assert sorted(ev.event_id for ev in listed) == sorted(e["event_id"] for e in raw)
        (incident,) = processor.incidents.list_incidents("p").items
        assert (incident.category, incident.subtype) == ("process", "exception")
    finally:
        events_store.close()
        queue.close()
        elastic.stop()  # the restarted server too (it outlived the test before)
