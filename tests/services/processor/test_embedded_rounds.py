"""The embedded processor's rounds (issue 15): a consumer round is cut into chunks of at most
``round_events`` envelopes, each one pipeline call and one write per store; an output whose upsert failed
is applied before anything else and before a checkpoint commits its records. Real SQLite queue and stores,
a real recorded run (the corpus's crash) published through the real gateway."""

from __future__ import annotations

import gc
import json
import sqlite3
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine.extract import is_raw_context
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Cluster, Incident, RunRecord
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.processor.embedded import (
    GC_GEN0_THRESHOLD,
    PARTS_PREFIX,
    STATE_KEY,
    EmbeddedProcessor,
    tune_gc,
)
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.base import MetricColumns
from trainguard_server.storage.sqlite import (
    SqliteEventStore,
    SqliteIncidentStore,
    SqliteMetricStore,
    SqliteProjectStore,
)

STREAM = Path(__file__).resolve().parents[2] / "scenarios" / "streams" / "crash.jsonl"
PER_REQUEST = 7


class CountingMetrics(SqliteMetricStore):
    """The real SQLite metric store, counting its writes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.puts: List[int] = []

    def put_columns(self, columns: MetricColumns) -> None:  # what the processor calls (put calls it too)
        self.puts.append(columns.count)
        super().put_columns(columns)

    def put_columns_many(self, batches: Sequence[MetricColumns]) -> None:  # the write-behind's write
        self.puts.extend(columns.count for columns in batches if columns.count)
        super().put_columns_many(batches)  # one transaction (never calls put_columns)


class FlakyIncidents(SqliteIncidentStore):
    """The real SQLite incident store whose first ``failures`` incident upserts raise (a store away)."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path)
        self.failures = failures

    def upsert_records(self, runs: Sequence[RunRecord], incidents: Sequence[Incident],
                       clusters: Sequence[Cluster]) -> None:  # the processor's one write per round
        if incidents and self.failures > 0:
            self.failures -= 1
            raise ConnectionError("incident store unavailable")
        super().upsert_records(runs, incidents, clusters)


def _publish(tmp_path: Path, stream: Path = STREAM) -> Tuple[SqliteQueue, List[dict]]:  # type: ignore[type-arg]
    queue = SqliteQueue(tmp_path / "queue.db")
    projects = SqliteProjectStore(tmp_path / "projects.db")
    gateway = Gateway(queue, projects, Settings(max_past_age_s=10 * 365 * 86400.0))
    token = projects.create_token("p", "ingest")
    envelopes: List[Any] = [json.loads(line) for line in stream.read_text().splitlines() if line.strip()]
    for e in envelopes:
        e["project"] = "p"
    for i in range(0, len(envelopes), PER_REQUEST):  # several queue records
        request = ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(e)
                                                   for e in envelopes[i:i + PER_REQUEST]])
        assert not gateway.ingest(token, request).rejected
    projects.close()
    return queue, envelopes


@pytest.mark.parametrize("round_events", [1, 20, 100_000])
def test_a_round_is_cut_into_chunks_of_at_most_round_events(tmp_path: Path, round_events: int) -> None:
    queue, envelopes = _publish(tmp_path)
    metrics = CountingMetrics(tmp_path / "metrics.db")
    incidents = SqliteIncidentStore(tmp_path / "incidents.db")
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"), metrics, incidents, batch=10_000,
                                  round_events=round_events, snapshot_every_s=0.0)
    records = queue.depth()
    sizes = [len(envelopes[i:i + PER_REQUEST]) for i in range(0, len(envelopes), PER_REQUEST)]
    chunks, filled = 0, 0
    for size in sizes:  # greedy: a record is never split, one larger than round_events is a chunk alone
        if chunks == 0 or filled + size > round_events:
            chunks, filled = chunks + 1, 0
        filled += size
    assert processor.run_once(timeout=1.0) == records
    assert processor.stats.rounds == chunks
    assert processor.stats.events == len(envelopes)
    assert 0 < len(metrics.puts) <= processor.stats.rounds  # one write per chunk that has points
    assert sum(metrics.puts) == processor.stats.metric_points > 0
    (incident,) = incidents.list_incidents("p").items
    assert (incident.category, incident.subtype) == ("process", "exception")
    assert queue.depth() == 0  # checkpointed (snapshot_every_s=0) and committed
    queue.close()


