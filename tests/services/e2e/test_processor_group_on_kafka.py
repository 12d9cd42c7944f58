"""Issue 20: three `trainguard processor` processes in one consumer group on a 12-partition Kafka topic
(Tansu), one SIGKILLed mid-stream and another added; each keeps the detection state of the partitions it
owns (embedded.py: per-partition pipelines, saved and committed on revoke, restored on assignment).

A backlog of recorded runs (the scenario corpus, several copies under new run ids) is queued through a real
gateway before the group starts. At the end every run must have exactly its verdict (nothing lost, nothing
doubled, no `progress/lost` or other incident on a healthy run), the crash cluster -- one fingerprint whose
runs are spread over many partitions and so over the processors -- must count exactly what one pipeline over
every event counts, and every acknowledged raw-context event and metric point must be stored exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

from tests.scenarios.corpus import BY_NAME, retimed
from tests.services.e2e.test_processor_killed_on_kafka import _judged
from tests.support.kafka import Tansu
from tests.support.net import free_port
from tests.support.processes import bootstrap_tokens, healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_engine.extract import metric_points
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.embedded import PARTITION_PREFIX, PARTS_PREFIX
from trainguard_server.storage.sqlite import open_sqlite_stores

RUNS = ("crash", "explosion", "nan_source", "healthy_mlp", "crash", "healthy_cnn")
COPIES = 3
PARTITIONS = 12


def test_three_processors_one_killed_one_added_every_run_exact(tmp_path: Path) -> None:
    broker = Tansu(tmp_path / "tansu.log").start()
    port = free_port()
    data = tmp_path / "data"
    env = dict(os.environ, TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
               TRAINGUARD_KAFKA_TOPIC=f"group-{uuid.uuid4().hex[:8]}",
               TRAINGUARD_KAFKA_PARTITIONS=str(PARTITIONS), TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000",
               TRAINGUARD_DATA_DIR=str(data), TRAINGUARD_HOST="127.0.0.1",
               TRAINGUARD_MAX_PAST_AGE_S=str(10 * 365 * 86400), TRAINGUARD_SNAPSHOT_EVERY_S="0.2",
               TRAINGUARD_PROCESSOR_BATCH="8")
    procs: List[subprocess.Popen[str]] = []
    try:
        procs.append(start_role("gateway", env, tmp_path / "gateway.log", "--http-port", str(port),
                                "--grpc-port", str(free_port())))
        assert poll(lambda: healthy(port), 30), (tmp_path / "gateway.log").read_text()
        tokens: Dict[str, Any] = bootstrap_tokens(data) or {}
        assert tokens, (tmp_path / "gateway.log").read_text()
        project = tokens["project"]
        expected: Dict[str, Any] = {}
        raw_ids: List[str] = []
        loss_points: Dict[str, int] = {}
        everything: List[Dict[str, Any]] = []
        sender = HttpTransport(f"http://127.0.0.1:{port}", tokens["ingest"], "trainguard-test")
        for name in RUNS * COPIES:  # the whole backlog is acknowledged before any processor runs
            events = retimed(BY_NAME[name].events(), time.time_ns() - 10**9)
            run_id = f"{name}-{uuid.uuid4().hex[:6]}"
            for e in events:
                e["run_id"], e["project"] = run_id, project
            for i in range(0, len(events), 50):
                result = sender.send(events[i:i + 50], 30.0)
                assert not result.rejected, result.rejected[:2]
            expected[run_id] = BY_NAME[name].expected
            raw_ids += [e["event_id"] for e in events if "exception" in e or "lifecycle" in e or "log" in e]
            loss_points[run_id] = len({(e.get("rank", 0), step) for e in events
                                       for name, step, _v in metric_points(e) if name == "loss"})
            everything += events
        sender.close()
        reference = Pipeline()
        reference.process(everything)
        crash_clusters = [c for c in reference.clusters() if any(r.startswith("crash-") for r in c.runs)]
        assert crash_clusters and all(len(c.runs) > 2 for c in crash_clusters)

        group = [start_role("processor", env, tmp_path / f"processor-{i}.log") for i in range(3)]
        procs += group
        assert poll(lambda: _judged_once_written(tmp_path, expected) >= 1, 90, interval=0.05), _logs(tmp_path)
        os.kill(group[1].pid, signal.SIGKILL)  # mid-stream: its partitions go to the others
        group[1].wait(10)
        done_before = _judged_once_written(tmp_path, expected)
        procs.append(start_role("processor", env, tmp_path / "processor-3.log"))  # and one joins
        assert poll(lambda: _judged_once_written(tmp_path, expected) == len(expected), 150), _logs(tmp_path)
        assert done_before < len(expected)  # killed with part of the backlog not yet processed

        stores = open_sqlite_stores(data)
        try:
            for run_id, kind in expected.items():
                found = [(i.category, i.subtype) for i in
                         stores.incidents.list_incidents(project, run_id=run_id).items if not i.explained_by]
                assert found == ([kind] if kind else []), (run_id, found)
            for want in crash_clusters:  # merged from the views of every partition that saw it
                got = stores.incidents.get_cluster(project, want.fingerprint)
                assert got is not None and (got.count, sorted(got.runs)) == (want.count, sorted(want.runs))
            for event_id in raw_ids:
                assert stores.events.get(project, event_id) is not None
            for run_id, count in loss_points.items():  # every acknowledged point stored once
                (loss,) = [m for m in stores.metrics.summary(project, run_id) if m.name == "loss"]
                assert loss.count == count, (run_id, loss.count, count)
            # detection state kept per partition, none as one whole-processor snapshot
            keys = stores.incidents.state_keys("pipeline/")
            parts = {k.split("/")[2] for k in keys if k.startswith(PARTITION_PREFIX)}
            assert len(parts) >= 4 and parts <= {str(p) for p in range(PARTITIONS)}, keys[:20]
            assert not [k for k in keys if k.startswith(PARTS_PREFIX)], keys[:20]
        finally:
            stores.close()
    finally:
        stop_all(procs)
        broker.stop(kill=True)


def _judged_once_written(tmp_path: Path, expected: Dict[str, Any]) -> int:
    """How many of the runs are finished in the stores, 0 before the first processor created them."""
    return _judged(tmp_path, expected) if (tmp_path / "data" / "incidents.db").exists() else 0


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(tmp_path.glob("processor-*.log")))
