"""What the PostgreSQL state stores do beyond the shared contracts (those run in
test_incident_store_contract.py / test_project_store_contract.py): clusters merged from several sources
(commutative, idempotent, concurrent), selection from settings, two "pods" sharing one database,
versioned migrations, NUL in keys, and a server that goes away and comes back. All against a real
PostgreSQL server (tests/support/postgres.py).
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import psycopg
import pytest

from tests.scenarios.corpus import SCENARIOS, retimed
from tests.services.storage.conftest import fresh_schema, postgres_dsn
from tests.support.postgres import PostgresServer
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Cluster, RunRecord
from trainguard_server.config import Settings
from trainguard_server.storage.postgres import (
    SCHEMA_VERSION,
    PostgresDatabase,
    PostgresIncidentStore,
    PostgresProjectStore,
)
from trainguard_server.storage.select import open_stores

RUNS = 6          # the recorded job replayed as this many runs
SOURCES = 3       # partitions: run i goes to source i % SOURCES
BATCH = 8         # events per pipeline call (each call's changed clusters are one merge)

Event = Dict[str, Any]


def replayed_runs() -> List[Event]:
    """The recorded two-rank gloo job ``dist_mismatch`` (both ranks raise the same RuntimeError) replayed
    as RUNS runs a second apart: new run and event ids, times shifted; every event in time order."""
    (scenario,) = [s for s in SCENARIOS if s.name == "dist_mismatch"]
    recorded = scenario.events()
    end = max(int(e["time_unix_nano"]) for e in recorded)
    out: List[Event] = []
    for i in range(RUNS):
        for event in retimed(recorded, end + i * 1_000_000_000):
            event["run_id"] = event["trace_id"] = f"{event['run_id']}-r{i}"
            event["event_id"] = f"{event['event_id']}-r{i}"
            out.append(event)
    out.sort(key=lambda e: int(e["time_unix_nano"]))
    return out


def source_of(event: Event) -> str:
    return f"partition-{int(event['run_id'].rsplit('-r', 1)[1]) % SOURCES}"


def per_source_outputs(events: Sequence[Event]) -> Dict[str, List[List[Cluster]]]:
    """Each source's own pipeline over its runs' events, BATCH at a time: the clusters each call changed
    (cumulative records, as the processor writes them)."""
    by_source: Dict[str, List[Event]] = {}
    for event in events:
        by_source.setdefault(source_of(event), []).append(event)
    out: Dict[str, List[List[Cluster]]] = {}
    for source, mine in sorted(by_source.items()):
        pipeline = Pipeline()
        outputs = []
        for start in range(0, len(mine), BATCH):
            clusters = pipeline.process(mine[start:start + BATCH]).clusters
            if clusters:
                outputs.append(clusters)
        out[source] = outputs
    return out


@pytest.fixture(scope="module")
def recorded() -> Tuple[Cluster, Dict[str, List[List[Cluster]]]]:
    """(the cluster one pipeline over every event builds, each source's outputs)."""
    events = replayed_runs()
    reference = Pipeline()
    reference.process(events)
    (cluster,) = reference.clusters()
    outputs = per_source_outputs(events)
    assert len(outputs) == SOURCES and all(outputs.values())
    return cluster, outputs


def interleaved(outputs: Dict[str, List[List[Cluster]]], seed: int) -> List[Tuple[str, List[Cluster]]]:
    """Every source's outputs, each source's in its own order, the sources shuffled among each other."""
    queues = {s: list(o) for s, o in outputs.items()}
    rng = random.Random(seed)
    order: List[Tuple[str, List[Cluster]]] = []
    while any(queues.values()):
        source = rng.choice(sorted(s for s, q in queues.items() if q))
        order.append((source, queues[source].pop(0)))
    return order


def assert_same_cluster(got: Cluster, want: Cluster) -> None:
    assert (got.count, got.first_ns, got.last_ns) == (want.count, want.first_ns, want.last_ns)
    assert (got.fingerprint, got.exc_type, got.message_template) == (want.fingerprint, want.exc_type,
                                                                      want.message_template)
    assert got.sample_event_id == want.sample_event_id and got.sample == want.sample
    assert (set(got.runs), set(got.ranks), set(got.hosts)) == (set(want.runs), set(want.ranks), set(want.hosts))


@pytest.fixture
def dsn(request: pytest.FixtureRequest) -> str:
    return postgres_dsn(request)


def test_clusters_merged_from_partitions_equal_one_pipeline_over_everything(
        recorded: Tuple[Cluster, Dict[str, List[List[Cluster]]]], dsn: str) -> None:
    reference, outputs = recorded
    assert reference.count == 2 * RUNS and len(reference.runs) == RUNS
    docs = []
    for seed in (1, 2):  # two arrival orders of the sources' writes, each into a fresh store
        store = PostgresIncidentStore(dsn, schema=fresh_schema())
        try:
            for source, clusters in interleaved(outputs, seed):
                store.merge_clusters(source, clusters)
            got = store.get_cluster(reference.project, reference.fingerprint)
            assert got is not None
            assert_same_cluster(got, reference)
            # idempotent: a replay after a restore re-sends older views, and the latest again
            for source, views in outputs.items():
                store.merge_clusters(source, views[0])
                store.merge_clusters(source, views[-1])
            assert store.get_cluster(reference.project, reference.fingerprint) == got
            docs.append(json.dumps(got.to_dict(), sort_keys=True))
        finally:
            store.close()
    assert docs[0] == docs[1]  # commutative: the same record whatever the order


def test_overwriting_upserts_lose_the_other_partitions_counts(
        recorded: Tuple[Cluster, Dict[str, List[List[Cluster]]]], dsn: str) -> None:
    """What merge_clusters exists for: with whole-record upserts the last partition to write wins."""
    reference, outputs = recorded
    store = PostgresIncidentStore(dsn, schema=fresh_schema())
    try:
        for _source, clusters in interleaved(outputs, 1):
            store.upsert_clusters(clusters)
        got = store.get_cluster(reference.project, reference.fingerprint)
        assert got is not None and got.count < reference.count
        assert len(got.runs) < len(reference.runs)
    finally:
        store.close()


def test_concurrent_partitions_on_separate_connections_merge_exactly(
        recorded: Tuple[Cluster, Dict[str, List[List[Cluster]]]], dsn: str) -> None:
    """One store (its own pool) per source, as separate processors hold; all write at once, repeatedly."""
    reference, outputs = recorded
    schema = fresh_schema()
    stores = {source: PostgresIncidentStore(dsn, schema=schema) for source in outputs}
    errors: List[BaseException] = []
    start = threading.Barrier(len(stores))

    def run(source: str) -> None:
        try:
            start.wait()
            for _ in range(3):  # the same views again: a processor re-applying after a crash
                for clusters in outputs[source]:
                    stores[source].merge_clusters(source, clusters)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(source,)) for source in stores]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        got = next(iter(stores.values())).get_cluster(reference.project, reference.fingerprint)
        assert got is not None
        assert_same_cluster(got, reference)
    finally:
        for store in stores.values():
            store.close()


