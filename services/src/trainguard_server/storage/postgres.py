"""PostgreSQL implementations of the transactional store contracts (``storage/base.py``): runs, incidents,
clusters, incident workflow, state blobs (the processor's snapshots, gate baselines, notifier state) in
:class:`PostgresIncidentStore`; projects and tokens in :class:`PostgresProjectStore`. What several
gateways, processors and API processes on several nodes share (``TRAINGUARD_STATE_STORE=postgres``);
SQLite (``storage/sqlite.py``) stays the embedded default. Operator notes: docs/postgresql.md.

Schema. Every table lives in one schema (``postgres_schema``, ``trainguard`` by default; created if absent).
``schema_version`` records the migrations applied; :data:`MIGRATIONS` holds them, numbered. Opening a store
applies the missing ones in one transaction under an advisory lock, so pods starting together migrate once;
a database migrated by a newer server (a version above :data:`SCHEMA_VERSION`) is refused. Records are
JSON text documents plus the columns listings filter and order on (TEXT, not JSONB: NaN and ``\\u0000``
must round-trip); key columns are ``COLLATE "C"`` so orderings and cursors are bytewise, as in SQLite,
whatever the database's locale. PostgreSQL text cannot hold NUL: it is stored as U+FFFD in key columns
(the documents keep the exact text).

Concurrency. A connection pool per store (``pool_size``); each call is one transaction, committed before
it returns (READ COMMITTED). Upserts are ``INSERT … ON CONFLICT DO UPDATE``; a batch writes its rows in key
order, so two writers of overlapping batches cannot deadlock, and a deadlock or serialization failure is
retried. Clusters written with :meth:`PostgresIncidentStore.merge_clusters` keep one view per source (a
processor partition) and the merge of all views: a per-cluster advisory lock serialises writers of one
cluster, and the result depends only on the set of views (commutative, idempotent).
"""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg_pool import ConnectionPool, PoolTimeout

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.records import Cluster, Incident, RunRecord

from .base import IncidentBrief, IncidentStore, IncidentWorkflow, Page, ProjectStore, TokenInfo
from .cluster_merge import join_source, merge_views
from .common import (
    check_limit,
    check_project_name,
    decode_cursor,
    encode_cursor,
    hash_secret,
    new_token,
    parse_operator_token,
    parse_tag_filter,
    secret_matches,
    split_token,
)

T = TypeVar("T")

SCHEMA_VERSION = 1
DEFAULT_SCHEMA = "trainguard"
DEFAULT_POOL_SIZE = 8
DEFAULT_TIMEOUT_S = 10.0                  # longest wait for a pooled connection (server down: fail after it)
_MIGRATION_LOCK = 0x5447_5343_4845_4D41  # pg_advisory_xact_lock key of migrations ("TGSCHEMA")
_RETRIES = 5                              # attempts of a write that hit a deadlock / serialization failure
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")

