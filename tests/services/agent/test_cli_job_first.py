"""``trainguard agent -- JOB``: the job comes first. Without an upstream or a token it still runs (as itself:
exit status and signal unchanged) after one loud line; ``TRAINGUARD_ENDPOINT`` / ``TRAINGUARD_TOKEN``, what
the SDK uses, are the defaults, and the job then sends to the agent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parents[3]
WARNING = ("trainguard agent: WARNING: --upstream (TRAINGUARD_AGENT_UPSTREAM or TRAINGUARD_ENDPOINT) and --token "
           "(TRAINGUARD_TOKEN) not given: running the job WITHOUT TrainGuard (nothing is captured)\n")


def agent(*argv: str, env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    full.update(env)
    return subprocess.run([sys.executable, "-m", "trainguard_server", "agent", *argv], capture_output=True,
                          text=True, env=full, timeout=60)


def test_without_upstream_the_job_runs_as_itself() -> None:
    done = agent("--", sys.executable, "-c", "print('job ran'); raise SystemExit(3)", env={})
    assert (done.returncode, done.stdout, done.stderr) == (3, "job ran\n", WARNING)
    killed = agent("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", env={})
    assert killed.returncode == -signal.SIGTERM and killed.stderr == WARNING


def test_sidecar_mode_still_needs_them() -> None:
    done = agent("--log-file", "train.log", env={})
    assert (done.returncode, done.stderr) == (2, "trainguard agent: --upstream (TRAINGUARD_AGENT_UPSTREAM or "
                                                 "TRAINGUARD_ENDPOINT) is required\n")


def test_the_sdks_variables_are_the_defaults(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        upstream = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed: the agent spools, the job goes on
    done = agent("--listen", "127.0.0.1:0", "--listen-grpc", "", "--spool-dir", str(tmp_path / "spool"),
                 "--drain-timeout-s", "1", "--", sys.executable, "-c",
                 "import os; print(os.environ['TRAINGUARD_ENDPOINT'], os.environ['TRAINGUARD_TOKEN'])",
                 env={"TRAINGUARD_ENDPOINT": upstream, "TRAINGUARD_TOKEN": "tg_ingest_x"})
    assert done.returncode == 0, done.stderr
    endpoint, token = done.stdout.split()
    assert endpoint.startswith("http://127.0.0.1:") and endpoint != upstream  # through the agent's relay
    assert token == "tg_ingest_x" and "WARNING: --upstream" not in done.stderr
    assert f"upstream {upstream}" in done.stderr  # the relay forwards there (down: spooled, said so)
