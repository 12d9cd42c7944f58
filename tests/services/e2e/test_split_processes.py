"""`trainguard gateway`, `trainguard processor` and `trainguard api` as three real processes sharing a
Kafka topic (Tansu) and a data directory (SQLite incidents and tokens): a real crashing training sends to
the gateway; the verdict appears through the API process, which serves no ingest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.scenarios import record as recorder
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.waiting import poll

REPO = Path(__file__).resolve().parents[3]


def _get(url: str, token: Optional[str] = None) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return json.load(answer)
    except (urllib.error.URLError, OSError, ValueError):
        return None




@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Dict[str, Any]]:
    broker = Tansu(tmp_path / "tansu.log").start()
    tag = uuid.uuid4().hex[:8]
    env = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
               TRAINGUARD_KAFKA_TOPIC=f"split-{tag}", TRAINGUARD_KAFKA_PARTITIONS="2",
               TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000", TRAINGUARD_DATA_DIR=str(tmp_path / "data"),
               TRAINGUARD_HOST="127.0.0.1")
    ports = {"gateway": free_port(), "api": free_port(), "grpc": free_port()}
    procs: List[subprocess.Popen[str]] = []
    logs = {}
    try:
        for role, extra in (("gateway", ["--http-port", str(ports["gateway"]), "--grpc-port", str(ports["grpc"])]),
                            ("processor", []), ("api", ["--http-port", str(ports["api"])])):
            logs[role] = open(tmp_path / f"{role}.log", "w")
            procs.append(subprocess.Popen([sys.executable, "-m", "trainguard_server", role, *extra], env=env,
                                          stdout=logs[role], stderr=subprocess.STDOUT, text=True))
            if role == "gateway":  # first: it creates the data dir's tokens the others then read
                assert poll(lambda: _get(f"http://127.0.0.1:{ports['gateway']}/healthz"), 30), \
                    (tmp_path / "gateway.log").read_text()
        assert poll(lambda: _get(f"http://127.0.0.1:{ports['api']}/healthz"), 30), \
            (tmp_path / "api.log").read_text()
        tokens = json.loads((tmp_path / "data" / "bootstrap-tokens.json").read_text())
        yield {"ports": ports, "tokens": tokens, "tmp": tmp_path, "procs": procs}
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs.values():
            log.close()
        broker.stop(kill=True)


def test_gateway_processor_and_api_as_separate_processes(cluster: Dict[str, Any]) -> None:
    ports, tokens, tmp = cluster["ports"], cluster["tokens"], cluster["tmp"]
    run_id = f"split-crash-{uuid.uuid4().hex[:6]}"
    env = recorder.scenario_env("crash", f"http://127.0.0.1:{ports['gateway']}", str(tmp / "spool"))
    env.update(TRAINGUARD_TOKEN=tokens["ingest"], TRAINGUARD_PROJECT=tokens["project"], TRAINGUARD_RUN_ID=run_id)
    proc = subprocess.run([sys.executable, "-m", "tests.scenarios.trainings_process", "crash"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    api = f"http://127.0.0.1:{ports['api']}"
    page = poll(lambda: (_get(f"{api}/api/v1/runs/{run_id}/incidents", tokens["read"]) or {}).get("items"))
    assert page, (tmp / "processor.log").read_text()[-3000:]
    assert (page[0]["category"], page[0]["subtype"]) == ("process", "exception")
    # the API process has no ingest; the gateway's /readyz does not depend on a processor
    request = urllib.request.Request(f"{api}/v1/ingest", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=2)
    assert refused.value.code in (404, 405)
    assert all(p.poll() is None for p in cluster["procs"])  # all three still running
