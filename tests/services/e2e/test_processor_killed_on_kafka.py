"""Processor killed mid-stream on Kafka (issue 5 "Faults"): `trainguard processor` is SIGKILLed while it
works through a backlog of real recorded runs and started again; it resumes from the consumer group's
committed offsets. Every run ends with exactly its verdict (no lost, no doubled incident) and every
raw-context event is stored once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

from tests.scenarios.corpus import BY_NAME, retimed
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.processes import bootstrap_tokens, healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_server.storage.sqlite import open_sqlite_stores

RUNS = ("crash", "explosion", "nan_source", "clip_stale", "healthy_mlp")
COPIES = 4
"""Each run is queued this many times (new run ids): a backlog long enough that the kill lands mid-way."""


def test_a_sigkilled_processor_resumes_from_committed_offsets(tmp_path: Path) -> None:
    broker = Tansu(tmp_path / "tansu.log").start()
    port = free_port()
    env = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
               TRAINGUARD_KAFKA_TOPIC=f"kill-{uuid.uuid4().hex[:8]}", TRAINGUARD_KAFKA_PARTITIONS="2",
               TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000", TRAINGUARD_DATA_DIR=str(tmp_path / "data"),
               TRAINGUARD_HOST="127.0.0.1", TRAINGUARD_MAX_PAST_AGE_S=str(10 * 365 * 86400),
               TRAINGUARD_SNAPSHOT_EVERY_S="0.2", TRAINGUARD_PROCESSOR_BATCH="8")
    procs: List[subprocess.Popen[str]] = []
    try:
        gateway = start_role("gateway", env, tmp_path / "gateway.log", "--http-port", str(port), "--grpc-port",
                         str(free_port()))
        procs.append(gateway)
        assert poll(lambda: healthy(port), 30), (tmp_path / "gateway.log").read_text()
        tokens: Dict[str, Any] = _tokens(tmp_path) or {}
        assert tokens, (tmp_path / "gateway.log").read_text()
        expected: Dict[str, Any] = {}
        raw_ids: List[str] = []
        sender = HttpTransport(f"http://127.0.0.1:{port}", tokens["ingest"], "trainguard-test")
        for name in RUNS * COPIES:  # the whole backlog is queued before any processor runs
            events = retimed(BY_NAME[name].events(), time.time_ns() - 10**9)
            run_id = f"{name}-{uuid.uuid4().hex[:6]}"
            for e in events:
                e["run_id"], e["project"] = run_id, tokens["project"]
            for i in range(0, len(events), 50):
                result = sender.send(events[i:i + 50], 30.0)
                assert not result.rejected, result.rejected[:2]
            expected[run_id] = BY_NAME[name].expected
            raw_ids += [e["event_id"] for e in events if "exception" in e or "lifecycle" in e or "log" in e]
        sender.close()

        first = start_role("processor", env, tmp_path / "processor.log")
        procs.append(first)
        incidents_db = tmp_path / "data" / "incidents.db"
        assert poll(lambda: incidents_db.exists() and _judged(tmp_path, expected) >= 1, 60, interval=0.02), \
            (tmp_path / "processor.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)  # mid-stream: some runs done, the backlog not yet worked through
        first.wait(10)
        done_before = _judged(tmp_path, expected)
        print(f"runs judged before the kill: {done_before} of {len(expected)}")

        procs.append(start_role("processor", env, tmp_path / "processor.log"))
        assert poll(lambda: _all_judged(tmp_path, expected), 90), (tmp_path / "processor.log").read_text()[-3000:]
        stores = open_sqlite_stores(tmp_path / "data")
        try:
            for run_id, kind in expected.items():
                found = [(i.category, i.subtype) for i in
                         stores.incidents.list_incidents(tokens["project"], run_id=run_id).items
                         if not i.explained_by]
                assert found == ([kind] if kind else []), (run_id, found)
            for event_id in raw_ids:
                assert stores.events.get(tokens["project"], event_id) is not None
        finally:
            stores.close()
        assert 1 <= done_before < len(expected)  # killed with part of the backlog not yet processed
    finally:
        stop_all(procs)
        broker.stop(kill=True)


def _tokens(tmp_path: Path) -> Any:
    return bootstrap_tokens(tmp_path / "data")


def _judged(tmp_path: Path, expected: Dict[str, Any]) -> int:
    """How many of the runs are finished in the stores (not running; their incident stored)."""
    stores = open_sqlite_stores(tmp_path / "data")
    try:
        project = _tokens(tmp_path)["project"]
        done = 0
        for run_id, kind in expected.items():
            run = stores.incidents.get_run(project, run_id)
            if run is None or run.status == "running":
                continue
            if kind and not stores.incidents.list_incidents(project, run_id=run_id).items:
                continue
            done += 1
        return done
    finally:
        stores.close()


def _all_judged(tmp_path: Path, expected: Dict[str, Any]) -> bool:
    return _judged(tmp_path, expected) == len(expected)
