"""Split mode on shared state (issue 20): `trainguard gateway`, two `trainguard processor` processes in one
consumer group and two `trainguard api` processes, each with a data directory of its own (as pods on
different nodes have), sharing a 2-partition Kafka topic (Tansu) and PostgreSQL (a real server started here)
for runs, incidents, clusters, tokens and processor state. All five start at once (each registers the
operator's bootstrap tokens: the race of a shared store must not fail a start).

Recorded runs (the scenario corpus: real trainings as the SDK sent them) -- four copies of one crashing
training under different run ids and two of a gradient explosion, chosen so both partitions get runs -- are
sent to the gateway. Each run must get the verdict one pipeline over the whole run gives, be processed by
the processor owning its partition and by no other (its raw context and metrics are in that processor's
data directory only, its detection state under that partition's key only), and the crash's stack cluster,
fed by both processors' partitions, must count exactly what one pipeline over every run counts (the views
are merged in PostgreSQL, not overwritten). Both API processes -- one of which never saw an event -- serve
the same verdicts and accept the operator's tokens; what one writes (a revoked token) the other sees."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from tests.scenarios.corpus import BY_NAME, retimed
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.postgres import PostgresServer
from tests.support.processes import healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.embedded import PARTITION_PREFIX
from trainguard_server.storage.postgres import PostgresProjectStore, open_postgres_stores
from trainguard_server.storage.sqlite import EVENTS_DB, METRICS_DB, SqliteEventStore, SqliteMetricStore

INGEST = "tg_ingest_" + "1a" * 8 + "_" + "2b" * 24
READ = "tg_read_" + "3c" * 8 + "_" + "4d" * 24
PARTITIONS = 2
PROJECT = "default"
# the processor logs its partition assignments (INFO of the Kafka queue); otherwise `trainguard processor`
PROCESSOR = ("import logging, sys; from trainguard_server.cli import main; "
             "logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(name)s %(levelname)s %(message)s'); "
             "logging.getLogger('trainguard.queue.kafka').setLevel(logging.INFO); sys.exit(main(['processor']))")
ASSIGNMENT = re.compile(r"(assigned|revoked|lost) \S+ partitions \[([\d, ]*)\]")


def _call(url: str, token: str, body: Optional[Dict[str, Any]] = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}
    except (urllib.error.URLError, OSError, ValueError):
        return None


def murmur2_partition(key: str, partitions: int) -> int:
    """The partition Kafka's Java producer (and librdkafka's ``murmur2_random``, which the queue uses) picks
    for ``key``: ``toPositive(murmur2(key)) % partitions``."""
    data = key.encode()
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    whole = len(data) & ~3
    for i in range(0, whole, 4):
        k = (int.from_bytes(data[i:i + 4], "little") * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = len(data) & 3
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h = ((h ^ data[whole]) * m) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * m) & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def _run_ids(name: str, per_partition: int) -> List[str]:
    """``per_partition`` fresh run ids of scenario ``name`` landing on each partition."""
    tag = uuid.uuid4().hex[:6]
    chosen: Dict[int, List[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(ids) < per_partition for ids in chosen.values()):
        run_id = f"pg-{name}-{tag}-{i}"
        ids = chosen[murmur2_partition(run_id, PARTITIONS)]
        if len(ids) < per_partition:
            ids.append(run_id)
        i += 1
    return [r for ids in chosen.values() for r in ids]


def _owned(log: Path) -> Set[int]:
    """The partitions a processor owns now, from its log's assignment lines."""
    owned: Set[int] = set()
    text = log.read_text(errors="replace") if log.exists() else ""
    for action, numbers in ASSIGNMENT.findall(text):
        parts = {int(n) for n in numbers.replace(" ", "").split(",") if n}
        owned = owned | parts if action == "assigned" else owned - parts
    return owned


def _verdict(incidents: Any) -> List[Tuple[str, str]]:
    return sorted((i["category"], i["subtype"]) for i in incidents)


