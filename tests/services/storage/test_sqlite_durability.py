"""SQLite stores beyond the contract: data survives reopening the data directory and a kill -9 in the
middle of a write stream (every acknowledged write is there), readers never wait for a writer, token
secrets never reach the disk, pragmas are what the module promises."""

from __future__ import annotations

import hashlib
import math
import sqlite3
import threading
import time
from pathlib import Path
from typing import List

import pytest

from tests.services.killing import run_until_killed
from trainguard_engine.records import Cluster, Incident, RunRecord
from trainguard_server.storage.base import MetricPoint, StoredEvent
from trainguard_server.storage.sqlite import (
    EVENTS_DB,
    PROJECTS_DB,
    SqliteEventStore,
    SqliteMetricStore,
    open_sqlite_stores,
)


def event(i: int, text: str = "checkpoint saved", project: str = "p") -> StoredEvent:
    return StoredEvent(event_id=f"e{i}", project=project, run_id="r1", rank=0, host="h", kind="log",
                       severity="info", step=i, time_ns=i, text=text, payload={"i": i})


def test_everything_survives_reopening_the_data_dir(tmp_path: Path) -> None:
    stores = open_sqlite_stores(tmp_path)
    stores.events.put([event(1, "CUDA out of memory"), event(2, "NCCL timeout")])
    stores.metrics.put([MetricPoint("p", "r1", 0, "loss", s, s, v)
                        for s, v in enumerate([1.0, math.nan, math.inf, -math.inf, 0.5])])
    stores.incidents.upsert_runs([RunRecord(project="p", run_id="r1", last_event_ns=5, tags={"a": "b"})])
    stores.incidents.upsert_incidents([Incident(incident_id="i1", project="p", run_id="r1", category="loss",
                                                subtype="non_finite", severity="critical", first_ns=3)])
    stores.incidents.upsert_clusters([Cluster(project="p", fingerprint="fp", fingerprint_version="fp:v1",
                                              exc_type="E", message_template="m", last_ns=4)])
    stores.incidents.save_state("processor", b"\x00state")
    token = stores.projects.create_token("p", "ingest")
    stores.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == [
        "events.db", "incidents.db", "metrics.db", "projects.db"]

    again = open_sqlite_stores(tmp_path)
    try:
        assert [h.event.event_id for h in again.events.search("p", '"out of memory"').items] == ["e1"]
        assert again.events.put([event(1, "CUDA out of memory")]) == 0  # still idempotent
        lasts = [b.last for b in again.metrics.series("p", "r1", ["loss"])["loss"][0]]
        assert lasts[0] == 1.0 and math.isnan(lasts[1]) and lasts[2:] == [math.inf, -math.inf, 0.5]
        assert [r.run_id for r in again.incidents.list_runs("p", tag="a=b").items] == ["r1"]
        assert again.incidents.get_incident("p", "i1") is not None
        assert again.incidents.get_cluster("p", "fp") is not None
        assert again.incidents.load_state("processor") == b"\x00state"
        assert again.projects.authenticate(token) is not None
    finally:
        again.close()