class Watching(EmbeddedProcessor):
    """The embedded processor, noting when it decodes a record and when it processes a chunk."""

    log: List[Tuple[str, int]]

    def _decode(self, record: Any) -> Any:
        self.log.append(("decode", 1))
        return super()._decode(record)

    def _process(self, records: Any, *args: Any) -> None:
        self.log.append(("process", len(records)))
        super()._process(records, *args)


def test_a_round_decodes_each_chunk_just_before_it_runs(tmp_path: Path) -> None:
    """A round that took many records decodes them chunk by chunk: when a chunk runs, at most one record
    beyond it was decoded (the one that did not fit) -- a round's memory is bounded by round_events, not by
    how many records one consume handed out."""
    queue, envelopes = _publish(tmp_path)
    processor = Watching(queue, SqliteEventStore(tmp_path / "events.db"), SqliteMetricStore(tmp_path / "metrics.db"),
                         SqliteIncidentStore(tmp_path / "incidents.db"), batch=10_000, round_events=20,
                         snapshot_every_s=1e9, tick_interval_s=1e15)
    processor.log = []
    records = queue.depth()
    assert processor.run_once(timeout=1.0) == records > 3
    decoded = processed = 0
    for what, count in processor.log:
        if what == "decode":
            decoded += count
        else:
            processed += count
            assert decoded <= processed + 1
    assert processed == decoded == records and processor.stats.events == len(envelopes)
    queue.close()


def test_small_records_are_taken_until_a_round_holds_round_events(tmp_path: Path) -> None:
    """A full batch of records holding fewer than ``round_events`` envelopes is followed by more in the same
    round (one pipeline call and one write per store per ``round_events``, not per ``batch`` records)."""
    queue, envelopes = _publish(tmp_path)
    assert len(envelopes) > 3 * PER_REQUEST
    metrics = CountingMetrics(tmp_path / "metrics.db")
    incidents = SqliteIncidentStore(tmp_path / "incidents.db")
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"), metrics, incidents, batch=1,
                                  round_events=2 * PER_REQUEST + 1, snapshot_every_s=1e9,
                                  tick_interval_s=1e15)  # no timers: the recorded run's time is old
    # 7 + 7 envelopes stay under 15: a third record is taken, which starts a second chunk
    assert processor.run_once(timeout=1.0) == 3
    assert processor.stats.rounds == 2 and processor.stats.events == 3 * PER_REQUEST
    processor.drain(timeout=10)
    processor.checkpoint()
    assert processor.stats.events == len(envelopes) and queue.depth() == 0
    (incident,) = incidents.list_incidents("p").items
    assert (incident.category, incident.subtype) == ("process", "exception")
    queue.close()


class FailingOnce(SqliteQueue):
    """The real SQLite queue whose ``fail_at``-th consume raises (the database away for a moment)."""

    def __init__(self, path: Path, fail_at: int) -> None:
        super().__init__(path)
        self.calls, self.fail_at = 0, fail_at

    def consume(self, max_records: int, timeout: float) -> List[Any]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise sqlite3.OperationalError("disk I/O error")
        return super().consume(max_records, timeout)


def test_a_failing_consume_while_taking_more_keeps_the_records_taken(tmp_path: Path) -> None:
    """When a consume for more small records raises, the round processes what it took (the queue handed
    those out: skipping them would let a later checkpoint commit past them) and the error ends the taking."""
    _queue, envelopes = _publish(tmp_path)  # published; read back through a queue whose 2nd consume fails
    _queue.close()
    queue = FailingOnce(tmp_path / "queue.db", fail_at=2)
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),
                                  SqliteMetricStore(tmp_path / "metrics.db"),
                                  SqliteIncidentStore(tmp_path / "incidents.db"), batch=1,
                                  round_events=100_000, snapshot_every_s=1e9, tick_interval_s=1e15)
    assert processor.run_once(timeout=1.0) == 1 and processor.stats.events == PER_REQUEST
    processor.drain(timeout=10)
    processor.checkpoint()
    assert processor.stats.events == len(envelopes) and queue.depth() == 0
    queue.close()


