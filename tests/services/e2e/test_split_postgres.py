"""Split mode on shared state (issue 20): `trainguard gateway`, `trainguard processor` and two `trainguard
api` processes, each with a data directory of its own (as pods on different nodes have), sharing a Kafka
topic (Tansu) and PostgreSQL (a real server started here) for runs, incidents, clusters and tokens. A
recorded crashing run sent to the gateway is judged by the processor, and both API processes -- one of
which never saw an event of it -- serve its verdict and accept the operator's tokens; what one API process
writes (a note on the incident, a revoked token) the other sees at once."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

from tests.scenarios.corpus import BY_NAME, retimed
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.postgres import PostgresServer
from tests.support.processes import healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_server.storage.postgres import PostgresProjectStore

INGEST = "tg_ingest_" + "1a" * 8 + "_" + "2b" * 24
READ = "tg_read_" + "3c" * 8 + "_" + "4d" * 24


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


def test_two_api_processes_and_a_processor_share_postgres(tmp_path: Path) -> None:
    pg = PostgresServer().start()
    broker = Tansu(tmp_path / "tansu.log").start()
    procs: List[subprocess.Popen[str]] = []
    try:
        dsn = pg.create_database("trainguard")
        base = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
                    TRAINGUARD_KAFKA_TOPIC=f"pg-{uuid.uuid4().hex[:8]}", TRAINGUARD_KAFKA_PARTITIONS="2",
                    TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000", TRAINGUARD_HOST="127.0.0.1",
                    TRAINGUARD_STATE_STORE="postgres", TRAINGUARD_POSTGRES_DSN=dsn,
                    TRAINGUARD_BOOTSTRAP_INGEST_TOKEN=INGEST, TRAINGUARD_BOOTSTRAP_READ_TOKEN=READ,
                    TRAINGUARD_MAX_PAST_AGE_S=str(10 * 365 * 86400), TRAINGUARD_SNAPSHOT_EVERY_S="0.5")

        def env(name: str) -> Dict[str, str]:
            return dict(base, TRAINGUARD_DATA_DIR=str(tmp_path / name))

        ports = {"gateway": free_port(), "api1": free_port(), "api2": free_port()}
        # the gateway first: it registers the bootstrap tokens in PostgreSQL, the others find them there
        procs.append(start_role("gateway", env("gateway"), tmp_path / "gateway.log", "--http-port",
                                str(ports["gateway"]), "--grpc-port", str(free_port())))
        assert poll(lambda: healthy(ports["gateway"]), 60), (tmp_path / "gateway.log").read_text()[-3000:]
        procs.append(start_role("processor", env("processor"), tmp_path / "processor.log"))
        # api1 shares the processor's directory (its raw context and metrics); api2 has only PostgreSQL
        procs.append(start_role("api", env("processor"), tmp_path / "api1.log", "--http-port", str(ports["api1"])))
        procs.append(start_role("api", env("api2"), tmp_path / "api2.log", "--http-port", str(ports["api2"])))
        for name in ("api1", "api2"):
            assert poll(lambda port=ports[name]: healthy(port), 60), (tmp_path / f"{name}.log").read_text()[-3000:]

        project = "default"
        run_id = f"pg-crash-{uuid.uuid4().hex[:6]}"
        events = retimed(BY_NAME["crash"].events(), time.time_ns() - 10**9)
        for e in events:
            e["run_id"], e["project"] = run_id, project
        sender = HttpTransport(f"http://127.0.0.1:{ports['gateway']}", INGEST, "trainguard-test")
        try:
            for i in range(0, len(events), 50):
                result = sender.send(events[i:i + 50], 30.0)
                assert not result.rejected, result.rejected[:2]
        finally:
            sender.close()

        apis = {name: f"http://127.0.0.1:{ports[name]}" for name in ("api1", "api2")}
        found = {}
        for name, api in apis.items():
            url = f"{api}/api/v1/runs/{run_id}/incidents"
            found[name] = poll(lambda url=url: (_call(url, READ) or {}).get("items"), 90)
            assert found[name], (tmp_path / "processor.log").read_text()[-3000:]
        assert [(i["category"], i["subtype"]) for i in found["api2"]] == [("process", "exception")]
        assert found["api1"] == found["api2"]
        run = _call(f"{apis['api2']}/api/v1/runs/{run_id}", READ)
        assert run and run.get("run_id") == run_id and run.get("status") != "running"
        for name in ("incidents.db", "projects.db"):  # the shared state is in PostgreSQL only
            assert not any((tmp_path / d / name).exists() for d in ("gateway", "processor", "api2"))

        # what one API process writes, the other reads: a revoked token is refused by both at once
        store = PostgresProjectStore(dsn)
        try:
            extra = store.create_token(project, "read", "e2e")
            assert all(_call(f"{api}/api/v1/runs/{run_id}", extra) for api in apis.values())
            (info,) = [t for t in store.list_tokens(project) if t.description == "e2e"]
            assert store.revoke(info.token_id)
        finally:
            store.close()
        for api in apis.values():
            assert _call(f"{api}/api/v1/runs/{run_id}", extra) == {"status": 401}
        assert all(p.poll() is None for p in procs)  # every process still running
    finally:
        stop_all(procs)
        broker.stop(kill=True)
        pg.stop()
