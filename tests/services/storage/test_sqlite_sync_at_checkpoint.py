"""``sync_at_checkpoint`` (storage/sqlite.py's Durability): the processor's writes commit at NORMAL and
``sync()`` makes them durable with one FULL commit that writes a frame; every other write keeps the
configured level; off (``TRAINGUARD_SQLITE_SYNC_AT_CHECKPOINT=false``), or under ``synchronous=NORMAL``, nothing
is deferred and ``sync()`` writes nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import List

import pytest

from trainguard_engine.records import Incident, RunRecord
from trainguard_server.config import Settings
from trainguard_server.storage.base import MetricPoint, StoredEvent
from trainguard_server.storage.select import open_stores
from trainguard_server.storage.sqlite import (
    SYNC_TABLE,
    SqliteEventStore,
    SqliteIncidentStore,
    SqliteMetricStore,
)


def event(i: int) -> StoredEvent:
    return StoredEvent(event_id=f"e{i}", project="p", run_id="r1", rank=0, host="h", kind="log",
                       severity="info", step=i, time_ns=i, text="checkpoint saved", payload={"i": i})


def writer_level(store: object) -> int:
    return int(store._db._writer.execute("PRAGMA synchronous").fetchone()[0])  # type: ignore[attr-defined]


def traced(store: object) -> List[str]:
    statements: List[str] = []
    store._db._writer.set_trace_callback(statements.append)  # type: ignore[attr-defined]
    return statements


def test_deferred_writes_commit_at_normal_and_sync_commits_one_frame_at_full(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "events.db")
    wal = tmp_path / "events.db-wal"
    statements = traced(store)
    assert store.put([event(1), event(2)]) == 2
    assert writer_level(store) == 1 and store._db.unsynced  # NORMAL
    before = wal.stat().st_size
    store.sync()
    assert wal.stat().st_size > before  # a frame was written: SQLite syncs the WAL after it at FULL
    assert store._db.syncs == 1 and not store._db.unsynced
    begins = [i for i, s in enumerate(statements) if s.startswith("BEGIN")]
    assert len(begins) == 2
    assert "PRAGMA synchronous = NORMAL" in statements[:begins[0]]
    assert "PRAGMA synchronous = FULL" in statements[begins[0]:begins[1]]  # the sync's commit
    assert any(s.startswith(f"INSERT INTO {SYNC_TABLE}") for s in statements[begins[1]:])
    size = wal.stat().st_size
    store.sync()  # nothing deferred since: no commit, no fsync
    assert store._db.syncs == 1 and wal.stat().st_size == size
    store.close()


def test_every_processor_write_is_deferred_and_other_writes_keep_full(tmp_path: Path) -> None:
    metrics = SqliteMetricStore(tmp_path / "metrics.db")
    metrics.put([MetricPoint("p", "r1", 0, "loss", 1, 1, 0.5)])
    assert writer_level(metrics) == 1 and metrics._db.unsynced
    metrics.sync()
    assert not metrics._db.unsynced
    metrics.close()

    incidents = SqliteIncidentStore(tmp_path / "incidents.db")
    incident = Incident(incident_id="i1", project="p", run_id="r1", category="loss", subtype="non_finite",
                        severity="critical", first_ns=3)
    incidents.upsert_incidents([incident])  # the API's write (resolutions): durable when it returns
    incidents.upsert_runs([RunRecord(project="p", run_id="r1", last_event_ns=5)])
    incidents.save_state("k", b"v")
    assert writer_level(incidents) == 2 and not incidents._db.unsynced
    for write in (lambda: incidents.upsert_records([], [incident], []),
                  lambda: incidents.merge_clusters("partition/0", []),  # no clusters: no transaction
                  lambda: incidents.save_states({"k": b"w"})):
        incidents._db.unsynced = False
        write()
    assert writer_level(incidents) == 1 and incidents._db.unsynced  # save_states, the last one, deferred
    incidents._db.unsynced = False
    incidents.upsert_records([], [incident], [])
    assert incidents._db.unsynced
    incidents.sync()
    incidents.upsert_incidents([incident])
    assert writer_level(incidents) == 2 and not incidents._db.unsynced
    incidents.close()


def test_off_or_under_normal_nothing_is_deferred(tmp_path: Path) -> None:
    off = SqliteEventStore(tmp_path / "off.db", sync_at_checkpoint=False)
    off.put([event(1)])
    assert writer_level(off) == 2 and not off._db.unsynced  # FULL per commit, as before
    off.sync()
    assert off._db.syncs == 0
    off.close()
    normal = SqliteEventStore(tmp_path / "normal.db", synchronous="NORMAL")
    normal.put([event(1)])
    assert writer_level(normal) == 1 and not normal._db.unsynced  # the user chose NORMAL: nothing synced
    normal.sync()
    assert normal._db.syncs == 0
    normal.close()
    for name in ("off.db", "normal.db"):
        conn = sqlite3.connect(tmp_path / name)
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = ?", (SYNC_TABLE,)).fetchone() is None
        conn.close()


def test_close_syncs_what_was_deferred(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "events.db")
    store.put([event(1)])
    store.close()
    conn = sqlite3.connect(tmp_path / "events.db")
    assert conn.execute(f"SELECT syncs FROM {SYNC_TABLE}").fetchone() == (1,)
    conn.close()


def test_the_server_setting_turns_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value, deferred in (("false", False), (None, True)):
        if value is None:
            monkeypatch.delenv("TRAINGUARD_SQLITE_SYNC_AT_CHECKPOINT", raising=False)
        else:
            monkeypatch.setenv("TRAINGUARD_SQLITE_SYNC_AT_CHECKPOINT", value)
        stores = open_stores(Settings(), tmp_path / str(value))
        try:
            for store in (stores.events, stores.metrics, stores.incidents):
                assert (store._db._deferred_level == "NORMAL") is deferred  # type: ignore[attr-defined]
        finally:
            stores.close()
