"""The scale-out backends end to end: a real training with the SDK → gateway → **Kafka** (Tansu, a real
Kafka-protocol broker) → processor → **Elasticsearch** (noida-db's ES 8 API) for raw context and
**ClickHouse** (the chDB engine, through the same clickhouse-connect client) for metrics → query API.

The verdict, the full-text search hit and the metric series read back through the API must be what the
training really produced (its exception message, its number of steps), and each store must hold it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.scenarios import record as recorder
from tests.support.elasticsearch import NoidaElasticsearch
from tests.support.kafka import Tansu
from tests.support.waiting import poll
from trainguard_server.api.read_client import ReadClient
from trainguard_server.config import Settings
from trainguard_server.queue.kafka import KafkaQueue
from trainguard_server.server import EmbeddedServer
from trainguard_server.storage.clickhouse import ClickHouseMetricStore
from trainguard_server.storage.elasticsearch import ElasticsearchEventStore

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    broker = Tansu(tmp_path / "tansu.log").start()
    elastic = NoidaElasticsearch(tmp_path / "es").start()
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        data_dir=tmp_path / "server", host="127.0.0.1", http_port=0, grpc_port=0,
        queue="kafka", kafka_bootstrap_servers=broker.bootstrap, kafka_topic=f"ingest-{tag}", kafka_partitions=3,
        kafka_session_timeout_ms=6000, kafka_client_config='{"fetch.wait.max.ms": 10}',
        event_store="elasticsearch", elasticsearch_hosts=elastic.url, elasticsearch_index_prefix=f"tg{tag}",
        elasticsearch_replicas=0, metric_store="clickhouse", clickhouse_url=f"chdb://{tmp_path / 'ch'}")
    srv = EmbeddedServer(settings)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        elastic.stop()
        broker.stop(kill=True)




def test_a_crashing_training_through_kafka_elasticsearch_and_clickhouse(server: EmbeddedServer,
                                                                        tmp_path: Path) -> None:
    assert isinstance(server.queue, KafkaQueue)
    assert isinstance(server.stores.events, ElasticsearchEventStore)
    assert isinstance(server.stores.metrics, ClickHouseMetricStore)
    assert server.tokens is not None
    run_id = f"scale-out-crash-{uuid.uuid4().hex[:6]}"
    env = recorder.scenario_env("crash", server.http_url, str(tmp_path / "spool"))
    env.update(TRAINGUARD_TOKEN=server.tokens.ingest, TRAINGUARD_PROJECT=server.tokens.project,
               TRAINGUARD_RUN_ID=run_id)
    proc = subprocess.run([sys.executable, "-m", "tests.scenarios.trainings_process", "crash"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last_line = proc.stderr.strip().splitlines()[-1]  # "RuntimeError: shape '[32, 1, 8, 8]' is invalid ..."
    assert last_line.startswith("RuntimeError: ")
    api = ReadClient(server.http_url, server.tokens.read)

    incidents = poll(lambda: (api.get(f"/api/v1/runs/{run_id}/incidents") or {}).get("items"))
    assert incidents, f"no incident through Kafka; processor {server.processor.stats}"
    (incident,) = incidents
    assert (incident["category"], incident["subtype"]) == ("process", "exception")
    assert last_line[len("RuntimeError: "):] in incident["title"]

    # raw context: the traceback is searchable (Elasticsearch) and the hit is this run's exception
    words = "invalid for input of size"
    hits = poll(lambda: (api.get("/api/v1/search", q=f'"{words}"', run_id=run_id) or {}).get("items"))
    assert hits and hits[0]["event"]["run_id"] == run_id and hits[0]["event"]["kind"] == "exception"
    stored = server.stores.events.search(server.tokens.project, f'"{words}"', run_id=run_id)
    assert stored.items and stored.items[0].event.event_id == hits[0]["event"]["event_id"]

    # metrics: every completed step's loss is in ClickHouse and comes back through the API
    series = api.get(f"/api/v1/runs/{run_id}/metrics", names="loss", max_points=10000)["series"]
    buckets = series["loss"]["0"]
    assert sum(b["count"] for b in buckets) == incident["first_step"] + 1  # steps 0..first_step logged
    assert "loss" in server.stores.metrics.names(server.tokens.project, run_id)
