"""Issue 18, finding 1 against a real ``trainguard serve``: one run whose LR goes 5e-324 -> 1.0 and then logs a
NaN loss (sent by the real SDK over HTTP) made every checkpoint raise -- nothing was committed again, the
queue only grew, for every project, and SIGTERM never finished. Now the queue drains, the other project's
run is processed and committed, the incident shows its overflowed LR growth spelled out, and SIGTERM exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Dict, Optional

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard_server.storage.sqlite import SqliteProjectStore

SDK_RUN = """
import sys, trainguard
endpoint, token, project, run_id, poison = sys.argv[1:6]
trainguard.init(endpoint=endpoint, token=token, project=project, run_id=run_id, flush_interval=0.1,
                capture_exit=False, capture_uncaught=False, spool_dir=sys.argv[6])
for step in range(30):
    if poison == "1":
        trainguard.log(step=step, **{"opt/lr": 5e-324 if step < 10 else 1.0,
                                     "loss": 1.0 if step < 20 else float("nan")})
    else:
        trainguard.log(step=step, **{"opt/lr": 1e-3, "loss": 2.0 / (1 + step)})
assert trainguard.flush(20)
trainguard.shutdown(10)
"""


def _sdk_run(server: ServeProcess, token: str, project: str, run_id: str, poison: bool, spool: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SDK_RUN, server.http_url, token, project, run_id,
                           "1" if poison else "0", str(spool)], env=dict(os.environ), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _metric(server: ServeProcess, name: str) -> Optional[float]:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_a_poison_run_does_not_stop_ingest_for_every_project(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data", env={"TRAINGUARD_SNAPSHOT_EVERY_S": "0.2"}).start()
    try:
        projects = SqliteProjectStore(tmp_path / "data" / "projects.db")
        calm_token = projects.create_token("calm", "ingest")
        calm_read = projects.create_token("calm", "read")
        projects.close()
        tokens: Dict[str, str] = server.tokens
        _sdk_run(server, tokens["ingest"], tokens["project"], "poison", True, tmp_path / "spool-a")
        _sdk_run(server, calm_token, "calm", "calm", False, tmp_path / "spool-b")
        # everything acknowledged gets processed and committed (before the fix the depth never fell to 0)
        assert poll(lambda: _metric(server, "trainguard_queue_depth") == 0.0, timeout=30), \
            f"queue never drained: depth {_metric(server, 'trainguard_queue_depth')}"
        assert _metric(server, "trainguard_processor_errors_total") == 0.0
        incident = poll(lambda: (page := server.get_or_none("/api/v1/runs/poison/incidents")) and page["items"]
                        and page["items"][0])
        assert incident and incident["trigger"]["lr_growth"] == "Infinity", incident
        req = urllib.request.Request(server.http_url + "/api/v1/runs/calm",
                                     headers={"Authorization": f"Bearer {calm_read}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert "stopped: queue drained, state checkpointed" in "".join(server.output)
    finally:
        server.stop()
