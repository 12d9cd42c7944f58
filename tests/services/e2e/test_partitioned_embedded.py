"""Issue 15 scale-out of the embedded default: `trainguard serve` over a SQLite queue of four partitions
(TRAINGUARD_QUEUE_PARTITIONS=4). The processor keeps one detection state per partition (embedded.py's
per-partition pipelines, told of its partitions once by the queue: a static assignment) and is SIGKILLed
while it works through a backlog of real recorded runs, then started again.

Each backlog is queued by a `trainguard serve` that runs no processor (TRAINGUARD_ROLES=gateway: every batch
acknowledged, nothing processed) before a whole `trainguard serve` works through it. At the end every run has
exactly its verdict (nothing lost, nothing doubled, no incident on a healthy run), every acknowledged
raw-context event is stored, every acknowledged metric point is stored exactly once, each crash cluster (its
runs in several partitions) counts what one pipeline over every event counts, and a clean stop leaves the
queue empty and the detection state saved per partition.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, retimed
from tests.services.e2e.test_processor_killed_on_kafka import _judged
from tests.support.net import free_port
from tests.support.processes import bootstrap_tokens, healthy, start_role, stop_all
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport
from trainguard_engine.extract import metric_points
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.embedded import PARTITION_PREFIX, PARTS_PREFIX
from trainguard_server.queue.common import DEFAULT_LANES, lane_of
from trainguard_server.storage.sqlite import open_sqlite_stores

PARTITIONS = 4
RUNS = ("crash", "explosion", "nan_source", "clip_stale", "healthy_mlp")
COPIES = 2
"""Each run is queued this many times in the first backlog (new run ids)."""
SEND_BATCH = 50
"""Events per ingest request."""
RAW_CONTEXT = {"exception", "lifecycle", "log"}
"""An envelope with one of these is raw context (kept in the event store)."""
KILL_COPIES = 6
"""... and this many in the one the processor is killed in: long enough that the kill lands mid-way."""


class Sent:
    """What the gateway acknowledged: each run's expected verdict, raw-context event ids, loss points."""

    def __init__(self) -> None:
        self.expected: Dict[str, Any] = {}
        self.raw_ids: List[str] = []
        self.loss_points: Dict[str, int] = {}
        self.events: List[Dict[str, Any]] = []  # every event, in the order sent

    def copy_of(self, name: str, project: str) -> Tuple[str, List[Dict[str, Any]]]:
        """A new copy of the corpus run ``name`` in ``project`` (a new run id, its events ending a second
        ago), written down here: send all of it."""
        run_id = f"{name}-{uuid.uuid4().hex[:6]}"
        events = [dict(e, run_id=run_id, project=project)
                  for e in retimed(BY_NAME[name].events(), time.time_ns() - 10**9)]
        self.expected[run_id] = BY_NAME[name].expected
        self.raw_ids += [e["event_id"] for e in events if RAW_CONTEXT & e.keys()]
        self.loss_points[run_id] = len({(e.get("rank", 0), step) for e in events
                                        for n, step, _v in metric_points(e) if n == "loss"})
        self.events += events
        return run_id, events


def _serve(env: Dict[str, str], log: Path, port: int, roles: str) -> subprocess.Popen[str]:
    proc = start_role("serve", dict(env, TRAINGUARD_ROLES=roles), log, "--http-port", str(port),
                      "--grpc-port", str(free_port()))
    assert poll(lambda: healthy(port), 30), log.read_text()[-3000:]
    return proc