MIGRATIONS: Dict[int, str] = {
    1: """
CREATE TABLE runs (
    project        TEXT COLLATE "C" NOT NULL,
    run_id         TEXT COLLATE "C" NOT NULL,
    status         TEXT COLLATE "C" NOT NULL,
    started_ns     BIGINT NOT NULL,
    last_event_ns  BIGINT NOT NULL,
    doc            TEXT NOT NULL,             -- RunRecord.to_dict() as JSON
    PRIMARY KEY (project, run_id)
);
CREATE INDEX runs_recent ON runs (project, last_event_ns DESC, run_id);
CREATE INDEX runs_status ON runs (project, status, last_event_ns DESC, run_id);
CREATE TABLE run_tags (
    project  TEXT COLLATE "C" NOT NULL,
    run_id   TEXT COLLATE "C" NOT NULL,
    key      TEXT COLLATE "C" NOT NULL,
    value    TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (project, run_id, key)
);
CREATE INDEX run_tags_by_value ON run_tags (project, key, value);
CREATE TABLE incidents (
    project      TEXT COLLATE "C" NOT NULL,
    incident_id  TEXT COLLATE "C" NOT NULL,
    run_id       TEXT COLLATE "C" NOT NULL,
    status       TEXT COLLATE "C" NOT NULL,
    first_ns     BIGINT NOT NULL,
    last_ns      BIGINT NOT NULL,
    doc          TEXT NOT NULL,               -- Incident.to_dict() as JSON
    PRIMARY KEY (project, incident_id)
);
CREATE INDEX incidents_recent ON incidents (project, first_ns DESC, incident_id);
CREATE INDEX incidents_by_run ON incidents (project, run_id, first_ns DESC, incident_id);
CREATE INDEX incidents_by_status ON incidents (project, status, first_ns DESC, incident_id);
CREATE TABLE clusters (
    project      TEXT COLLATE "C" NOT NULL,
    fingerprint  TEXT COLLATE "C" NOT NULL,
    first_ns     BIGINT NOT NULL,
    last_ns      BIGINT NOT NULL,
    doc          TEXT NOT NULL,               -- Cluster.to_dict() as JSON: the merge of its views
    PRIMARY KEY (project, fingerprint)
);
CREATE INDEX clusters_recent ON clusters (project, last_ns DESC, fingerprint);
CREATE TABLE cluster_views (
    project      TEXT COLLATE "C" NOT NULL,
    fingerprint  TEXT COLLATE "C" NOT NULL,
    source       TEXT COLLATE "C" NOT NULL,   -- who counted: a processor partition; '' for upsert_clusters
    doc          TEXT NOT NULL,               -- that source's cumulative Cluster as JSON
    updated_ns   BIGINT NOT NULL,
    PRIMARY KEY (project, fingerprint, source)
);
CREATE TABLE incident_workflow (
    project      TEXT COLLATE "C" NOT NULL,
    incident_id  TEXT COLLATE "C" NOT NULL,
    category     TEXT COLLATE "C" NOT NULL,
    subtype      TEXT COLLATE "C" NOT NULL,
    resolved_ns  BIGINT NOT NULL,
    root_cause   TEXT NOT NULL,
    doc          TEXT NOT NULL,               -- IncidentWorkflow.to_dict() as JSON
    PRIMARY KEY (project, incident_id)
);
CREATE INDEX workflow_resolved ON incident_workflow (project, category, subtype, resolved_ns DESC);
CREATE TABLE state (
    key         TEXT COLLATE "C" PRIMARY KEY,
    value       BYTEA NOT NULL,
    updated_ns  BIGINT NOT NULL
);
CREATE TABLE projects (
    name        TEXT COLLATE "C" PRIMARY KEY,
    created_ns  BIGINT NOT NULL
);
CREATE TABLE tokens (
    token_id       TEXT COLLATE "C" PRIMARY KEY,  -- the public part of the token text
    project        TEXT COLLATE "C" NOT NULL,
    kind           TEXT COLLATE "C" NOT NULL,     -- ingest | read
    secret_sha256  TEXT NOT NULL,                 -- the secret itself is never stored
    created_ns     BIGINT NOT NULL,
    revoked        BOOLEAN NOT NULL DEFAULT FALSE,
    description    TEXT NOT NULL DEFAULT '',
    expires_ns     BIGINT NOT NULL DEFAULT 0       -- 0: never
);
CREATE INDEX tokens_by_project ON tokens (project, created_ns);
""",
}


