"""Which records a failed chunk retries (processor/embedded.py run_once / _round): a chunk whose raw writes
failed has not been through the pipeline and must be processed again; one whose upserts alone failed is
through it and only its output waits. Before stop 43 the decision read "an output is pending" as "this chunk
went through the pipeline", so an output left pending by an EARLIER failure (a Kafka rebalance's save that
could not apply it, caught and logged) made a chunk whose raw writes then failed count as through: not
retried, committed at the next checkpoint, never seen by detection (hR's review). Real SQLite queue and
stores; the failure is the event store's write raising."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import pytest

from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine.pipeline import PipelineOutput
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.processor.embedded import PARTITION, EmbeddedProcessor
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.sqlite import SqliteProjectStore, open_sqlite_stores

STREAM = Path(__file__).resolve().parents[2] / "scenarios" / "streams" / "crash.jsonl"


class _StoreDown(RuntimeError):
    pass


def _setup(tmp_path: Path) -> Any:
    queue = SqliteQueue(tmp_path / "queue.db")
    projects = SqliteProjectStore(tmp_path / "projects.db")
    gateway = Gateway(queue, projects, Settings(max_past_age_s=10 * 365 * 86400.0))
    token = projects.create_token("p", "ingest")
    envelopes: List[Any] = [json.loads(line) for line in STREAM.read_text().splitlines() if line.strip()]
    for e in envelopes:
        e["project"] = "p"
    for i in range(0, len(envelopes), 5):
        request = ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(e) for e in envelopes[i:i + 5]])
        assert not gateway.ingest(token, request).rejected
    projects.close()
    stores = open_sqlite_stores(tmp_path)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, batch=4,
                                  round_events=5, round_target_s=0.0, snapshot_every_s=1e9,
                                  tick_interval_s=1e15)
    return processor, queue, stores


@pytest.mark.parametrize("pending_before", [False, True], ids=["nothing-pending", "an-earlier-output-pending"])
def test_a_chunk_whose_raw_writes_failed_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    pending_before: bool) -> None:
    processor, queue, stores = _setup(tmp_path)
    try:
        records = queue.consume(4, 0.0)
        assert records
        if pending_before:  # left by an earlier failure the processor caught (a rebalance's save)
            processor._pending[PARTITION] = PipelineOutput()

        def down(*args: Any, **kwargs: Any) -> None:
            raise _StoreDown("event store unavailable")

        monkeypatch.setattr(processor, "_store_raw", down)
        with pytest.raises(_StoreDown):
            processor._round(records, True)
        assert [r.offset for r in processor._retry] == [r.offset for r in records]  # all of them again
        assert processor.stats.events == 0 and not processor._uncommitted  # nothing counted or committable
    finally:
        queue.close()
        stores.close()


def test_a_chunk_whose_upserts_alone_failed_is_not_run_through_the_pipeline_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    processor, queue, stores = _setup(tmp_path)
    try:
        records = queue.consume(4, 0.0)
        chunk = records[:1]

        def down() -> None:
            raise _StoreDown("incident store unavailable")

        monkeypatch.setattr(processor, "_apply_pending", down)
        with pytest.raises(_StoreDown):
            processor._round(chunk, True)
        assert processor._retry == [] and processor.stats.records == 1  # through: its output waits alone
    finally:
        queue.close()
        stores.close()