def _queue_backlog(env: Dict[str, str], log: Path, data: Path, sent: Sent, copies: int) -> Dict[str, Any]:
    """Queue RUNS x ``copies`` under new run ids through a gateway-only `trainguard serve`, stopped after; returns
    the new runs' expected verdicts."""
    port = free_port()
    gateway = _serve(env, log, port, "gateway")
    try:
        tokens: Dict[str, Any] = bootstrap_tokens(data) or {}
        assert tokens, log.read_text()[-3000:]
        sender = HttpTransport(f"http://127.0.0.1:{port}", tokens["ingest"], "trainguard-test")
        mine: Dict[str, Any] = {}
        for name in RUNS * copies:
            run_id, events = sent.copy_of(name, tokens["project"])
            mine[run_id] = sent.expected[run_id]
            for at in range(0, len(events), SEND_BATCH):
                rejected = sender.send(events[at:at + SEND_BATCH], 30.0).rejected
                assert not rejected, rejected[:2]
        sender.close()
    finally:
        stop_all([gateway])
    assert gateway.returncode == 0, log.read_text()[-3000:]
    return mine


def _queue_file(data: Path) -> Tuple[List[Tuple[str, str]], int]:
    """The queue file's meta rows and its records."""
    conn = sqlite3.connect(str(data / "queue.db"))
    try:
        return (sorted((str(n), str(v)) for n, v in conn.execute("SELECT name, value FROM meta")
                       if n != "queue_id"),
                int(conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]))
    finally:
        conn.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-thread", "two-workers"])
def test_partitioned_sqlite_queue_every_run_exact_after_a_sigkill(tmp_path: Path, workers: int) -> None:
    """``workers`` 2: the partitions' pipelines run in worker processes (processor/pool.py, serve's
    TRAINGUARD_PROCESSOR_WORKERS), SIGKILLed with the server (they exit when their pipe closes)."""
    data = tmp_path / "data"
    env = dict(os.environ, TRAINGUARD_QUEUE="sqlite", TRAINGUARD_QUEUE_PARTITIONS=str(PARTITIONS),
               TRAINGUARD_PROCESSOR_WORKERS=str(workers),
               TRAINGUARD_DATA_DIR=str(data), TRAINGUARD_HOST="127.0.0.1",
               TRAINGUARD_MAX_PAST_AGE_S=str(10 * 365 * 86400), TRAINGUARD_SNAPSHOT_EVERY_S="0.2",
               TRAINGUARD_PROCESSOR_BATCH="8")
    log = tmp_path / "serve.log"
    sent = Sent()
    procs: List[subprocess.Popen[str]] = []
    try:
        first = _queue_backlog(env, log, data, sent, COPIES)
        meta, queued = _queue_file(data)
        assert meta == [("lanes", str(DEFAULT_LANES)), ("partitions", str(PARTITIONS))] and queued > 0  # stored
        assert len({lane_of(r, DEFAULT_LANES) % PARTITIONS for r in first}) >= 2  # spread (10 random ids in one: 4e-6)

        server = _serve(env, log, free_port(), "gateway,processor,api")
        procs.append(server)
        assert poll(lambda: _judged(tmp_path, first) == len(first), 60), log.read_text()[-3000:]
        _assert_exact(data, sent, first)
        stop_all([server])  # a clean stop: state saved, queue drained and committed
        assert server.returncode == 0 and _queue_file(data)[1] == 0, log.read_text()[-3000:]
        _assert_state_per_partition(data, 2)

        second = _queue_backlog(env, log, data, sent, KILL_COPIES)
        queued = _queue_file(data)[1]
        # a checkpoint after every round of at most 256 envelopes: the first commit comes after the first
        # round whatever the machine's speed (at 0.2 s a fast processor had worked the backlog off by then)
        server = _serve(dict(env, TRAINGUARD_SNAPSHOT_EVERY_S="0", TRAINGUARD_PROCESSOR_ROUND_EVENTS="256"), log,
                        free_port(), "gateway,processor,api")
        procs.append(server)
        # the first commit (a checkpoint: snapshot saved, then its records deleted from the queue) is the cue
        assert poll(lambda: _queue_file(data)[1] < queued, 60, interval=0.01), log.read_text()[-3000:]
        os.kill(server.pid, signal.SIGKILL)  # mid-stream: some runs done, the backlog not yet worked through
        server.wait(10)
        left = _queue_file(data)[1]
        done_before = _judged(tmp_path, second)
        print(f"killed with {left} of {queued} records in the queue, {done_before} of {len(second)} runs judged")

        # started again asking for another count: the queue file keeps its 4 (and says so), so does the state
        server = _serve(dict(env, TRAINGUARD_QUEUE_PARTITIONS="8"), log, free_port(), "gateway,processor,api")
        procs.append(server)
        assert poll(lambda: _judged(tmp_path, sent.expected) == len(sent.expected), 60), log.read_text()[-3000:]
        assert f"holds {PARTITIONS} partitions" in log.read_text()
        _assert_exact(data, sent, sent.expected)
        _assert_clusters_as_one_pipeline(data, sent)
        stop_all([server])
        assert server.returncode == 0 and _queue_file(data)[1] == 0, log.read_text()[-3000:]
        _assert_state_per_partition(data, 3)  # 40 random run ids in 2 or fewer: ~5e-12
        assert 0 < left < queued and done_before < len(second)  # killed with part of the backlog left
        assert "without per-partition state" not in log.read_text()
    finally:
        stop_all(procs)