def _k(text: str) -> str:
    """A key column's value: PostgreSQL text cannot hold NUL, so it becomes U+FFFD (queries do the same)."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def check_schema_name(schema: str) -> str:
    if not _SCHEMA_RE.fullmatch(schema):
        raise ValueError(f"postgres schema must be a lower-case SQL identifier ([a-z_][a-z0-9_]*, at most 63 "
                         f"characters), not {schema!r}")
    return schema


class PostgresDatabase:
    """A connection pool on one database and schema; the schema is created or migrated at open. A call
    waits at most ``timeout_s`` for a connection (all busy, or the server unreachable: the pool keeps
    reconnecting in the background) and then raises ``psycopg_pool.PoolTimeout`` (an
    ``psycopg.OperationalError``); connections are checked before use, so a restarted server is used again
    without a restart of ours."""

    def __init__(self, dsn: str, *, schema: str = DEFAULT_SCHEMA, pool_size: int = DEFAULT_POOL_SIZE,
                 timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "trainguard") -> None:
        if not dsn:
            raise ValueError("TRAINGUARD_STATE_STORE=postgres needs TRAINGUARD_POSTGRES_DSN (a libpq "
                             "connection string or postgresql:// URL)")
        self.schema = check_schema_name(schema)
        search_path = sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema))

        def configure(conn: psycopg.Connection[Any]) -> None:
            conn.execute(search_path)
            conn.commit()

        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            dsn, min_size=1, max_size=max(1, int(pool_size)), open=False, configure=configure,
            check=ConnectionPool.check_connection, name=name, timeout=timeout_s,
            kwargs={"application_name": name})
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except PoolTimeout:
            self._pool.close()
            raise RuntimeError(f"cannot connect to PostgreSQL within {timeout_s:g} s "
                               f"(TRAINGUARD_POSTGRES_DSN: {_redacted(dsn)})") from None
        try:
            self._migrate()
        except BaseException:
            self._pool.close()
            raise

    def _migrate(self) -> None:
        with self._pool.connection() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)).fetchone()
            if found is None:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                         "applied_ns BIGINT NOT NULL)")
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
            current = int(row[0]) if row else 0
            if current > SCHEMA_VERSION:
                raise RuntimeError(f"PostgreSQL schema {self.schema!r} has version {current}; this server "
                                   f"knows {SCHEMA_VERSION}: upgrade trainguard-server")
            for version in range(current + 1, SCHEMA_VERSION + 1):
                conn.execute(MIGRATIONS[version])
                conn.execute("INSERT INTO schema_version (version, applied_ns) VALUES (%s, %s)",
                             (version, time.time_ns()))

    def version(self) -> int:
        """The schema version recorded in the database."""
        with self.read() as conn:
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        return int(row[0]) if row else 0

    @contextmanager
    def read(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for reads (one transaction: the statements inside see one snapshot only
        as far as READ COMMITTED goes; each statement sees every commit made before it started)."""
        with self._pool.connection() as conn:
            yield conn

    def write(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``work`` in one transaction, committed before this returns; retried (from the start) when
        PostgreSQL aborts it for a deadlock or a serialization failure."""
        for attempt in range(_RETRIES):
            try:
                with self._pool.connection() as conn:
                    return work(conn)
            except (errors.DeadlockDetected, errors.SerializationFailure):
                if attempt == _RETRIES - 1:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._pool.close()


def _redacted(dsn: str) -> str:
    """The DSN without its password (URL or key=value form)."""
    dsn = re.sub(r"(postgres(?:ql)?://[^:/@]*:)[^@]*@", r"\1***@", dsn)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)


def _page(rows: List[T], limit: int, make_cursor: Callable[[T], str]) -> Page[T]:
    """``rows`` holds up to ``limit + 1`` entries: the extra one only says that a next page exists."""
    if len(rows) > limit:
        rows = rows[:limit]
        return Page(items=rows, next_cursor=make_cursor(rows[-1]))
    return Page(items=rows)


def _last_per_key(items: Sequence[T], key: Callable[[T], Tuple[str, ...]]) -> List[Tuple[Tuple[str, ...], T]]:
    """The last item of each key, in key order (a batch upserted in key order cannot deadlock another)."""
    latest: Dict[Tuple[str, ...], T] = {}
    for item in items:
        latest[key(item)] = item
    return sorted(latest.items(), key=lambda kv: kv[0])


# ----------------------------------------------------------------------------------------------------------
# Runs, incidents, clusters, workflow, state
# ----------------------------------------------------------------------------------------------------------


class PostgresIncidentStore(IncidentStore):
    """Records as JSON documents plus the columns listings filter and order on; upserts replace the whole
    document (clusters: see :meth:`merge_clusters`). Listings are newest first with keyset cursors
    ``(ns, id)``, the same cursors the SQLite store issues."""

    def __init__(self, dsn: str = "", *, schema: str = DEFAULT_SCHEMA, pool_size: int = DEFAULT_POOL_SIZE,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cluster_max_members: Optional[int] = None,
                 db: Optional[PostgresDatabase] = None) -> None:
        self._db = db or PostgresDatabase(dsn, schema=schema, pool_size=pool_size, timeout_s=timeout_s,
                                          name="trainguard-incidents")
        self._max_members = int(cluster_max_members or DetectionSettings().cluster_max_members)

    @property
    def database(self) -> PostgresDatabase:
        return self._db

    # runs
    def upsert_runs(self, runs: Sequence[RunRecord]) -> None:
        if runs:
            self._db.write(self._runs_work(runs))

    def upsert_records(self, runs: Sequence[RunRecord], incidents: Sequence[Incident],
                       clusters: Sequence[Cluster]) -> None:
        """The three upserts in one transaction (one commit, one round of retries on a deadlock)."""
        works = []
        if runs:
            works.append(self._runs_work(runs))
        if incidents:
            works.append(self._incidents_work(incidents))
        if clusters:
            works.append(self._clusters_work(clusters))
        if not works:
            return

        def work(conn: psycopg.Connection[Any]) -> None:
            for part in works:
                part(conn)

        self._db.write(work)

    def _runs_work(self, runs: Sequence[RunRecord]) -> Callable[[psycopg.Connection[Any]], None]:
        batch = _last_per_key(runs, lambda r: (_k(r.project), _k(r.run_id)))
        rows = [(p, rid, _k(r.status), int(r.started_ns), int(r.last_event_ns), json.dumps(r.to_dict()))
                for (p, rid), r in batch]
        tags = [(p, rid, _k(str(k)), _k(str(v))) for (p, rid), r in batch for k, v in r.tags.items()]

        def work(conn: psycopg.Connection[Any]) -> None:
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO runs (project, run_id, status, started_ns, last_event_ns, doc) "
                    "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (project, run_id) DO UPDATE SET "
                    "status = EXCLUDED.status, started_ns = EXCLUDED.started_ns, "
                    "last_event_ns = EXCLUDED.last_event_ns, doc = EXCLUDED.doc", rows)
                cur.execute("DELETE FROM run_tags t USING unnest(%s::text[], %s::text[]) "
                            "AS u(project, run_id) WHERE t.project = u.project AND t.run_id = u.run_id",
                            ([k[0] for k, _ in batch], [k[1] for k, _ in batch]))
                if tags:
                    cur.executemany("INSERT INTO run_tags (project, run_id, key, value) "
                                    "VALUES (%s, %s, %s, %s) ON CONFLICT (project, run_id, key) "
                                    "DO UPDATE SET value = EXCLUDED.value",
                                    tags)

        return work

    def get_run(self, project: str, run_id: str) -> Optional[RunRecord]:
        doc = self._doc("SELECT doc FROM runs WHERE project = %s AND run_id = %s", (_k(project), _k(run_id)))
        return RunRecord.from_dict(doc) if doc is not None else None

    def list_runs(self, project: str, *, status: Optional[str] = None, tag: Optional[str] = None,
                  limit: int = 50, cursor: Optional[str] = None) -> Page[RunRecord]:
        where, args = ["project = %s"], [_k(project)]
        if status is not None:
            where.append("status = %s")
            args.append(_k(status))
        if tag is not None:
            key, value = parse_tag_filter(tag)
            sub = ("SELECT 1 FROM run_tags t WHERE t.project = runs.project AND t.run_id = runs.run_id "
                   "AND t.key = %s")
            args.append(_k(key))
            if value is not None:
                sub += " AND t.value = %s"
                args.append(_k(value))
            where.append(f"EXISTS ({sub})")
        return self._list("runs", "run_id", "last_event_ns", where, args, [project, status, tag], limit,
                          cursor, RunRecord.from_dict)

    # incidents
    def upsert_incidents(self, incidents: Sequence[Incident]) -> None:
        if incidents:
            self._db.write(self._incidents_work(incidents))

    @staticmethod
    def _incidents_work(incidents: Sequence[Incident]) -> Callable[[psycopg.Connection[Any]], None]:
        batch = _last_per_key(incidents, lambda i: (_k(i.project), _k(i.incident_id)))
        rows = [(p, iid, _k(i.run_id), _k(i.status), int(i.first_ns), int(i.last_ns), json.dumps(i.to_dict()))
                for (p, iid), i in batch]

        def work(conn: psycopg.Connection[Any]) -> None:
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO incidents (project, incident_id, run_id, status, first_ns, last_ns, doc) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (project, incident_id) DO UPDATE SET "
                    "run_id = EXCLUDED.run_id, status = EXCLUDED.status, first_ns = EXCLUDED.first_ns, "
                    "last_ns = EXCLUDED.last_ns, doc = EXCLUDED.doc", rows)

        return work

    def get_incident(self, project: str, incident_id: str) -> Optional[Incident]:
        doc = self._doc("SELECT doc FROM incidents WHERE project = %s AND incident_id = %s",
                        (_k(project), _k(incident_id)))
        return Incident.from_dict(doc) if doc is not None else None

    def list_incidents(self, project: str, *, run_id: Optional[str] = None, status: Optional[str] = None,
                       limit: int = 50, cursor: Optional[str] = None) -> Page[Incident]:
        where, args = ["project = %s"], [_k(project)]
        if run_id is not None:
            where.append("run_id = %s")
            args.append(_k(run_id))
        if status is not None:
            where.append("status = %s")
            args.append(_k(status))
        return self._list("incidents", "incident_id", "first_ns", where, args, [project, run_id, status],
                          limit, cursor, Incident.from_dict)

    def incident_briefs(self, project: str, run_ids: Sequence[str], *,
                        limit: int = 500) -> Dict[str, Optional[List[IncidentBrief]]]:
        """Two statements in one read: the runs over ``limit``, then the others' documents (read here for
        their fields, without building records: they hold NaN, which PostgreSQL's JSON types refuse)."""
        asked: Dict[str, List[str]] = {}  # a stored key holds U+FFFD for a NUL: answer the ids asked
        for run_id in dict.fromkeys(run_ids):
            asked.setdefault(_k(run_id), []).append(run_id)
        out: Dict[str, Optional[List[IncidentBrief]]] = {r: [] for keys in asked.values() for r in keys}
        if not asked:
            return out
        with self._db.read() as conn:
            over = {row[0] for row in conn.execute(
                "SELECT run_id FROM incidents WHERE project = %s AND run_id = ANY(%s) GROUP BY run_id "
                "HAVING COUNT(*) > %s", (_k(project), list(asked), int(limit))).fetchall()}
            rest = [key for key in asked if key not in over]
            rows = conn.execute(
                "SELECT run_id, status, doc FROM incidents WHERE project = %s AND run_id = ANY(%s) "
                "ORDER BY run_id, first_ns DESC, incident_id", (_k(project), rest)).fetchall() if rest else []
        for key in over:
            for run_id in asked[key]:
                out[run_id] = None
        for key, status, doc in rows:
            fields = json.loads(doc)
            for run_id in asked[key]:
                briefs = out[run_id]
                assert briefs is not None  # a run over the limit has no rows here
                briefs.append(IncidentBrief(fields["incident_id"], run_id, status, fields["category"],
                                            fields["subtype"], fields["severity"]))
        return out

    # clusters
    def upsert_clusters(self, clusters: Sequence[Cluster]) -> None:
        """Replace each cluster by the record (its views from :meth:`merge_clusters` are dropped; the
        record becomes the view of source '')."""
        if clusters:
            self._db.write(self._clusters_work(clusters))

    def _clusters_work(self, clusters: Sequence[Cluster]) -> Callable[[psycopg.Connection[Any]], None]:
        batch = _last_per_key(clusters, lambda c: (_k(c.project), _k(c.fingerprint)))

        def work(conn: psycopg.Connection[Any]) -> None:
            now = time.time_ns()
            for (project, fp), c in batch:
                self._lock_cluster(conn, project, fp)
                doc = json.dumps(c.to_dict())
                conn.execute("DELETE FROM cluster_views WHERE project = %s AND fingerprint = %s",
                             (project, fp))
                conn.execute("INSERT INTO cluster_views (project, fingerprint, source, doc, updated_ns) "
                             "VALUES (%s, %s, '', %s, %s)", (project, fp, doc, now))
                self._put_cluster(conn, project, fp, c, doc)

        return work

    def merge_clusters(self, source: str, clusters: Sequence[Cluster]) -> None:
        """Join each record into ``source``'s view of its cluster and store the merge of all the cluster's
        views (:func:`merge_views`), in one transaction; a view that adds nothing writes nothing."""
        if not clusters:
            return
        grouped: Dict[Tuple[str, str], List[Cluster]] = {}
        for c in clusters:
            grouped.setdefault((_k(c.project), _k(c.fingerprint)), []).append(c)
        src = _k(source)

        def work(conn: psycopg.Connection[Any]) -> None:
            now = time.time_ns()
            for (project, fp), given in sorted(grouped.items()):
                self._lock_cluster(conn, project, fp)
                rows = conn.execute("SELECT source, doc FROM cluster_views WHERE project = %s AND "
                                    "fingerprint = %s", (project, fp)).fetchall()
                views = {row[0]: Cluster.from_dict(json.loads(row[1])) for row in rows}
                changed = join_source(views, src, given, self._max_members)
                if changed is None:
                    continue  # idempotent: nothing new from this source
                joined, total = changed
                conn.execute("INSERT INTO cluster_views (project, fingerprint, source, doc, updated_ns) "
                             "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (project, fingerprint, source) "
                             "DO UPDATE SET doc = EXCLUDED.doc, updated_ns = EXCLUDED.updated_ns",
                             (project, fp, src, json.dumps(joined.to_dict()), now))
                self._put_cluster(conn, project, fp, total, json.dumps(total.to_dict()))

        self._db.write(work)

    @staticmethod
    def _lock_cluster(conn: psycopg.Connection[Any], project: str, fingerprint: str) -> None:
        """Serialise the writers of one cluster until the transaction ends (a 64-bit hash of its key: a
        collision only makes two clusters' writers wait for each other)."""
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                     (f"trainguard.cluster\x1f{project}\x1f{fingerprint}",))

    @staticmethod
    def _put_cluster(conn: psycopg.Connection[Any], project: str, fp: str, c: Cluster, doc: str) -> None:
        conn.execute("INSERT INTO clusters (project, fingerprint, first_ns, last_ns, doc) "
                     "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (project, fingerprint) DO UPDATE SET "
                     "first_ns = EXCLUDED.first_ns, "
                     "last_ns = EXCLUDED.last_ns, doc = EXCLUDED.doc",
                     (project, fp, int(c.first_ns), int(c.last_ns), doc))

    def get_cluster(self, project: str, fingerprint: str) -> Optional[Cluster]:
        doc = self._doc("SELECT doc FROM clusters WHERE project = %s AND fingerprint = %s",
                        (_k(project), _k(fingerprint)))
        return Cluster.from_dict(doc) if doc is not None else None

    def list_clusters(self, project: str, *, limit: int = 50,
                      cursor: Optional[str] = None) -> Page[Cluster]:
        return self._list("clusters", "fingerprint", "last_ns", ["project = %s"], [_k(project)], [project],
                          limit, cursor, Cluster.from_dict)

    # workflow
    def get_workflow(self, project: str, incident_id: str) -> Optional[IncidentWorkflow]:
        doc = self._doc("SELECT doc FROM incident_workflow WHERE project = %s AND incident_id = %s",
                        (_k(project), _k(incident_id)))
        return IncidentWorkflow.from_dict(doc) if doc is not None else None

    def get_workflows(self, project: str, incident_ids: Sequence[str]) -> Dict[str, IncidentWorkflow]:
        asked: Dict[str, List[str]] = {}  # a stored key holds U+FFFD for a NUL: answer the ids asked
        for incident_id in dict.fromkeys(incident_ids):
            asked.setdefault(_k(incident_id), []).append(incident_id)
        if not asked:
            return {}
        with self._db.read() as conn:
            rows = conn.execute("SELECT incident_id, doc FROM incident_workflow WHERE project = %s AND "
                                "incident_id = ANY(%s)", (_k(project), list(asked))).fetchall()
        return {incident_id: IncidentWorkflow.from_dict(json.loads(doc))
                for key, doc in rows for incident_id in asked[key]}

    def save_workflow(self, workflow: IncidentWorkflow) -> None:
        w = workflow
        row = (_k(w.project), _k(w.incident_id), _k(w.category), _k(w.subtype), int(w.resolved_ns),
               w.root_cause, json.dumps(w.to_dict()))
        self._db.write(lambda conn: conn.execute(
            "INSERT INTO incident_workflow (project, incident_id, category, subtype, resolved_ns, "
            "root_cause, doc) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (project, incident_id) "
            "DO UPDATE SET "
            "category = EXCLUDED.category, subtype = EXCLUDED.subtype, resolved_ns = EXCLUDED.resolved_ns, "
            "root_cause = EXCLUDED.root_cause, doc = EXCLUDED.doc", row))

    def resolved_like(self, project: str, category: str, subtype: str, *,
                      limit: int = 20) -> List[IncidentWorkflow]:
        with self._db.read() as conn:
            rows = conn.execute(
                "SELECT doc FROM incident_workflow WHERE project = %s AND category = %s AND subtype = %s AND "
                "resolved_ns > 0 AND root_cause <> '' ORDER BY resolved_ns DESC, incident_id LIMIT %s",
                (_k(project), _k(category), _k(subtype), int(limit))).fetchall()
        return [IncidentWorkflow.from_dict(json.loads(r[0])) for r in rows]

    # state
    def save_states(self, items: Mapping[str, Optional[bytes]]) -> None:
        if not items:
            return
        # every value is checked before anything is written (a bad one raises TypeError, nothing changes)
        puts = sorted((_k(key), bytes(value)) for key, value in items.items() if value is not None)
        deletes = sorted(_k(key) for key, value in items.items() if value is None)

        def work(conn: psycopg.Connection[Any]) -> None:
            now = time.time_ns()
            with conn.cursor() as cur:
                if deletes:
                    cur.execute("DELETE FROM state WHERE key = ANY(%s)", (deletes,))
                if puts:
                    cur.executemany("INSERT INTO state (key, value, updated_ns) VALUES (%s, %b, %s) "
                                    "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, "
                                    "updated_ns = EXCLUDED.updated_ns", [(k, v, now) for k, v in puts])

        self._db.write(work)

    def load_state(self, key: str) -> Optional[bytes]:
        with self._db.read() as conn:
            row = conn.execute("SELECT value FROM state WHERE key = %s", (_k(key),)).fetchone()
        return bytes(row[0]) if row else None

    def state_keys(self, prefix: str) -> List[str]:
        # a range over the primary key and starts_with, not LIKE: '%' and '_' in a prefix are plain characters
        with self._db.read() as conn:
            rows = conn.execute("SELECT key FROM state WHERE key >= %s AND starts_with(key, %s) ORDER BY key",
                                (_k(prefix), _k(prefix))).fetchall()
        return [r[0] for r in rows]

    # helpers
    def _doc(self, query: str, args: Tuple[Any, ...]) -> Optional[Dict[str, Any]]:
        with self._db.read() as conn:
            row = conn.execute(query, args).fetchone()
        return json.loads(row[0]) if row else None

    def _list(self, table: str, id_col: str, ns_col: str, where: List[str], args: List[Any],
              scope: List[Any], limit: int, cursor: Optional[str],
              load: Callable[[Dict[str, Any]], T]) -> Page[T]:
        """Newest first by ``ns_col``, ties by ``id_col`` ascending; keyset cursor ``(ns, id)``."""
        check_limit(limit)
        if cursor:
            ns, key = decode_cursor(cursor, table, scope, (int, str))
            where = [*where, f"({ns_col} < %s OR ({ns_col} = %s AND {id_col} > %s))"]
            args = [*args, ns, ns, _k(key)]
        with self._db.read() as conn:
            rows = conn.execute(
                f"SELECT {ns_col}, {id_col}, doc FROM {table} WHERE {' AND '.join(where)} "
                f"ORDER BY {ns_col} DESC, {id_col} LIMIT %s", [*args, limit + 1]).fetchall()
        page = _page(rows, limit, lambda r: encode_cursor(table, scope, [r[0], r[1]]))
        return Page(items=[load(json.loads(r[2])) for r in page.items], next_cursor=page.next_cursor)

    def close(self) -> None:
        self._db.close()


