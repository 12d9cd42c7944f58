"""A fresh server's very first request from a run is what the real SDK sends first: its lifecycle START,
with no metric in it -- over HTTP and gRPC it must be acknowledged and the run must show.

The gap this closes (review of stop 45): the gateway's per-project metric-name memory looked up the
project's run order for every request, and a project with no run remembered yet (every project after a
server start) answered a metric-free request with HTTP 500 (15a0270, fixed in 8d9fa1d); the gateway's
unit suite had no such request and the end-to-end tests all log metrics first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

_SDK_FIRST_THEN_EXIT = """
import json, sys, trainguard
trainguard.init(endpoint=sys.argv[1], token=sys.argv[2], run_id=sys.argv[3], project="default",
                spool_dir=sys.argv[4], capture_exit=True, flush_interval=0.05)
client = trainguard.get_client()
delivered = trainguard.flush(20)  # the START alone: acknowledged, not retried or spooled
print(json.dumps({"delivered": delivered, "stats": client.stats_snapshot()}))
"""


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_runs_lifecycle_start_is_a_fresh_servers_first_request(tmp_path: Path, transport: str) -> None:
    server = ServeProcess(tmp_path / "data").start()
    try:
        endpoint = server.http_url if transport == "http" else f"grpc://{server.grpc_target}"
        run_id = f"first-{transport}"
        proc = subprocess.run(
            [sys.executable, "-c", _SDK_FIRST_THEN_EXIT, endpoint, server.tokens["ingest"], run_id,
             str(tmp_path / "spool")], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        report: Dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["delivered"] is True, (report, proc.stderr[-2000:])
        assert report["stats"]["sent"] >= 1 and report["stats"]["spooled"] == 0, report
        assert report["stats"]["retries"] == 0, report  # a 500 would have been retried
        run = poll(lambda: server.get_or_none(f"/api/v1/runs/{run_id}"), timeout=30)
        assert run is not None, "".join(server.output)[-3000:]
        assert run["run_id"] == run_id
        log = "".join(server.output)
        assert "internal error" not in log and "Traceback" not in log, log[-3000:]
    finally:
        server.stop()