def test_settings_select_postgres_and_two_servers_share_it(dsn: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, state_store="postgres", postgres_dsn=dsn, postgres_schema=fresh_schema())
    api, processor = open_stores(settings, tmp_path / "a"), open_stores(settings, tmp_path / "b")
    try:
        assert isinstance(api.incidents, PostgresIncidentStore) and isinstance(api.projects, PostgresProjectStore)
        token = api.projects.create_token("alpha", "ingest")
        info = processor.projects.authenticate(token)
        assert info is not None and info.project == "alpha"
        processor.incidents.upsert_runs([RunRecord(project="alpha", run_id="r1", last_event_ns=5)])
        processor.incidents.save_states({"partition/0": b"snapshot"})
        assert [r.run_id for r in api.incidents.list_runs("alpha").items] == ["r1"]
        assert api.incidents.load_state("partition/0") == b"snapshot"
        api.projects.revoke(info.token_id)
        assert processor.projects.authenticate(token) is None
    finally:
        api.close()
        processor.close()
    for name in ("incidents.db", "projects.db"):  # nothing of that state on the local disk
        assert not (tmp_path / "a" / name).exists() and not (tmp_path / "b" / name).exists()


def test_postgres_without_a_dsn_is_refused_with_the_setting_to_give(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, state_store="postgres", postgres_dsn="")
    with pytest.raises(ValueError, match="TRAINGUARD_POSTGRES_DSN"):
        open_stores(settings, tmp_path)


@pytest.mark.parametrize("schema", ["Trainguard", "a-b", "x; DROP TABLE runs", "", "a" * 64])
def test_bad_schema_names_are_value_errors(dsn: str, schema: str) -> None:
    with pytest.raises(ValueError, match="schema"):
        PostgresDatabase(dsn, schema=schema)


def test_schema_is_migrated_once_by_concurrent_starts_and_newer_schemas_are_refused(dsn: str) -> None:
    schema = fresh_schema()
    opened: List[PostgresDatabase] = []
    errors: List[BaseException] = []

    def open_one() -> None:
        try:
            opened.append(PostgresDatabase(dsn, schema=schema, pool_size=1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == [] and len(opened) == 4
        assert opened[0].version() == SCHEMA_VERSION
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(f"SELECT version FROM {schema}.schema_version").fetchall()
            assert rows == [(SCHEMA_VERSION,)]
            conn.execute(f"INSERT INTO {schema}.schema_version VALUES (%s, 0)", (SCHEMA_VERSION + 1,))
    finally:
        for db in opened:
            db.close()
    with pytest.raises(RuntimeError, match="upgrade trainguard-server"):
        PostgresDatabase(dsn, schema=schema)


def test_nul_in_keys_and_tags_round_trips(dsn: str) -> None:
    store = PostgresIncidentStore(dsn, schema=fresh_schema())
    try:
        run = RunRecord(project="p", run_id="job\x00one", tags={"k\x00": "v\x00"}, last_event_ns=1)
        store.upsert_runs([run])
        assert store.get_run("p", "job\x00one") == run
        assert [r.run_id for r in store.list_runs("p", tag="k\x00=v\x00").items] == ["job\x00one"]
        store.save_state("key\x00", b"\x00")
        assert store.load_state("key\x00") == b"\x00" and store.state_keys("key") == ["key\ufffd"]
    finally:
        store.close()


def test_an_unreachable_server_fails_fast_without_the_password() -> None:
    port = PostgresServer().port  # a free port nobody listens on
    with pytest.raises(RuntimeError, match="cannot connect to PostgreSQL") as info:
        PostgresDatabase(f"postgresql://tg:s3cret@127.0.0.1:{port}/db?connect_timeout=1", timeout_s=2)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_a_restarted_server_is_used_again_and_a_failed_write_leaves_nothing() -> None:
    server = PostgresServer().start()
    try:
        store = PostgresIncidentStore(server.dsn(), schema="trainguard", pool_size=2, timeout_s=2)
        try:
            store.save_states({"a": b"1"})
            server.halt()
            with pytest.raises(psycopg.OperationalError):
                store.save_states({"a": b"2", "b": b"3"})
            server.start()
            assert store.load_state("a") == b"1" and store.load_state("b") is None
            store.save_states({"a": b"2", "b": b"3"})
            assert store.state_keys("") == ["a", "b"]
        finally:
            store.close()
    finally:
        server.stop()
