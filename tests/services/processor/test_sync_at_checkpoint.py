"""Durability at checkpoints (issue 15): the SQLite stores' per-round commits are deferred (NORMAL) and every
store is synced before the processor commits queue offsets -- no offset is committed before the writes of
the records it covers are durable (storage/sqlite.py's Durability) -- and a processor killed with SIGKILL
mid-drain, restarted on the same data directory, leaves the same stores as one drain that was never
interrupted. Real SQLite queue and stores, recorded runs published through the real gateway."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.services.killing import ROOT, run_until_killed
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.processor.embedded import OFFSETS_PREFIX, EmbeddedProcessor
from trainguard_server.queue.base import Queue, QueueRecord
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.sqlite import SYNC_TABLE, SqliteProjectStore, SqliteStores, open_sqlite_stores

STREAMS = Path(__file__).resolve().parents[2] / "scenarios" / "streams"
SHAPES = ("crash.jsonl", "nan_source.jsonl", "explosion.jsonl")  # raw context, metrics and incidents
PER_REQUEST = 5
STORE_FILES = ("events.db", "metrics.db", "incidents.db")
LEFT_OUT = frozenset({"updated_ns"})  # when a state row was written: wall clock, not content


def _publish(data_dir: Path) -> int:
    """Publish the recorded runs of SHAPES (as project "p") into ``data_dir``'s queue; returns the records."""
    data_dir.mkdir(parents=True, exist_ok=True)
    queue = SqliteQueue(data_dir / "queue.db")
    projects = SqliteProjectStore(data_dir / "projects.db")
    gateway = Gateway(queue, projects, Settings(max_past_age_s=10 * 365 * 86400.0))
    token = projects.create_token("p", "ingest")
    records = 0
    for shape in SHAPES:
        envelopes: List[Any] = [json.loads(line) for line in (STREAMS / shape).read_text().splitlines()
                                if line.strip()]
        for e in envelopes:
            e["project"] = "p"
        for i in range(0, len(envelopes), PER_REQUEST):
            request = ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(e)
                                                       for e in envelopes[i:i + PER_REQUEST]])
            assert not gateway.ingest(token, request).rejected
            records += 1
    projects.close()
    queue.close()
    return records


def _processor(data_dir: Path, **queue_options: Any) -> Tuple[EmbeddedProcessor, SqliteQueue, SqliteStores]:
    stores = open_sqlite_stores(data_dir)
    queue = SqliteQueue(data_dir / "queue.db", **queue_options)
    # chunks of one record, no time bound (chunk borders do not depend on the machine), a checkpoint
    # after every round, no timers (the recorded runs are years old)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, batch=1,
                                  round_events=PER_REQUEST, round_target_s=0.0, snapshot_every_s=0.0,
                                  tick_interval_s=1e15)
    return processor, queue, stores


def _canonical(value: Any) -> Any:
    """A JSON document (text or bytes: payloads, record documents, snapshot parts) with its keys sorted: a
    map's order as read from protobuf differs between processes (the killed one and its restart); what
    the stores hold does not."""
    if isinstance(value, (str, bytes)) and value[:1] in ("{", b"{"):
        try:
            return json.dumps(json.loads(value), sort_keys=True)
        except ValueError:
            return value
    return value