def _stored_runs(data_dir: Path, runs: List[str]) -> Set[str]:
    """Which of ``runs`` the processor of ``data_dir`` wrote raw context or metrics of."""
    events, metrics = SqliteEventStore(data_dir / EVENTS_DB), SqliteMetricStore(data_dir / METRICS_DB)
    try:
        return {r for r in runs if events.list_for_run(PROJECT, r, limit=1).items or metrics.names(PROJECT, r)}
    finally:
        events.close()
        metrics.close()


def _state_runs(dsn: str) -> Dict[int, Set[str]]:
    """The runs in each partition's detection state saved in PostgreSQL."""
    stores = open_postgres_stores(dsn)
    try:
        out: Dict[int, Set[str]] = {}
        for partition in range(PARTITIONS):
            prefix = f"{PARTITION_PREFIX}{partition}/"
            parts = {k[len(prefix):]: stores.incidents.load_state(k) for k in stores.incidents.state_keys(prefix)}
            pipeline = Pipeline.restore_parts({k: v for k, v in parts.items() if v is not None})
            out[partition] = {r.run_id for r in pipeline.runs()}
        return out
    finally:
        stores.close()


def test_two_processors_and_two_api_processes_share_postgres(tmp_path: Path) -> None:
    pg = PostgresServer().start()
    broker = Tansu(tmp_path / "tansu.log").start()
    procs: List[subprocess.Popen[str]] = []
    try:
        dsn = pg.create_database("trainguard")
        base = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
                    TRAINGUARD_KAFKA_TOPIC=f"pg-{uuid.uuid4().hex[:8]}", TRAINGUARD_KAFKA_PARTITIONS=str(PARTITIONS),
                    TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000", TRAINGUARD_HOST="127.0.0.1",
                    TRAINGUARD_STATE_STORE="postgres", TRAINGUARD_POSTGRES_DSN=dsn,
                    TRAINGUARD_BOOTSTRAP_INGEST_TOKEN=INGEST, TRAINGUARD_BOOTSTRAP_READ_TOKEN=READ,
                    TRAINGUARD_MAX_PAST_AGE_S=str(10 * 365 * 86400), TRAINGUARD_SNAPSHOT_EVERY_S="0.5")

        def env(name: str) -> Dict[str, str]:
            return dict(base, TRAINGUARD_DATA_DIR=str(tmp_path / name))

        ports = {"gateway": free_port(), "api1": free_port(), "api2": free_port()}
        logs = {name: tmp_path / f"{name}.log" for name in ("gateway", "proc0", "proc1", "api1", "api2")}
        # all at once, each on its own data dir: each registers the bootstrap tokens in PostgreSQL
        procs.append(start_role("gateway", env("gateway"), logs["gateway"], "--http-port",
                                str(ports["gateway"]), "--grpc-port", str(free_port())))
        for name in ("proc0", "proc1"):
            procs.append(subprocess.Popen([sys.executable, "-c", PROCESSOR], env=env(name),
                                          stdout=open(logs[name], "a"), stderr=subprocess.STDOUT, text=True))
        # api1 shares proc0's directory (its raw context and metrics); api2 has only PostgreSQL
        procs.append(start_role("api", env("proc0"), logs["api1"], "--http-port", str(ports["api1"])))
        procs.append(start_role("api", env("api2"), logs["api2"], "--http-port", str(ports["api2"])))
        for name in ("gateway", "api1", "api2"):
            assert poll(lambda port=ports[name]: healthy(port), 60), logs[name].read_text()[-3000:]
        # the group settles: one partition each (sent before, a run could move mid-stream)
        assert poll(lambda: all(len(_owned(logs[n])) == 1 for n in ("proc0", "proc1")), 60), \
            (logs["proc0"].read_text()[-2000:], logs["proc1"].read_text()[-2000:])
        owner = {p: n for n in ("proc0", "proc1") for p in _owned(logs[n])}
        assert sorted(owner) == list(range(PARTITIONS))

        crashes, explosions = _run_ids("crash", 2), _run_ids("explosion", 1)
        runs = crashes + explosions
        end_ns = time.time_ns() - 10**9
        streams: Dict[str, List[Dict[str, Any]]] = {}
        for run_id in runs:
            events = retimed(BY_NAME["crash" if run_id in crashes else "explosion"].events(), end_ns)
            for e in events:
                e["run_id"], e["project"] = run_id, PROJECT
            streams[run_id] = events
        sender = HttpTransport(f"http://127.0.0.1:{ports['gateway']}", INGEST, "trainguard-test")
        try:
            for run_id in runs:
                events = streams[run_id]
                for i in range(0, len(events), 50):
                    result = sender.send(events[i:i + 50], 30.0)
                    assert not result.rejected, result.rejected[:2]
        finally:
            sender.close()

        # what one pipeline that saw each run whole decides, and one that saw every run (the cluster)
        expected: Dict[str, List[Tuple[str, str]]] = {}
        everything = Pipeline()
        for run_id in runs:
            one = Pipeline()
            for i in range(0, len(streams[run_id]), 50):
                one.process(streams[run_id][i:i + 50])
                everything.process(streams[run_id][i:i + 50])
            expected[run_id] = _verdict(x.to_dict() for x in one.incidents())
        (cluster,) = everything.clusters()
        assert cluster.count == len(crashes) and sorted(cluster.runs) == sorted(crashes)

        apis = {name: f"http://127.0.0.1:{ports[name]}" for name in ("api1", "api2")}
        found: Dict[str, Dict[str, List[Tuple[str, str]]]] = {}
        for name, api in apis.items():
            found[name] = {}
            for run_id in runs:
                url = f"{api}/api/v1/runs/{run_id}/incidents"
                items = poll(lambda url=url: (_call(url, READ) or {}).get("items"), 60)
                assert items, (logs["proc0"].read_text()[-2000:], logs["proc1"].read_text()[-2000:])
                found[name][run_id] = _verdict(items)
        assert found["api2"] == expected
        assert expected[crashes[0]] == [("process", "exception")]
        assert expected[explosions[0]] == [("gradient", "explosion")]
        assert found["api1"] == found["api2"]
        for run_id in crashes:
            run = _call(f"{apis['api2']}/api/v1/runs/{run_id}", READ)
            assert run and run.get("run_id") == run_id and run.get("status") != "running"

        # each run was processed by its partition's owner and by no other
        by_partition = {p: {r for r in runs if murmur2_partition(r, PARTITIONS) == p} for p in range(PARTITIONS)}
        assert all(len(by_partition[p]) == 3 for p in range(PARTITIONS))
        for partition, name in owner.items():
            assert _stored_runs(tmp_path / name, runs) == by_partition[partition], name
        assert poll(lambda: _state_runs(dsn) == by_partition, 20), (_state_runs(dsn), by_partition)

        # the crash's cluster spans both partitions: both processors' views merged, the exact count
        def cluster_of(api: str) -> Any:
            items = (_call(f"{api}/api/v1/clusters", READ) or {}).get("items") or []
            got = [(c["fingerprint"], c["count"], sorted(c["runs"])) for c in items]
            return got if got == [(cluster.fingerprint, cluster.count, sorted(cluster.runs))] else None
        for api in apis.values():
            assert poll(lambda api=api: cluster_of(api), 20), _call(f"{api}/api/v1/clusters", READ)

        for name in ("incidents.db", "projects.db"):  # the shared state is in PostgreSQL only
            assert not any((tmp_path / d / name).exists() for d in ("gateway", "proc0", "proc1", "api2"))

        # what one API process writes, the other reads: a revoked token is refused by both at once
        store = PostgresProjectStore(dsn)
        try:
            extra = store.create_token(PROJECT, "read", "e2e")
            assert all(_call(f"{api}/api/v1/runs/{runs[0]}", extra) for api in apis.values())
            (info,) = [t for t in store.list_tokens(PROJECT) if t.description == "e2e"]
            assert store.revoke(info.token_id)
        finally:
            store.close()
        for api in apis.values():
            assert _call(f"{api}/api/v1/runs/{runs[0]}", extra) == {"status": 401}
        assert all(p.poll() is None for p in procs)  # every process still running
    finally:
        stop_all(procs)
        broker.stop(kill=True)
        pg.stop()