# ----------------------------------------------------------------------------------------------------------
# Projects and tokens
# ----------------------------------------------------------------------------------------------------------

_TOKEN_COLUMNS = "token_id, project, kind, created_ns, revoked, description, expires_ns"


def _token_info(row: Sequence[Any]) -> TokenInfo:
    return TokenInfo(token_id=row[0], project=row[1], kind=row[2], created_ns=int(row[3]),
                     revoked=bool(row[4]), description=row[5], expires_ns=int(row[6]))


class PostgresProjectStore(ProjectStore):
    """Projects and tokens, as :class:`~.sqlite.SqliteProjectStore`: token text ``tg_<kind>_<id>_<secret>``;
    the id is looked up, the secret's SHA-256 compared in constant time. Registering a token id that exists
    is refused by the primary key, so two pods registering the same bootstrap token cannot both succeed."""

    def __init__(self, dsn: str = "", *, schema: str = DEFAULT_SCHEMA, pool_size: int = DEFAULT_POOL_SIZE,
                 timeout_s: float = DEFAULT_TIMEOUT_S, db: Optional[PostgresDatabase] = None) -> None:
        self._db = db or PostgresDatabase(dsn, schema=schema, pool_size=pool_size, timeout_s=timeout_s,
                                          name="trainguard-projects")

    def create_token(self, project: str, kind: str, description: str = "", expires_ns: int = 0) -> str:
        check_project_name(project)
        text, token_id, secret = new_token(kind)
        self._insert(project, kind, token_id, secret, description, expires_ns)
        return text

    def add_token(self, project: str, kind: str, token: str, description: str = "") -> TokenInfo:
        check_project_name(project)
        token_id, secret = parse_operator_token(kind, token)
        return self._insert(project, kind, token_id, secret, description, 0)

    def _insert(self, project: str, kind: str, token_id: str, secret: str, description: str,
                expires_ns: int) -> TokenInfo:
        def work(conn: psycopg.Connection[Any]) -> TokenInfo:
            now = time.time_ns()
            conn.execute("INSERT INTO projects (name, created_ns) VALUES (%s, %s) "
                         "ON CONFLICT (name) DO NOTHING", (_k(project), now))
            row = conn.execute(
                "INSERT INTO tokens (token_id, project, kind, secret_sha256, created_ns, description, "
                "expires_ns) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (token_id) DO NOTHING "
                f"RETURNING {_TOKEN_COLUMNS}",
                (token_id, _k(project), kind, hash_secret(secret), now, _k(description),
                 int(expires_ns))).fetchone()
            if row is None:
                raise ValueError(f"token {token_id} already exists")
            return _token_info(row)

        return self._db.write(work)

    def lookup(self, token: str) -> Optional[TokenInfo]:
        parts = split_token(token)
        if parts is None:
            return None
        kind, token_id, secret = parts
        with self._db.read() as conn:
            row = conn.execute(f"SELECT {_TOKEN_COLUMNS}, secret_sha256 FROM tokens WHERE token_id = %s",
                               (token_id,)).fetchone()
        if row is None or not secret_matches(secret, row[7]):
            return None
        info = _token_info(row)
        return None if info.kind != kind else info

    def list_tokens(self, project: Optional[str] = None) -> List[TokenInfo]:
        query = f"SELECT {_TOKEN_COLUMNS} FROM tokens"
        args: List[Any] = []
        if project is not None:
            query += " WHERE project = %s"
            args.append(_k(project))
        with self._db.read() as conn:
            rows = conn.execute(query + " ORDER BY created_ns, token_id", args).fetchall()
        return [_token_info(r) for r in rows]

    def revoke(self, token_id: str) -> bool:
        """True when the token exists (it is revoked afterwards, idempotently); False when unknown."""
        def work(conn: psycopg.Connection[Any]) -> bool:
            done = conn.execute("UPDATE tokens SET revoked = TRUE WHERE token_id = %s", (_k(token_id),))
            return done.rowcount > 0

        return self._db.write(work)

    def close(self) -> None:
        self._db.close()


@dataclass
class PostgresStores:
    """The two PostgreSQL store families of one database and schema."""

    incidents: PostgresIncidentStore
    projects: PostgresProjectStore

    def close(self) -> None:
        self.incidents.close()
        self.projects.close()


def open_postgres_stores(dsn: str, *, schema: str = DEFAULT_SCHEMA, pool_size: int = DEFAULT_POOL_SIZE,
                         cluster_max_members: Optional[int] = None) -> PostgresStores:
    """Both families (each with its own pool), the schema created or migrated first."""
    incidents = PostgresIncidentStore(dsn, schema=schema, pool_size=pool_size,
                                      cluster_max_members=cluster_max_members)
    try:
        projects = PostgresProjectStore(dsn, schema=schema, pool_size=pool_size)
    except BaseException:
        incidents.close()
        raise
    return PostgresStores(incidents=incidents, projects=projects)


__all__ = [
    "DEFAULT_POOL_SIZE", "DEFAULT_SCHEMA", "MIGRATIONS", "SCHEMA_VERSION", "PostgresDatabase",
    "PostgresIncidentStore", "PostgresProjectStore", "PostgresStores", "check_schema_name", "merge_views",
    "open_postgres_stores",
]