def test_acknowledged_events_survive_kill_9_mid_stream(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_DB
    code = f"""
        from trainguard_server.storage.base import StoredEvent
        from trainguard_server.storage.sqlite import SqliteEventStore
        store = SqliteEventStore({str(path)!r})
        i = 0
        while True:
            batch = [StoredEvent(event_id=f"{{i}}-{{j}}", project="p", run_id="r1", rank=0, host="h", kind="log",
                                 severity="info", step=i, time_ns=i * 100 + j, text=f"batch {{i}} word{{j}} gradient",
                                 payload={{"j": j}}) for j in range(50)]
            assert store.put(batch) == 50
            print(f"done {{i}}", flush=True)
            i += 1
    """
    acked = run_until_killed(code, acks=40)
    assert len(acked) >= 40
    store = SqliteEventStore(path)
    try:
        for i in acked:
            for j in (0, 25, 49):
                assert store.get("p", f"{i}-{j}") is not None, (i, j)
        stored = len(store.list_for_run("p", "r1", limit=100_000).items)
        assert stored >= 50 * len(acked) and stored % 50 == 0  # whole batches only
        hits = store.search("p", "gradient", limit=100_000).items
        assert len(hits) == stored  # the FTS index matches the table
    finally:
        store.close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO events_fts (events_fts) VALUES ('integrity-check')")
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()


def test_acknowledged_metric_points_survive_kill_9_mid_stream(tmp_path: Path) -> None:
    path = tmp_path / "metrics.db"
    code = f"""
        import math
        from trainguard_server.storage.base import MetricPoint
        from trainguard_server.storage.sqlite import SqliteMetricStore
        store = SqliteMetricStore({str(path)!r})
        i = 0
        while True:
            store.put([MetricPoint("p", "r1", rank, "loss", i, i, math.nan if i % 7 == 0 else float(i))
                       for rank in range(4)])
            print(f"done {{i}}", flush=True)
            i += 1
    """
    acked = [int(i) for i in run_until_killed(code, acks=300)]
    store = SqliteMetricStore(path)
    try:
        series = store.series("p", "r1", ["loss"], max_points=1_000_000)["loss"]
        for rank in range(4):
            steps = {b.step_start: b.last for b in series[rank]}
            for i in acked:
                assert i in steps and (math.isnan(steps[i]) if i % 7 == 0 else steps[i] == float(i))
    finally:
        store.close()


def test_readers_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / EVENTS_DB)
    store.put([event(i) for i in range(100)])
    writer = sqlite3.connect(tmp_path / EVENTS_DB, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # holds the write lock, like a long processor batch
    writer.execute("INSERT INTO events (event_id, project, run_id, rank, host, kind, severity, step, time_ns, text, "
                   "payload) VALUES ('uncommitted', 'p', 'r1', 0, 'h', 'log', 'info', 0, 0, 'checkpoint', '{}')")
    results: List[object] = []

    def reader() -> None:
        results.append(store.get("p", "e5"))
        results.append(len(store.search("p", "checkpoint", limit=1000).items))
        results.append(len(store.list_for_run("p", "r1", limit=1000).items))
        results.append(store.get("p", "uncommitted"))

    thread = threading.Thread(target=reader)
    start = time.monotonic()
    thread.start()
    thread.join(10)
    elapsed = time.monotonic() - start
    writer.execute("ROLLBACK")
    writer.close()
    store.close()
    assert not thread.is_alive()
    assert results[1:] == [100, 100, None] and results[0] is not None
    assert elapsed < 5  # a blocked reader would wait for the 30 s busy timeout


def test_token_secrets_never_reach_the_disk(tmp_path: Path) -> None:
    stores = open_sqlite_stores(tmp_path)
    token = stores.projects.create_token("p", "ingest")
    stores.close()
    secret = token.rsplit("_", 1)[1]
    raw = b"".join(p.read_bytes() for p in tmp_path.glob(PROJECTS_DB + "*"))
    assert secret.encode() not in raw
    assert hashlib.sha256(secret.encode()).hexdigest().encode() in raw


def test_pragmas(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "a.db")
    conn = store._db.reader()  # white-box: the connection the store reads with
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()
    normal = SqliteEventStore(tmp_path / "b.db", synchronous="normal")
    assert normal._db.reader().execute("PRAGMA synchronous").fetchone()[0] == 1
    normal.close()
    with pytest.raises(ValueError, match="synchronous"):
        SqliteEventStore(tmp_path / "c.db", synchronous="sometimes")


def test_a_data_dir_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    SqliteEventStore(tmp_path / EVENTS_DB).close()
    conn = sqlite3.connect(tmp_path / EVENTS_DB)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(RuntimeError, match="schema version 99"):
        SqliteEventStore(tmp_path / EVENTS_DB)


def test_closed_stores_refuse_calls(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / EVENTS_DB)
    store.close()
    store.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        store.get("p", "e1")
    with pytest.raises(RuntimeError, match="closed"):
        store.put([event(1)])
