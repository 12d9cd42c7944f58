"""``trainguard spool send``: a job that ran entirely while its backend was down is delivered by hand.

Real parts: the job is a Python process with the SDK whose backend port is closed (its batches go to the
disk spool and stay there when it exits); the backend is a real ``trainguard serve``; the command is the real
CLI process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from tests.sdk.scripting import run_python
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_while_down(spool: Path, run_id: str, endpoint: str) -> None:
    """A 25-step job whose backend is down the whole time: its events stay in ``spool``."""
    done = run_python(f"""
        import trainguard
        trainguard.init(endpoint={endpoint!r}, run_id={run_id!r}, spool_dir={str(spool)!r},
                        connect_timeout=0.2, shutdown_timeout=1, capture_exit=True)
        for step in range(25):
            trainguard.log(step=step, loss=1.0 / (step + 1))
    """)
    assert done.returncode == 0, done.stderr
    assert list(spool.rglob("*.json")), "the job left its batches in the spool"


def cli(*argv: str, env: Dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainguard_server", "spool", *argv], capture_output=True,
                          text=True, env=full, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("spool-send") / "data").start()
    try:
        yield proc
    finally:
        proc.stop()


def loss_steps(server: ServeProcess, run_id: str) -> int:
    series = server.get(f"/api/v1/runs/{run_id}/metrics", names="loss", max_points=100)["series"]
    return sum(b["count"] for b in series.get("loss", {}).get("0", []))


def test_a_spool_left_by_a_job_run_while_down_is_sent_by_hand(tmp_path: Path, server: ServeProcess) -> None:
    spool = tmp_path / "spool"
    down = f"http://127.0.0.1:{free_port()}"
    job_while_down(spool, "spooled-1", down)
    # the backend is where the job was sending, now up: --endpoint says so
    done = cli("send", "--spool-dir", str(spool), "--endpoint", server.http_url,
               env={"TRAINGUARD_TOKEN": server.tokens["ingest"]})
    assert done.returncode == 0, done.stderr
    lines: List[str] = done.stdout.splitlines()
    assert lines[0].startswith("spooled-1-rank0-pid") and f"to {server.http_url}" in lines[0]
    assert lines[-1].startswith("sent ") and lines[-1].endswith(" from 1 spool directories of finished processes")
    assert poll(lambda: loss_steps(server, "spooled-1") == 25, timeout=30), loss_steps(server, "spooled-1")
    run = server.get("/api/v1/runs/spooled-1")
    assert run["status"] == "finished"  # the exit event was in the spool too
    assert not list(spool.rglob("*.json")), "what was delivered left the spool"
    again = cli("send", "--spool-dir", str(spool), "--endpoint", server.http_url)
    assert (again.returncode, again.stdout) == (0, "sent 0 events from 0 spool directories of finished "
                                                   "processes\n")


def test_the_server_still_down_keeps_the_spool(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    down = f"http://127.0.0.1:{free_port()}"
    job_while_down(spool, "spooled-2", down)
    before = sorted(p.name for p in spool.rglob("*.json"))
    done = cli("send", "--spool-dir", str(spool), "--token", "x")  # default: where the job was sending
    assert done.returncode == 1
    assert done.stderr.startswith(f"trainguard spool: not everything was sent: {down} cannot take them now (")
    assert done.stderr.rstrip().endswith(f"; what is left stays in {spool}") and done.stderr.count("\n") == 1
    assert sorted(p.name for p in spool.rglob("*.json")) == before


def test_operator_mistakes(tmp_path: Path, server: ServeProcess) -> None:
    missing = cli("send", "--spool-dir", str(tmp_path / "nope"))
    assert (missing.returncode, missing.stderr) == (2, f"trainguard spool: no spool directory at "
                                                       f"{tmp_path / 'nope'}: give the job's spool with "
                                                       "--spool-dir DIR (TRAINGUARD_SPOOL_DIR of the job)\n")
    spool = tmp_path / "spool"
    job_while_down(spool, "spooled-3", f"http://127.0.0.1:{free_port()}")
    refused = cli("send", "--spool-dir", str(spool), "--endpoint", server.http_url, "--token", "tg_ingest_bad")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"trainguard spool: {server.http_url} refused the token (")
    assert refused.stderr.endswith("): give an ingest token of the run's project with --token "
                                   "(TRAINGUARD_TOKEN)\n")
    assert list(spool.rglob("*.json")), "nothing was lost"
