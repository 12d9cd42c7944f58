"""SqliteEventStore.put numbers only the events it stores: an event put again (a queue redelivery after a
crash, a retried round, an SDK's duplicate) keeps its row and takes no ``seq``, so the events after it are
numbered as in a run without the replay. With ``INSERT OR IGNORE`` alone SQLite's AUTOINCREMENT took the
next value for the refused row (found by hD, stop 44: a processor restarted after a crash at a checkpoint
whose records held raw context numbered every later event one higher than an uninterrupted drain)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import List, Tuple

from trainguard_server.storage.base import StoredEvent
from trainguard_server.storage.sqlite import SqliteEventStore


def _event(i: int, run_id: str = "r") -> StoredEvent:
    return StoredEvent(event_id=f"e{i}", project="p", run_id=run_id, rank=0, host="h", kind="log",
                       severity="INFO", step=i, time_ns=10**18 + i, text=f"line {i}", payload={"i": i})


def _seqs(path: Path) -> List[Tuple[int, str]]:
    conn = sqlite3.connect(path)
    try:
        return [(int(seq), str(eid)) for seq, eid in conn.execute("SELECT seq, event_id FROM events ORDER BY seq")]
    finally:
        conn.close()


def test_an_event_put_again_takes_no_seq_and_keeps_its_row(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SqliteEventStore(path)
    try:
        assert store.put([_event(1), _event(2)]) == 2
        assert store.put([_event(2)]) == 0                           # redelivered: already stored
        assert store.put([_event(1), _event(3), _event(3)]) == 1     # one new, one stored, one twice
        changed = _event(4)
        assert store.put([changed]) == 1
        assert store.put([StoredEvent(**{**changed.__dict__, "text": "other"})]) == 0  # the first one stays
        assert store.put([_event(5)]) == 1
        store.sync()
        assert _seqs(path) == [(1, "e1"), (2, "e2"), (3, "e3"), (4, "e4"), (5, "e5")]
        got = store.get("p", "e4")
        assert got is not None and got.text == "line 4"
        # the full-text index holds each stored event once
        assert [h.event.event_id for h in store.search("p", "line").items] == ["e1", "e2", "e3", "e4", "e5"]
    finally:
        store.close()


def test_the_same_event_id_in_another_project_is_another_event(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "events.db")
    try:
        assert store.put([_event(1)]) == 1
        assert store.put([StoredEvent(**{**_event(1).__dict__, "project": "q"})]) == 1
        assert store.get("q", "e1") is not None and store.get("p", "e1") is not None
    finally:
        store.close()