def _assert_exact(data: Path, sent: Sent, runs: Dict[str, Any]) -> None:
    """Every run of ``runs`` has exactly its verdict and its acknowledged loss points once; every raw-context
    event sent is stored."""
    project = bootstrap_tokens(data)["project"]
    stores = open_sqlite_stores(data)
    try:
        verdicts = {run_id: sorted((i.category, i.subtype) for i in
                                   stores.incidents.list_incidents(project, run_id=run_id).items
                                   if not i.explained_by) for run_id in runs}
        losses = {run_id: [m.count for m in stores.metrics.summary(project, run_id) if m.name == "loss"]
                  for run_id in runs}
        missing = [e for e in sent.raw_ids if stores.events.get(project, e) is None]
    finally:
        stores.close()
    assert verdicts == {run_id: [kind] if kind else [] for run_id, kind in runs.items()}
    assert losses == {run_id: [sent.loss_points[run_id]] for run_id in runs}  # each point once
    assert missing == []


def _assert_clusters_as_one_pipeline(data: Path, sent: Sent) -> None:
    """Each crash cluster -- one fingerprint, its runs in several partitions, so in several pipelines -- is
    stored with what one pipeline over every event sent counts."""
    reference = Pipeline()
    reference.process(sent.events)
    wanted = {c.fingerprint: (c.count, sorted(c.runs)) for c in reference.clusters()
              if any(r.startswith("crash-") for r in c.runs)}
    spread = max(len({lane_of(r, DEFAULT_LANES) % PARTITIONS for r in runs}) for _, runs in wanted.values())
    assert spread > 1  # 8 crash runs of random ids all in one partition: 6e-5
    project = bootstrap_tokens(data)["project"]
    stores = open_sqlite_stores(data)
    try:
        stored = {f: stores.incidents.get_cluster(project, f) for f in wanted}
    finally:
        stores.close()
    assert {f: (c.count, sorted(c.runs)) if c else None for f, c in stored.items()} == wanted


def _assert_state_per_partition(data: Path, at_least: int) -> None:
    """The detection state is saved per partition (PARTITION_PREFIX: ``at_least`` of the 4 hold some), none
    as one processor-wide snapshot."""
    stores = open_sqlite_stores(data)
    try:
        keys = stores.incidents.state_keys("pipeline/")
    finally:
        stores.close()
    parts = {k.split("/")[2] for k in keys if k.startswith(PARTITION_PREFIX)}
    assert len(parts) >= at_least and parts <= {str(p) for p in range(PARTITIONS)}, keys[:20]
    assert not [k for k in keys if k.startswith(PARTS_PREFIX)], keys[:20]