def test_the_collector_rests_during_a_round_and_is_back_after_it_even_when_it_fails(tmp_path: Path) -> None:
    """The cyclic garbage collector is paused while a round's records go through the pipeline and the stores,
    and enabled again afterwards -- also when the round raises; a process that runs without it keeps it
    off."""
    during: List[bool] = []
    for name, failures in (("ok", 0), ("failing", 1), ("off", 0)):
        queue, _envelopes = _publish(tmp_path / name)
        processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / name / "events.db"),
                                      SqliteMetricStore(tmp_path / name / "metrics.db"),
                                      FlakyIncidents(tmp_path / name / "incidents.db", failures), batch=10_000,
                                      snapshot_every_s=1e9, tick_interval_s=1e15)
        processor.listeners.append(lambda _output: during.append(gc.isenabled()))
        if name == "off":
            gc.disable()
        try:
            if failures:
                with pytest.raises(ConnectionError):
                    processor.run_once(timeout=1.0)
            else:
                assert processor.run_once(timeout=1.0) > 0
            assert gc.isenabled() == (name != "off")
        finally:
            gc.enable()
        queue.close()
    assert during == [False, False]  # the round's output reached the stores (and listeners) inside it


def test_pause_gc_false_leaves_the_collector_running_during_a_round(tmp_path: Path) -> None:
    """``pause_gc=False`` (the policy overridden): the collector stays enabled inside the round too."""
    during: List[bool] = []
    queue, _envelopes = _publish(tmp_path)
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),
                                  SqliteMetricStore(tmp_path / "metrics.db"),
                                  SqliteIncidentStore(tmp_path / "incidents.db"), batch=10_000,
                                  snapshot_every_s=1e9, tick_interval_s=1e15, pause_gc=False)
    processor.listeners.append(lambda _output: during.append(gc.isenabled()))
    assert processor.run_once(timeout=1.0) > 0
    assert during == [True] and gc.isenabled()
    queue.close()


def test_tune_gc_raises_the_young_threshold_only() -> None:
    """``tune_gc`` sets the young generation's threshold to GC_GEN0_THRESHOLD (or the one given) when that
    is higher than the interpreter's, keeps the older generations' thresholds, and keeps a higher one (0:
    Python's kept)."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 11, 12)
        tune_gc()
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 11, 12)
        tune_gc(0)
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 11, 12)
        tune_gc(GC_GEN0_THRESHOLD * 2)
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD * 2, 11, 12)
        gc.set_threshold(700, 11, 12)
        tune_gc(0)
        assert gc.get_threshold() == (700, 11, 12)
    finally:
        gc.set_threshold(*before)


def test_raw_context_is_what_extract_says_metric_batches_with_an_alert_included(tmp_path: Path) -> None:
    """The event store gets exactly the envelopes ``extract.is_raw_context`` names -- the SDK's alert batches
    (a NaN's recent values) among them, the plain metric batches not -- and the metric store every point."""
    queue, envelopes = _publish(tmp_path, STREAM.with_name("nan_source.jsonl"))
    events = SqliteEventStore(tmp_path / "events.db")
    metrics = CountingMetrics(tmp_path / "metrics.db")
    processor = EmbeddedProcessor(queue, events, metrics, SqliteIncidentStore(tmp_path / "incidents.db"),
                                  snapshot_every_s=1e9, tick_interval_s=1e15)
    processor.drain(timeout=10)
    (run_id,) = {e["run_id"] for e in envelopes}
    stored = {e.event_id for e in events.list_for_run("p", run_id, limit=10_000).items}
    alerts = {e["event_id"] for e in envelopes if e.get("metrics", {}).get("alert")}
    assert alerts and alerts <= stored
    assert stored == {e["event_id"] for e in envelopes if is_raw_context(e)}
    assert sum(metrics.puts) == sum(len(e["metrics"].get("points", ())) for e in envelopes if "metrics" in e)
    queue.close()


def test_an_output_whose_upsert_failed_is_stored_once_the_store_is_back(tmp_path: Path) -> None:
    queue, _envelopes = _publish(tmp_path)
    incidents = FlakyIncidents(tmp_path / "incidents.db", failures=2)
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"), SqliteMetricStore(tmp_path / "metrics.db"), incidents,
                                  batch=10_000, snapshot_every_s=0.0)
    processor._back_off = lambda: None  # type: ignore[method-assign]  # retry at once (no sleeps here)
    depth = queue.depth()
    with pytest.raises(ConnectionError):
        processor.run_once(timeout=1.0)
    with pytest.raises(ConnectionError):  # a checkpoint must not commit what the stores lack
        processor.checkpoint()
    assert queue.depth() == depth and incidents.list_incidents("p").items == []
    processor.run_once(timeout=0.0)  # the store is back: the pending output first
    (incident,) = incidents.list_incidents("p").items
    assert (incident.category, incident.subtype) == ("process", "exception")
    processor.checkpoint()
    assert queue.depth() == 0
    run = incidents.get_run("p", incident.run_id)
    assert run is not None and run.status == "failed"
    queue.close()