def _digests(data_dir: Path) -> Dict[str, str]:
    """sha256 of every table of the processor's stores, rows in full-column order, JSON documents with
    their keys sorted (``updated_ns`` and the sync bookkeeping left out)."""
    out: Dict[str, str] = {}
    for name in STORE_FILES:
        conn = sqlite3.connect(f"file:{data_dir / name}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                 "ORDER BY name") if r[0] != SYNC_TABLE]
            for table in tables:
                cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")') if r[1] not in LEFT_OUT]
                order = ", ".join(f'"{c}"' for c in cols)
                h = hashlib.sha256()
                rows = conn.execute(f'SELECT {order} FROM "{table}" ORDER BY {order}').fetchall()
                for row in sorted(repr(tuple(_canonical(v) for v in row)) for row in rows):
                    h.update(row.encode())
                out[f"{name}/{table}"] = f"{h.hexdigest()} rows={len(rows)}"
        finally:
            conn.close()
    return out


def _ro(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def _digest(rows: Any) -> str:
    h = hashlib.sha256()
    listed = sorted(repr(row) for row in rows)
    for row in listed:
        h.update(row.encode())
    return f"{h.hexdigest()} rows={len(listed)}"


def _ordered(ranked: Dict[Any, Tuple[Any, ...]]) -> Dict[Any, int]:
    """Each key's place (0, 1, ...) within its group: ``ranked`` maps a key to ``(group, sort key...)``."""
    out: Dict[Any, int] = {}
    last: Dict[Any, int] = {}
    for key, (group, *_rest) in sorted(ranked.items(), key=lambda kv: (kv[1], repr(kv[0]))):
        out[key] = last[group] = last.get(group, -1) + 1
    return out


def _delivery_independent_digests(data_dir: Path) -> Dict[str, str]:
    """:func:`_digests` with what depends on how the queue interleaved DIFFERENT runs' records replaced by
    what must be equal whatever that interleaving was. The SQLite queue hands out its lanes' records in
    turn and keeps whose turn it is in memory (queue/sqlite.py: by design), so a restarted processor meets
    the runs' remaining records interleaved from the first lane again, not where the killed one was --
    each run's own records in their order, always (a lane is one run's, in offset order); across runs
    another order (and over Kafka there is no order across partitions at all). Three things number
    arrivals ACROSS runs, and are compared as what they mean:

    * the pipeline's quota clock (``touched`` of each run and cluster part, engine/quotas.py): it exists
      for the eviction order -- a project's runs, and its clusters, least recently active first -- so each
      is compared as its place in its project's runs (clusters), not as the count itself;
    * metric series ids (``series.sid``, assigned as series first arrive): each series and point compared
      by its series' key (project, run, name, rank);
    * event ``seq`` (insertion order): compared as the order within the event's run; the full-text index
      (its shadow tables are laid out by ``seq``) by each event's document size and FTS5's own
      integrity-check (the index holds exactly the stored texts), not byte for byte.

    Everything else is compared as :func:`_digests` does (every column, JSON keys sorted)."""
    out = _digests(data_dir)
    for name in ("events.db/events", "events.db/events_fts_data", "events.db/events_fts_docsize",
                 "events.db/events_fts_idx", "events.db/sqlite_sequence", "metrics.db/series",
                 "metrics.db/points", "incidents.db/state"):
        out.pop(name, None)
    conn = _ro(data_dir / "events.db")
    try:
        events = conn.execute("SELECT * FROM events").fetchall()
        cols = [r[1] for r in conn.execute('PRAGMA table_info("events")')]
        at = {c: i for i, c in enumerate(cols)}
        place = _ordered({row[at["seq"]]: ((row[at["project"]], row[at["run_id"]]), row[at["seq"]])
                          for row in events})
        key = {row[at["seq"]]: (row[at["project"]], row[at["event_id"]]) for row in events}
        out["events.db/events"] = _digest(
            tuple(place[v] if c == "seq" else _canonical(v) for c, v in zip(cols, row)) for row in events)
        out["events.db/events_fts_docsize"] = _digest(
            (key[row[0]], row[1]) for row in conn.execute("SELECT id, sz FROM events_fts_docsize"))
    finally:
        conn.close()
    check = sqlite3.connect(data_dir / "events.db")  # FTS5's check is an INSERT command (it writes nothing)
    try:
        check.execute("INSERT INTO events_fts (events_fts, rank) VALUES ('integrity-check', 1)")  # 1: and the texts
    finally:
        check.close()
    conn = _ro(data_dir / "metrics.db")
    try:
        series = {row[0]: row[1:] for row in conn.execute("SELECT sid, project, run_id, name, rank, min_step, "
                                                          "max_step FROM series")}
        out["metrics.db/series"] = _digest(series.values())
        out["metrics.db/points"] = _digest(
            (series[row[0]][:4], *row[1:]) for row in conn.execute("SELECT sid, step, time_ns, value, nf "
                                                                    "FROM points"))
    finally:
        conn.close()
    conn = _ro(data_dir / "incidents.db")
    try:
        parts = {k: v for k, v, _ in conn.execute("SELECT key, value, updated_ns FROM state")}
    finally:
        conn.close()
    clocked: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    for k, v in parts.items():
        for kind in ("run", "cluster"):
            if f"/{kind}/" in k and v is not None and v[:1] == b"{":
                doc = json.loads(v)
                if isinstance(doc.get(kind), dict) and "touched" in doc[kind]:
                    clocked[k] = (kind, doc)
    project_of = {k: k.split(f"/{kind}/", 1)[1].split("%00", 1)[0] for k, (kind, _) in clocked.items()}
    place_in_project = _ordered({k: ((kind, project_of[k]), doc[kind]["touched"])
                                 for k, (kind, doc) in clocked.items()})
    for k, (kind, doc) in clocked.items():
        doc[kind]["touched"] = place_in_project[k]
        parts[k] = json.dumps(doc, sort_keys=True).encode()
    out["incidents.db/state"] = _digest((k, _canonical(v)) for k, v in parts.items())
    return out


class _Log:
    """What happened, in order: store writes, store syncs and queue commits."""

    def __init__(self) -> None:
        self.entries: List[Tuple[str, str]] = []

    def wrap(self, obj: Any, method: str, label: str) -> None:
        inner = getattr(obj, method)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.entries.append((label, method))
            return inner(*args, **kwargs)

        setattr(obj, method, recorded)


def test_every_store_is_synced_after_its_writes_and_before_each_queue_commit(tmp_path: Path) -> None:
    records = _publish(tmp_path)
    processor, queue, stores = _processor(tmp_path)
    log = _Log()
    writes = {"events": ("put",), "metrics": ("put_columns", "put_columns_many"),
              "incidents": ("upsert_records", "merge_clusters", "save_states")}
    for label, methods in writes.items():
        store = getattr(stores, label)
        for method in methods:
            log.wrap(store, method, label)
        log.wrap(store, "sync", label)
    log.wrap(queue, "commit", "queue")
    committed: List[QueueRecord] = []
    inner_commit = queue.commit

    def commit(taken: Sequence[QueueRecord]) -> None:
        committed.extend(taken)
        inner_commit(taken)

    queue.commit = commit  # type: ignore[method-assign]
    try:
        processor.drain(timeout=60)
        processor.checkpoint()
        assert len(committed) == records
        commits = [i for i, (label, _) in enumerate(log.entries) if label == "queue"]
        assert len(commits) > 1
        for at in commits:
            for label in writes:
                before = [m for lab, m in log.entries[:at] if lab == label]
                assert before, label
                last_write = max((i for i, m in enumerate(before) if m != "sync"), default=-1)
                assert "sync" in before[last_write + 1:], (label, at, before[-5:])  # synced since its last write
        # and the syncs did sync: each store's deferred commits were followed by a FULL commit of a frame
        for label in writes:
            assert getattr(stores, label)._db.syncs > 0, label
    finally:
        queue.close()
        stores.close()


def test_a_processor_killed_mid_drain_then_restarted_leaves_the_stores_of_an_uninterrupted_drain(
        tmp_path: Path) -> None:
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    records = _publish(killed)
    shutil.copytree(killed, whole)

    processor, queue, stores = _processor(whole)
    processor.drain(timeout=120)
    processor.checkpoint()
    queue.close()
    stores.close()

    code = f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from tests.services.processor.test_sync_at_checkpoint import _processor
        processor, queue, stores = _processor(Path({str(killed)!r}))
        n = 0
        while processor.run_once(timeout=0.0):
            n += 1
            print(f"done {{n}}", flush=True)
        print("finished", flush=True)
    """
    rounds = run_until_killed(code, acks=records // 3, timeout=120.0)
    assert records // 3 <= len(rounds) < records  # killed mid-drain
    # a restart on the same data directory: the last checkpoint, then the rest
    processor, queue, stores = _processor(killed)
    assert 0 < queue.depth() < records  # what the killed one had not committed is handed out again
    processor.drain(timeout=120)
    processor.checkpoint()
    queue.close()
    stores.close()

    # what must be equal (the restart meets the runs' records interleaved otherwise: see the function)
    got, want = _delivery_independent_digests(killed), _delivery_independent_digests(whole)
    assert got == want
    for table in ("events.db/events", "metrics.db/points", "incidents.db/incidents", "incidents.db/state"):
        assert not want[table].endswith(" rows=0"), table  # the streams wrote to every store


class _CrashAtCommit(BaseException):
    """The process dies here (nothing after it runs): raised by a queue commit."""


def _crash_at_commit(data_dir: Path, checkpoint: int) -> None:
    """A processor on ``data_dir`` that dies at its ``checkpoint``-th queue commit -- after that checkpoint's
    snapshot was saved and every store synced, before the records the snapshot covers are committed."""
    processor, queue, stores = _processor(data_dir)
    commits = 0
    inner_commit = queue.commit

    def commit(taken: Sequence[QueueRecord]) -> None:
        nonlocal commits
        commits += 1
        if commits == checkpoint:
            raise _CrashAtCommit()
        inner_commit(taken)

    queue.commit = commit  # type: ignore[method-assign]
    try:
        while processor.run_once(timeout=0.0):
            pass
        raise AssertionError("drained before the crash")
    except _CrashAtCommit:
        pass
    finally:
        queue.close()
        stores.close()


def _crash_between_snapshot_and_commit(data_dir: Path, checkpoint: int) -> None:
    """:func:`_crash_at_commit`, then a new processor on the same directory that restores and drains (the
    queue redelivers the records that snapshot covers)."""
    _crash_at_commit(data_dir, checkpoint)
    processor, queue, stores = _processor(data_dir)
    redelivered = queue.depth()
    processor.drain(timeout=120)
    processor.checkpoint()
    queue.close()
    stores.close()
    assert redelivered > 0


def test_records_a_snapshot_covers_redelivered_after_a_crash_before_its_commit_are_not_counted_twice(
        tmp_path: Path) -> None:
    """A crash between a checkpoint's snapshot and its queue commit: the restarted processor is handed the
    records that snapshot covers again (at-least-once); they are written to the stores again (idempotent)
    but not to the pipeline, whose snapshot saved the offsets it covers -- so the stores, the records and
    the pipeline's counters are those of a drain never interrupted (before: counters['events'] counted the
    replayed envelopes again, 597 vs 592, and the killed-mid-drain test above failed whenever SIGKILL came
    in that window)."""
    crashed, whole = tmp_path / "crashed", tmp_path / "whole"
    _publish(crashed)
    shutil.copytree(crashed, whole)
    processor, queue, stores = _processor(whole)
    processor.drain(timeout=120)
    processor.checkpoint()
    queue.close()
    stores.close()
    _crash_between_snapshot_and_commit(crashed, checkpoint=10)
    got, want = _digests(crashed), _digests(whole)
    assert got == want


@pytest.mark.parametrize("checkpoint", [2, 20])
def test_a_restart_that_interleaves_the_runs_otherwise_leaves_what_must_be_equal_equal(
        tmp_path: Path, checkpoint: int) -> None:
    """A crash at the 2nd or 20th checkpoint (after its snapshot, before its queue commit), then a restart:
    the SQLite queue hands out the three runs' remaining records in turn from the first lane again, where
    the uninterrupted drain was at another lane (its turn is kept in memory), so the quota clock counted the
    arrivals in another order (run and cluster ``touched`` 5 apart) and, at the 2nd, series first arrived in
    another order (other series ids) -- every table byte-identical otherwise, and the eviction orders,
    series and events equal (:func:`_delivery_independent_digests`). This is the killed-mid-drain test's
    case made deterministic. Crashing at each of the 118 checkpoints of this drain in turn (hD, stop 44): the
    exact digests differed at 66 (69 before event puts stopped taking a ``seq`` for a stored event), equal
    where the restarted rotation begins at the lane the uninterrupted one was at; these are equal at all 118,
    every project's eviction orders included."""
    crashed, whole = tmp_path / "crashed", tmp_path / "whole"
    _publish(crashed)
    shutil.copytree(crashed, whole)
    processor, queue, stores = _processor(whole)
    processor.drain(timeout=120)
    processor.checkpoint()
    queue.close()
    stores.close()
    _crash_between_snapshot_and_commit(crashed, checkpoint=checkpoint)
    assert _delivery_independent_digests(crashed) == _delivery_independent_digests(whole)


def test_a_snapshot_saved_without_offsets_restores_and_replays_as_before(tmp_path: Path) -> None:
    """A snapshot written before the offsets were saved with it (no OFFSETS_PREFIX row): the restore works
    and every redelivered record goes through the pipeline, as before (the records and stores are the same
    as an uninterrupted drain's; only the pipeline's event counter counts the replayed envelopes again)."""
    processor, queue, stores = _processor(tmp_path)
    records = _publish(tmp_path)
    for _ in range(4):
        processor.run_once(timeout=0.0)
    processor.checkpoint()
    stores.incidents.save_states({key: None for key in stores.incidents.state_keys(OFFSETS_PREFIX)})
    assert stores.incidents.state_keys(OFFSETS_PREFIX) == []
    queue.close()
    stores.close()
    processor, queue, stores = _processor(tmp_path)
    assert not processor._covered  # nothing known covered: every record to the pipeline
    processor.drain(timeout=120)
    processor.checkpoint()
    assert processor.stats.records == records - 4 and queue.depth() == 0
    assert stores.incidents.state_keys(OFFSETS_PREFIX) == [OFFSETS_PREFIX + "embedded"]
    queue.close()
    stores.close()


def test_a_cover_saved_under_another_lane_count_is_ignored_and_nothing_is_skipped(tmp_path: Path) -> None:
    """The queue computes a record's lane from its key when it reads it, and ``queue_lanes`` may change
    between starts: a snapshot's offsets saved over one lane count name other runs' records under another,
    so a restart with another count hands every redelivered record to the pipeline (none skipped: a skip
    there would lose records that never went through detection); with the same count the cover is used."""
    same, other = tmp_path / "same", tmp_path / "other"
    _publish(same)
    shutil.copytree(same, other)
    for data_dir in (same, other):
        _crash_at_commit(data_dir, checkpoint=10)
    processor, queue, stores = _processor(same)
    assert processor._covered  # the crash's snapshot covers redelivered records: used
    queue.close()
    stores.close()
    processor, queue, stores = _processor(other, lanes=7)
    assert not processor._covered
    redelivered = queue.depth()
    processor.drain(timeout=120)
    assert processor.stats.records == redelivered and queue.depth() == 0
    queue.close()
    stores.close()


def test_the_saved_cover_holds_only_what_came_after_the_last_commit(tmp_path: Path) -> None:
    """A committed record is never delivered again, so the offsets saved with a snapshot cover only the
    records through the pipeline since the last queue commit -- not every lane ever used, re-serialised at
    every checkpoint (up to 65,536 lanes) -- and they say the queue's lane count."""
    _publish(tmp_path)
    processor, queue, stores = _processor(tmp_path)
    processor.drain(timeout=120)  # a checkpoint after every round of one record (snapshot_every_s 0)
    processor.checkpoint()
    assert queue.depth() == 0 and not processor._tops  # every record committed: nothing left to cover
    blobs = [stores.incidents.load_state(key) for key in stores.incidents.state_keys(OFFSETS_PREFIX)]
    assert len(blobs) == 1 and blobs[0] is not None
    saved = json.loads(blobs[0])
    assert saved["lanes"] == queue.lanes and len(saved["tops"]) == 1  # the last round's one record
    queue.close()
    stores.close()


class _Partitioned(Queue):
    """A queue whose one partition (0) moves between consumers (as Kafka's do): hands out ``values``, logs
    its commits."""

    partitioned = True

    def __init__(self, values: List[bytes], log: _Log) -> None:
        self.records = [QueueRecord(0, i, "run", v, 0) for i, v in enumerate(values)]
        self.log = log

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        raise NotImplementedError

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        taken, self.records = self.records[:max_records], self.records[max_records:]
        return taken

    def commit(self, records: Sequence[QueueRecord]) -> None:
        self.log.entries.append(("queue", "commit"))

    def depth(self) -> int:
        return len(self.records)


def test_a_revoked_partitions_records_are_committed_after_every_store_is_synced(tmp_path: Path) -> None:
    _publish(tmp_path)
    source = SqliteQueue(tmp_path / "queue.db")
    values = [r.value for r in source.consume(10_000, 0.0)]
    source.close()
    log = _Log()
    queue = _Partitioned(values, log)
    stores = open_sqlite_stores(tmp_path)
    for label in ("events", "metrics", "incidents"):
        log.wrap(getattr(stores, label), "sync", label)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, batch=8,
                                  round_target_s=0.0, snapshot_every_s=1e9, tick_interval_s=1e15)
    try:
        processor.partitions_assigned([0])
        assert processor.run_once(timeout=0.0) > 0
        assert ("queue", "commit") not in log.entries  # no checkpoint due: nothing committed yet
        processor.partitions_revoked([0], lost=False)  # the group rebalanced: save, sync, commit, drop
        assert log.entries[-1] == ("queue", "commit")
        assert {label for label, _ in log.entries[:-1]} == {"events", "metrics", "incidents"}
    finally:
        stores.close()
