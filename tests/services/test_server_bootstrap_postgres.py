"""The bootstrap tokens when processes with data dirs of their own (pods on different nodes) start together
on one PostgreSQL state store: the data-dir lock does not serialize them, so two may both find the
operator's token missing and both register it. The one whose insert loses must start all the same (the
token now authenticates), not fail with "already exists"; a token id taken by another secret still fails.

The race is made certain, not left to timing: the test holds a SHARE lock on the tokens table, which lets
every process's check (a SELECT) through and holds every insert, and releases it only once all of them
wait on it."""

from __future__ import annotations

import multiprocessing
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List

import psycopg
import pytest

from tests.support.postgres import PostgresServer
from tests.support.waiting import poll
from trainguard_server.config import Settings
from trainguard_server.server import EmbeddedServer
from trainguard_server.storage.postgres import open_postgres_stores
from trainguard_server.storage.select import open_stores

PROCESSES = 3
OPERATOR_INGEST = "tg_ingest_" + "5e" * 8 + "_" + "6f" * 24
OPERATOR_READ = "tg_read_" + "7a" * 8 + "_" + "8b" * 24


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.stop()


def _settings(dsn: str, data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, state_store="postgres", postgres_dsn=dsn,
                    bootstrap_ingest_token=OPERATOR_INGEST, bootstrap_read_token=OPERATOR_READ)


def _bootstrap(dsn: str, data_dir: str, barrier: Any, out: Any) -> None:
    settings = _settings(dsn, Path(data_dir))
    server = EmbeddedServer(settings)
    server.data_dir.mkdir(parents=True)
    server.stores = open_stores(settings, server.data_dir)
    try:
        barrier.wait(30)
        tokens = server._bootstrap_tokens()
        out.put({"ingest": tokens.ingest, "read": tokens.read})
    except Exception as exc:  # reported to the test, which fails on it
        out.put({"error": repr(exc)})
    finally:
        server.stores.close()


def _waiting_on_locks(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'").fetchone()
    return int(row[0]) if row else 0


def test_processes_on_separate_data_dirs_register_the_same_token_at_once(pg: PostgresServer,
                                                                        tmp_path: Path) -> None:
    dsn = pg.create_database("b_" + uuid.uuid4().hex[:12])
    open_postgres_stores(dsn).close()  # the schema exists before the race, as after any first start
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_bootstrap, args=(dsn, str(tmp_path / f"node{i}"), barrier, out))
             for i in range(PROCESSES)]
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE trainguard.tokens IN SHARE MODE")  # inserts wait, SELECTs pass
        for p in procs:
            p.start()
        # every process checked (token missing) and now waits to insert: the race is certain
        assert poll(lambda: _waiting_on_locks(dsn) >= PROCESSES, 30), _waiting_on_locks(dsn)
        holder.commit()
    results: List[Dict[str, str]] = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert not [r for r in results if "error" in r], results
    assert results == [{"ingest": OPERATOR_INGEST, "read": OPERATOR_READ}] * PROCESSES

    stores = open_postgres_stores(dsn)
    try:
        ingest, read = stores.projects.authenticate(OPERATOR_INGEST), stores.projects.authenticate(OPERATOR_READ)
        assert ingest is not None and read is not None and (ingest.kind, read.kind) == ("ingest", "read")
        assert len([t for t in stores.projects.list_tokens() if t.description == "bootstrap"]) == 2
    finally:
        stores.close()


def test_a_token_id_taken_by_another_secret_still_fails_the_start(pg: PostgresServer, tmp_path: Path) -> None:
    dsn = pg.create_database("b_" + uuid.uuid4().hex[:12])
    taken = OPERATOR_INGEST[:-4] + "0000"  # same token id, another secret
    stores = open_postgres_stores(dsn)
    try:
        stores.projects.add_token("default", "ingest", taken, "someone else")
    finally:
        stores.close()
    server = EmbeddedServer(_settings(dsn, tmp_path / "node"))
    server.data_dir.mkdir(parents=True)
    server.stores = open_stores(server.settings, server.data_dir)
    try:
        with pytest.raises(ValueError, match="already exists"):
            server._bootstrap_tokens()
    finally:
        server.stores.close()
