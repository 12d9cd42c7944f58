"""The production Flink path end to end (issue 5): recorded runs sent to a real ``trainguard gateway`` over
HTTP → the gateway's Kafka topic (Tansu) → the Flink job on a local mini-cluster reading it with Flink's
Kafka connector (flink-connector-kafka 4.0.1-2.0, tools/flink_jars.py) → JSON upserts on a results topic
(Flink's KafkaSink) → ``trainguard processor`` with ``TRAINGUARD_PROCESSOR_RUNTIME=flink`` storing them
(and the raw context from the ingest topic) → the stores. Every run ends with exactly its corpus verdict,
every raw-context event is stored, and only the runs sent appear. The job runs unbounded, as in
production, with processing-time ticks; the test stops it."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

from confluent_kafka.admin import AdminClient, NewTopic

from tests.scenarios.corpus import BY_NAME, retimed
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.processes import bootstrap_tokens, healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_server.storage.sqlite import open_sqlite_stores

REPO = Path(__file__).resolve().parents[3]
FLINK_PYTHON = Path(os.environ.get("TRAINGUARD_FLINK_PYTHON", REPO / ".venv-flink" / "bin" / "python"))
RUNS = ("crash", "explosion", "nan_source", "clip_stale", "healthy_mlp", "dist_mismatch", "dist_nan_one_rank")
DEADLINE_S = 240.0


def test_gateway_kafka_flink_kafka_yields_every_runs_verdict(tmp_path: Path) -> None:
    broker = Tansu(tmp_path / "tansu.log").start()
    topic, results = f"ingest-{uuid.uuid4().hex[:8]}", f"results-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
               TRAINGUARD_KAFKA_TOPIC=topic, TRAINGUARD_KAFKA_PARTITIONS="2",
               TRAINGUARD_DATA_DIR=str(tmp_path / "data"), TRAINGUARD_HOST="127.0.0.1")
    procs: List[subprocess.Popen[str]] = []
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        admin.create_topics([NewTopic(results, num_partitions=1, replication_factor=1)])[results].result(30)
        gateway = start_role("gateway", env, tmp_path / "gateway.log", "--http-port", str(port),
                             "--grpc-port", str(free_port()))
        procs.append(gateway)
        assert poll(lambda: healthy(port), 30), (tmp_path / "gateway.log").read_text()
        tokens: Dict[str, Any] = poll(lambda: bootstrap_tokens(tmp_path / "data"), 30) or {}
        assert tokens
        expected: Dict[str, Any] = {}
        raw_ids: List[str] = []
        sender = HttpTransport(f"http://127.0.0.1:{port}", tokens["ingest"], "trainguard-test")
        for name in RUNS:
            events = retimed(BY_NAME[name].events(), time.time_ns() - 10**9)
            run_id = f"{name}-{uuid.uuid4().hex[:6]}"
            for e in events:
                e["run_id"], e["project"] = run_id, tokens["project"]
            for i in range(0, len(events), 50):
                assert not sender.send(events[i:i + 50], 30.0).rejected
            expected[run_id] = BY_NAME[name].expected
            raw_ids += [e["event_id"] for e in events if "exception" in e or "lifecycle" in e or "log" in e]
        sender.close()

        flink_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"),
                                                                str(REPO / "services" / "src")]),
                         TRAINGUARD_DETECTION_OVERRIDES=json.dumps({"stall_min_s": 5.0}))
        flink = subprocess.Popen(
            [str(FLINK_PYTHON), "-m", "trainguard_server.processor.flink_main", "--kafka", broker.bootstrap,
             "--topic", topic, "--results-topic", results, "--group-id", f"flink-{uuid.uuid4().hex[:6]}",
             "--client-config", json.dumps({"fetch.max.wait.ms": "20"}), "--parallelism", "2"],
            env=flink_env, cwd=tmp_path, stdout=open(tmp_path / "flink.log", "w"), stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        procs.append(flink)

        stores_env = dict(env, TRAINGUARD_PROCESSOR_RUNTIME="flink", TRAINGUARD_KAFKA_RESULTS_TOPIC=results,
                          TRAINGUARD_KAFKA_CLIENT_CONFIG=json.dumps({"fetch.wait.max.ms": 10}))
        procs.insert(0, start_role("processor", stores_env, tmp_path / "processor.log"))

        def verdicts() -> Dict[str, List[Any]]:
            stores = open_sqlite_stores(tmp_path / "data")
            try:
                return {run_id: sorted((i.category, i.subtype) for i in stores.incidents.list_incidents(
                    tokens["project"], run_id=run_id).items if not i.explained_by) for run_id in expected}
            finally:
                stores.close()

        def settled() -> bool:
            assert flink.poll() is None, (tmp_path / "flink.log").read_text()[-4000:]
            if verdicts() != {r: ([k] if k else []) for r, k in expected.items()}:
                return False
            # a healthy run has no incident to wait for: it has settled once its run record is stored
            stores = open_sqlite_stores(tmp_path / "data")
            try:
                return set(expected) <= {r.run_id for r in stores.incidents.list_runs(
                    tokens["project"], limit=100).items}
            finally:
                stores.close()

        assert poll(settled, DEADLINE_S, interval=0.5), (
            verdicts(), (tmp_path / "processor.log").read_text()[-2000:], (tmp_path / "flink.log").read_text()[-3000:])
        stores = open_sqlite_stores(tmp_path / "data")
        try:
            runs = {r.run_id: r for r in stores.incidents.list_runs(tokens["project"], limit=100).items}
            assert set(runs) == set(expected)
            (nan_run,) = [r for r in expected if r.startswith("dist_nan_one_rank")]
            (nan,) = [i for i in stores.incidents.list_incidents(tokens["project"], run_id=nan_run).items
                      if not i.explained_by]
            assert nan.lead_rank == BY_NAME["dist_nan_one_rank"].lead_rank
            assert poll(lambda: all(stores.events.get(tokens["project"], e) is not None for e in raw_ids), 60)
        finally:
            stores.close()
    finally:  # the Flink job with its mini-cluster's workers: a process group
        stop_all(procs, groups=[p for p in procs if p.args[0] == str(FLINK_PYTHON)])
        broker.stop(kill=True)
