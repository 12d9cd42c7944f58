"""``trainguard serve`` end to end: real torch trainings with the SDK over gRPC and HTTP, the incident
visible through the API; kill -9 mid-stream loses nothing acknowledged and duplicates nothing; SIGTERM
drains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.core.events import new_event_id
from trainguard.transport.base import TransportError
from trainguard.transport.grpc import GrpcTransport
from trainguard_server.config import auto_workers
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import open_sqlite_stores


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for the training tests (each reads only its own run id; the crash's search and cluster are
    the only ones with that text and fingerprint): a start less per test. kill -9 and SIGTERM start their
    own."""
    proc = ServeProcess(tmp_path_factory.mktemp("serve") / "data").start()
    yield proc
    proc.stop()


def _train(kind: str, endpoint: str, token: str, run_id: str, steps: int,
           spool: Optional[Path] = None) -> subprocess.Popen[str]:
    """A demo training with the SDK as ``run_id``; it spools into ``spool`` (default: a new temporary directory,
    never a fixed path shared by concurrent runs). Also used by tests/services/dashboard and test_notify."""
    spool = spool if spool is not None else Path(tempfile.mkdtemp(prefix=f"tg-spool-{run_id}-"))
    env = dict(os.environ, TRAINGUARD_ENDPOINT=endpoint, TRAINGUARD_TOKEN=token, TRAINGUARD_RUN_ID=run_id,
               TRAINGUARD_FLUSH_INTERVAL="0.1", TRAINGUARD_HEARTBEAT_INTERVAL="1",
               TRAINGUARD_SPOOL_DIR=str(spool))  # the test's own (a fixed /tmp path was shared by concurrent runs)
    return subprocess.Popen([sys.executable, "-m", "trainguard_server.demo.trainings", kind,
                             "--steps", str(steps), "--step-sleep", "0.02"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)




def test_serve_runs_its_default_detection_workers(server: ServeProcess) -> None:
    """Without TRAINGUARD_PROCESSOR_WORKERS, serve picks auto's worker count for this machine (2 on 2 cores)
    and says where detection runs; this module's trainings are detected through those workers."""
    workers = auto_workers()
    banner = "".join(server.output)
    said = f"detection in {workers} worker processes" if workers else "detection in the processor's thread"
    assert said in banner, banner


SLOWER = ("perf", "throughput-regression")
"""The run's own step time slower than its steady state: what a loaded machine does to it (see below)."""


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_sdk_training_to_incident_through_the_api(server: ServeProcess, transport: str, tmp_path: Path) -> None:
    endpoint = f"grpc://{server.grpc_target}" if transport == "grpc" else server.http_url
    run_id = f"e2e-diverging-{transport}"
    proc = _train("diverging", endpoint, server.tokens["ingest"], run_id, steps=80, spool=tmp_path / "spool")

    def incidents() -> Any:
        page = server.get_or_none(f"/api/v1/runs/{run_id}/incidents")
        return page["items"] if page and page["items"] else None

    def explosion() -> Any:
        return next((i for i in incidents() or () if (i["category"], i["subtype"]) == ("gradient", "explosion")),
                    None)

    def divergence_incidents() -> Any:
        return [i for i in incidents() or () if (i["category"], i["subtype"]) != SLOWER] or None

    # the loss far above its start while the norm grows may show first as loss/divergence (divergence_far_factor):
    # the climb of the norm is then the explosion, found before the first non-finite value either way.
    # A perf/throughput-regression of this run is not about its divergence: on a loaded machine (CI's 2 cores
    # shared with torch start-ups) the run's own step time truly rises >= 1.5x its steady state and the engine
    # rightly says so (seen once at load 16); any other kind found first still fails the test
    first = poll(divergence_incidents)
    found = poll(explosion)
    seen_ns = time.time_ns()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert first is not None, "no incident for the diverging run"
    assert {(i["category"], i["subtype"]) for i in first} <= {("gradient", "explosion"), ("loss", "divergence")}, first
    assert found is not None, incidents()
    assert found["evidence"] and found["checks"]
    # the incident shows before the NaN steps and the EXIT are processed: wait for the end of the run
    run = poll(lambda: (r := server.get_or_none(f"/api/v1/runs/{run_id}")) and r["status"] != "running" and r)
    assert run and run["status"] == "finished" and run["health"] == "critical", run
    found = server.get(f"/api/v1/incidents/{found['incident_id']}")
    # the first non-finite value in the run's own metrics is where the incident starts
    series = server.get(f"/api/v1/runs/{run_id}/metrics", names="loss,grad/global_norm")
    first_bad = min(b["step_start"] for by_rank in series["series"].values()
                    for buckets in by_rank.values() for b in buckets if b["nonfinite"])
    # a gradual explosion is flagged from the start of its climb, before the first non-finite value
    climb = next((e for e in found["evidence"] if e["rule"] == "gradient.norm_climb"), None)
    assert climb is not None, found["evidence"]
    assert found["first_step"] == climb["step"] and found["first_step"] < first_bad
    # how long after the anomalous event the API showed it (the bench measures p50/p99 properly)
    latency = (seen_ns - found["first_ns"]) / 1e9
    print(f"\n{transport}: incident visible {latency:.3f}s after the anomalous event")


def test_crash_is_clustered_and_searchable(server: ServeProcess, tmp_path: Path) -> None:
    run_id = "e2e-crashing"
    proc = _train("crashing", server.http_url, server.tokens["ingest"], run_id, steps=30, spool=tmp_path / "spool")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "mat1 and mat2 shapes cannot be multiplied" in output
    run = poll(lambda: (r := server.get_or_none(f"/api/v1/runs/{run_id}")) and r["status"] == "failed" and r)
    assert run["exit_codes"] == {"0": 1}
    # the run record is written before the incident and the cluster of the same batch: wait for those too
    assert poll(lambda: (page := server.get_or_none(f"/api/v1/runs/{run_id}/incidents")) and page["items"]
                and server.get_or_none(f"/api/v1/clusters/{page['items'][0]['fingerprint']}"))
    [incident] = server.get(f"/api/v1/runs/{run_id}/incidents")["items"]
    assert (incident["category"], incident["subtype"]) == ("process", "exception")
    cluster = server.get(f"/api/v1/clusters/{incident['fingerprint']}")
    assert cluster["count"] == 1 and cluster["runs"] == [run_id]
    hits = server.get("/api/v1/search", q='"shapes cannot be multiplied"')["items"]
    assert [h["event"]["run_id"] for h in hits] == [run_id]
    assert "[" in hits[0]["snippet"]


def _log_batch(run_id: str, start: int, count: int) -> List[Dict[str, Any]]:
    events = []
    for i in range(start, start + count):
        payload = ({"exception": {"type": "ValueError", "message": "bad batch",
                                  "frames": [{"filename": "/w/train.py", "module": "train",
                                              "function": "step", "lineno": 10, "in_app": True}]}}
                   if i % 10 == 0 else
                   {"log": {"logger": "train", "level": "WARNING", "message": f"line {i}"}})
        events.append({"event_id": new_event_id(), "run_id": run_id, "step": i, "rank": i % 4,
                       "time_unix_nano": time.time_ns(), "severity": "WARNING", **payload})
    return events


def test_kill_9_mid_stream_loses_nothing_acknowledged_and_duplicates_nothing(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    transport = GrpcTransport(server.grpc_target, server.tokens["ingest"])
    run_id = "e2e-kill9"
    acked: Set[str] = set()
    acked_exceptions: Set[str] = set()
    sent = 0
    killed = False
    try:
        while sent < 6000:
            batch = _log_batch(run_id, sent, 200)
            sent += len(batch)
            try:
                result = transport.send(batch, timeout=5)
            except TransportError:
                assert killed, "only the kill may fail a send"
                break
            assert not result.rejected
            acked.update(e["event_id"] for e in batch)
            acked_exceptions.update(e["event_id"] for e in batch if "exception" in e)
            if sent >= 3000 and not killed:
                server.signal(signal.SIGKILL)  # mid-stream, while the processor is busy
                killed = True
    finally:
        transport.close()
    assert killed and server.wait(10) == -signal.SIGKILL
    restarted = ServeProcess(tmp_path / "data")
    restarted.http_port, restarted.grpc_port = 0, 0
    restarted.start()
    try:
        def all_there() -> Any:
            stored = restarted.run_events(run_id, kinds="log,exception")
            return stored if len(stored) >= len(acked) else None

        stored = poll(all_there, timeout=60, interval=0.5) or restarted.run_events(run_id, kinds="log,exception")
        ids = [e["event_id"] for e in stored]
        assert acked <= set(ids), f"{len(acked - set(ids))} acknowledged events lost"
        assert len(ids) == len(set(ids)), "an event stored twice"
        # the pipeline's counts survived the crash exactly: redelivered records were not counted twice
        stored_exceptions = {e["event_id"] for e in stored if e["kind"] == "exception"}

        def the_cluster() -> Any:  # written after the events of the same record: wait until it caught up
            [cluster] = [c for c in restarted.get("/api/v1/clusters")["items"] if run_id in c["runs"]] or [None]
            return cluster if cluster and cluster["count"] >= len(stored_exceptions) else None

        cluster = poll(the_cluster, timeout=30, interval=0.5)
        assert cluster is not None, restarted.get("/api/v1/clusters")["items"]
        assert cluster["count"] == len(stored_exceptions) >= len(acked_exceptions)
    finally:
        restarted.stop()


def test_sigterm_drains_the_queue_before_exiting(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    transport = GrpcTransport(server.grpc_target, server.tokens["ingest"])
    acked: Set[str] = set()
    for start in range(0, 4000, 500):
        batch = _log_batch("e2e-drain", start, 500)
        transport.send(batch, timeout=10)
        acked.update(e["event_id"] for e in batch)
    transport.close()
    server.signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert "queue drained" in "".join(server.output)
    # read the data dir directly, with no processor running: nothing is left queued, everything is stored
    queue = SqliteQueue(tmp_path / "data" / QUEUE_DB)
    stores = open_sqlite_stores(tmp_path / "data")
    try:
        assert queue.depth() == 0
        stored = []
        cursor = None
        while True:
            page = stores.events.list_for_run("default", "e2e-drain", limit=500, cursor=cursor)
            stored.extend(page.items)
            cursor = page.next_cursor
            if not cursor:
                break
        assert {e.event_id for e in stored} == acked
    finally:
        queue.close()
        stores.close()