def test_checkpoints_store_parts_and_a_restarted_processor_continues_from_them(tmp_path: Path) -> None:
    queue, _envelopes = _publish(tmp_path)
    incidents = SqliteIncidentStore(tmp_path / "incidents.db")
    stores = (SqliteEventStore(tmp_path / "events.db"), SqliteMetricStore(tmp_path / "metrics.db"), incidents)
    first = EmbeddedProcessor(queue, *stores, snapshot_every_s=0.0, tick_interval_s=1e15)  # no eviction of
    first.drain(timeout=10)                                                          # the recorded run
    first.checkpoint()
    keys = incidents.state_keys(PARTS_PREFIX)
    assert f"{PARTS_PREFIX}header" in keys and any(k.startswith(f"{PARTS_PREFIX}run/") for k in keys)
    assert incidents.load_state(STATE_KEY) is None
    second = EmbeddedProcessor(queue, *stores, snapshot_every_s=0.0, tick_interval_s=1e15)  # a restart
    assert second.pipeline.snapshot() == first.pipeline.snapshot()
    queue.close()


def test_a_whole_snapshot_of_an_older_processor_is_read_then_replaced_by_parts(tmp_path: Path) -> None:
    queue, envelopes = _publish(tmp_path)
    incidents = SqliteIncidentStore(tmp_path / "incidents.db")
    older = Pipeline()
    older.process(envelopes)
    incidents.save_state(STATE_KEY, older.snapshot())  # what the previous version left
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),
                                  SqliteMetricStore(tmp_path / "metrics.db"), incidents, snapshot_every_s=0.0)
    assert processor.pipeline.snapshot() == older.snapshot()
    processor.checkpoint()
    assert incidents.load_state(STATE_KEY) is None
    assert incidents.state_keys(PARTS_PREFIX)
    again = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),
                              SqliteMetricStore(tmp_path / "metrics.db"), incidents, snapshot_every_s=0.0)
    assert again.pipeline.snapshot() == older.snapshot()
    queue.close()


def test_the_processed_hook_gets_each_chunks_events_per_project_as_the_backlog_weighs_them(tmp_path: Path) -> None:
    """``processed`` (the gateway's backlog count) is handed, per chunk, the chunk's events per project, each
    envelope weighed as the backlog weighs its dict (``dict_weight``: a metric batch one per point) -- a
    plain metric batch the pipeline took as read (decode.read_request) by its point count, without
    rendering its dict -- so what it releases is what the gateway counted."""
    from trainguard_server.gateway.backlog import dict_weight

    queue, envelopes = _publish(tmp_path)
    seen: List[Any] = []
    processor = EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),
                                  SqliteMetricStore(tmp_path / "metrics.db"),
                                  SqliteIncidentStore(tmp_path / "incidents.db"), batch=10_000, round_events=20,
                                  snapshot_every_s=1e9, tick_interval_s=1e15, processed=seen.append)
    records = queue.depth()
    assert processor.run_once(timeout=1.0) == records > 3
    want = [wire.envelope_to_dict(wire.envelope_from_dict(e)) for e in envelopes]
    assert len(seen) > 1  # one call a chunk
    total: Dict[str, int] = {}
    for counts in seen:
        for project, n in counts.items():
            total[project] = total.get(project, 0) + n
    expected: Dict[str, int] = {}
    for w in want:
        expected[w.get("project", "")] = expected.get(w.get("project", ""), 0) + dict_weight(w)
    assert total == expected
    assert sum(dict_weight(w) for w in want) > len(want)  # metric batches of several points among them
    queue.close()
