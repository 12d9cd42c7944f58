"""Issue 18, finding 6: SIGTERM must finish when draining or checkpointing fails.

Before, a failure in the stop (a checkpoint that raised: a full disk, the poison run of finding 1) killed the
stop thread and ``trainguard serve`` waited for it forever. Now the stop is bounded by
``shutdown_timeout_s``; when it fails or overruns, the process exits with code 1 after a log line saying what
was not committed -- which stays queued and is processed at the next start. A real ``trainguard serve`` on
loopback; the full disk is real too: the server's file-size limit (RLIMIT_FSIZE) lowered to 1 byte, so every
write to its SQLite files fails as on a full disk; a store call that blocks is a write lock held by another
process on the incident store."""

from __future__ import annotations

import json
import re
import resource
import signal
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.core.events import new_event_id

EVENTS = 300


def _post(server: ServeProcess, events: List[Dict[str, Any]]) -> None:
    req = urllib.request.Request(server.http_url + "/v1/ingest", data=json.dumps({"events": events}).encode(),
                                 headers={"Authorization": f"Bearer {server.tokens['ingest']}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def _metric(server: ServeProcess, name: str) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as resp:
        found = re.search(rf"^{re.escape(name)} (\S+)$", resp.read().decode(), re.MULTILINE)
    return float(found.group(1)) if found else -1.0


def _events(run_id: str) -> List[Dict[str, Any]]:
    now = time.time_ns()
    return [{"event_id": new_event_id(), "run_id": run_id, "step": s, "time_unix_nano": now - (EVENTS - s),
             "metrics": {"points": [{"name": "loss", "value": 1.0 / (1 + s)}]}} for s in range(EVENTS)]


def _processed_not_committed(tmp_path: Path, timeout_s: float) -> ServeProcess:
    """A server that processed EVENTS events of run 'r' and committed none of them (no checkpoint yet)."""
    server = ServeProcess(tmp_path / "data", env={"TRAINGUARD_SNAPSHOT_EVERY_S": "3600",
                                                  "TRAINGUARD_SHUTDOWN_TIMEOUT_S": str(timeout_s)}).start()
    _post(server, _events("r"))
    assert poll(lambda: _metric(server, "trainguard_processed_events_total") >= EVENTS, timeout=30)
    assert _metric(server, "trainguard_queue_depth") >= 1  # processed, not committed
    return server


def _stop(server: ServeProcess, within_s: float) -> int:
    server.signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code = server.wait(within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SIGTERM did not finish within {within_s:.0f} s")
    print(f"\nSIGTERM -> exit {code} in {time.monotonic() - started:.1f} s")
    return code


def test_sigterm_with_a_full_disk_exits_1_and_says_what_was_not_committed(tmp_path: Path) -> None:
    server = _processed_not_committed(tmp_path, timeout_s=10)
    try:
        assert server.proc is not None
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (1, 1))  # from now on the disk is full
        code = _stop(server, within_s=40)
        output = "".join(server.output)
        assert code == 1, output[-3000:]
        assert "queue record(s) taken but not committed" in output, output[-3000:]
        assert "shutdown incomplete (exit code 1)" in output
        assert "NOT everything was committed" in output
    finally:
        server.stop()
    # nothing acknowledged was lost: the next start processes it again and commits it
    again = ServeProcess(tmp_path / "data").start()
    try:
        assert poll(lambda: _metric(again, "trainguard_processed_events_total") >= EVENTS, timeout=30)
        again.signal(signal.SIGTERM)
        assert again.wait(60) == 0
        assert "stopped: queue drained, state checkpointed" in "".join(again.output)
    finally:
        again.stop()


def test_a_stop_blocked_by_a_store_exits_1_at_the_deadline(tmp_path: Path) -> None:
    server = _processed_not_committed(tmp_path, timeout_s=4)
    lock = sqlite3.connect(str(tmp_path / "data" / "incidents.db"), isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # another process holds the incident store's write lock (30 s wait)
        code = _stop(server, within_s=25)  # 4 s deadline + 5 s grace; the store would wait 30 s
        output = "".join(server.output)
        assert code == 1, output[-3000:]
        assert "shutdown did not finish within shutdown_timeout_s (4 s)" in output, output[-3000:]
        assert "queue record(s) taken but not committed" in output
    finally:
        lock.close()
        server.stop()
