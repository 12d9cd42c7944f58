"""A real ``trainguard serve`` for the agent's end-to-end tests, and how to start the agent against it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

JOBS = Path(__file__).resolve().parent / "jobs.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("agent-serve") / "data").start()
    yield proc
    proc.stop()


def agent_command(upstream: str, spool: Path, *extra: str) -> List[str]:
    return [sys.executable, "-m", "trainguard_server", "agent", "--upstream", upstream, "--spool-dir", str(spool),
            "--listen", "127.0.0.1:0", "--listen-grpc", "", *extra]


def agent_env(token: str, run_id: str, **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_TOKEN=token, TRAINGUARD_RUN_ID=run_id, **extra)
    return env


def job(kind: str, *args: str) -> List[str]:
    return [sys.executable, str(JOBS), kind, *args]


def run_agent(server: ServeProcess, tmp_path: Path, run_id: str, command: List[str], *flags: str,
              timeout: float = 120.0) -> subprocess.CompletedProcess[bytes]:
    """``trainguard agent ... -- command`` to the end; stdout/stderr as bytes."""
    return subprocess.run(agent_command(server.http_url, tmp_path / "spool", *flags, "--", *command),
                          env=agent_env(server.tokens["ingest"], run_id), capture_output=True, timeout=timeout)


def incidents(server: ServeProcess, run_id: str, want: int = 1, **match: Any) -> List[Dict[str, Any]]:
    """The run's incidents once at least ``want`` of them match ``match`` (field == value)."""

    def found() -> Optional[List[Dict[str, Any]]]:
        page = server.get_or_none(f"/api/v1/runs/{run_id}/incidents")
        items = page["items"] if page else []
        hits = [i for i in items if all(i.get(k) == v for k, v in match.items())]
        return items if len(hits) >= want else None

    items = poll(found, timeout=30)
    assert items is not None, f"no incident {match} for {run_id}: {server.get_or_none(f'/api/v1/runs/{run_id}')}"
    return items
