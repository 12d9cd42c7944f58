"""``trainguard runs`` / ``trainguard incidents RUN`` against a real server fed by a real crashing SDK job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest

from tests.sdk.scripting import run_python
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

REPO = Path(__file__).resolve().parents[2]


def cli(*argv: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainguard_server", *argv], capture_output=True, text=True,
                          env=full, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("look") / "data").start()
    try:
        done = run_python(f"""
            import trainguard
            trainguard.init(endpoint={proc.http_url!r}, token={proc.tokens['ingest']!r}, run_id="look-1",
                            run_name="crashy", spool_dir="")
            for step in range(12):
                trainguard.log(step=step, loss=2.0 - step * 0.1)
            def load(batch):
                raise ValueError(f"bad batch {{batch}}")
            load(12)
        """)
        assert done.returncode == 1 and "ValueError: bad batch 12" in done.stderr
        assert poll(lambda: (r := proc.get_or_none("/api/v1/runs/look-1")) and r["status"] == "failed"
                    and proc.get("/api/v1/runs/look-1/incidents")["items"], timeout=30)
        yield proc
    finally:
        proc.stop()


def test_runs_and_incidents_in_a_terminal(server: ServeProcess) -> None:
    env = {"TRAINGUARD_API": server.http_url, "TRAINGUARD_READ_TOKEN": server.tokens["read"]}
    runs = cli("runs", env=env)
    assert runs.returncode == 0 and runs.stderr == "", runs.stderr
    header, row, link = runs.stdout.splitlines()
    assert header.split() == ["RUN", "NAME", "STATUS", "HEALTH", "STEP", "OPEN", "LAST", "SEEN"]
    assert row.split()[:5] == ["look-1", "crashy", "failed", "critical", "11"] and row.endswith(" ago")
    assert link == f"dashboard: {server.http_url}/ui/#/runs"
    incidents = cli("incidents", "look-1", env=env)
    assert incidents.returncode == 0, incidents.stderr
    lines = incidents.stdout.splitlines()
    assert lines[0] == "run look-1 (crashy): failed, critical, last step 11"
    crash = [line for line in lines if "process/exception" in line]
    assert len(crash) == 1, lines
    # the crash came after step 11 (the last logged); the run ended, so the incident is no longer "open"
    assert crash[0].split()[1:4] == ["process/exception", "11", "0"], lines
    assert "ValueError: bad batch" in crash[0] and lines[-1] == f"dashboard: {server.http_url}/ui/#/runs/look-1"
    assert cli("runs", "--status", "running", env=env).stdout == f"no runs with status running at " \
                                                               f"{server.http_url}\n"


def one_line(done: subprocess.CompletedProcess[str], expected: str) -> None:
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected + "\n")


def test_what_stops_them_is_said_at_once(server: ServeProcess, tmp_path: Path) -> None:
    one_line(cli("runs", "--api", server.http_url),
             "trainguard runs: needs a read token: --read-token T or TRAINGUARD_READ_TOKEN (trainguard token "
             "create --data-dir DIR --kind read makes one)")
    one_line(cli("runs", "--api", server.http_url, "--read-token", server.tokens["ingest"]),
             f"trainguard runs: {server.http_url} refused the read token (403): give a read token of the "
             "project with --read-token (TRAINGUARD_READ_TOKEN)")
    one_line(cli("incidents", "nope", "--api", server.http_url, "--read-token", server.tokens["read"]),
             f"trainguard incidents: no run 'nope' at {server.http_url} (trainguard runs lists them)")
    stopped = ServeProcess(tmp_path / "stopped").start()
    url = stopped.http_url
    stopped.stop()
    one_line(cli("runs", "--read-token", "x", env={"TRAINGUARD_ENDPOINT": url}),
             f"trainguard runs: cannot reach the TrainGuard API at {url} ([Errno 111] Connection refused): is "
             "trainguard serve running there? (--api URL, TRAINGUARD_API)")
