"""A real ``trainguard serve`` for the agent's end-to-end tests, and how to start the agent against it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.transport.http import HttpTransport

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


def drained(server: ServeProcess) -> None:
    """Return once everything acknowledged so far has been processed: the embedded queue is one FIFO worked
    by one processor thread, so a sentinel event sent now is processed after all of it."""
    run_id = f"sentinel-{uuid.uuid4().hex[:8]}"
    sender = HttpTransport(server.http_url, server.tokens["ingest"], "trainguard-test")
    try:
        event = {"event_id": uuid.uuid4().hex, "run_id": run_id, "time_unix_nano": time.time_ns(),
                 "severity": "INFO", "log": {"logger": "test", "level": "INFO", "message": "sentinel"}}
        assert not sender.send([event], 30.0).rejected
    finally:
        sender.close()
    assert poll(lambda: server.get_or_none(f"/api/v1/runs/{run_id}"), timeout=60), "the sentinel never landed"


def job(kind: str, *args: str) -> List[str]:
    return [sys.executable, str(JOBS), kind, *args]


def run_agent(server: ServeProcess, tmp_path: Path, run_id: str, command: List[str], *flags: str,
              timeout: float = 120.0) -> subprocess.CompletedProcess[bytes]:
    """``trainguard agent ... -- command`` to the end; stdout/stderr as bytes."""
    return subprocess.run(agent_command(server.http_url, tmp_path / "spool", *flags, "--", *command),
                          env=agent_env(server.tokens["ingest"], run_id), capture_output=True, timeout=timeout)


def incidents(server: ServeProcess, run_id: str, want: int = 1, *, with_rule: str = "",
              **match: Any) -> List[Dict[str, Any]]:
    """The run's incidents once at least ``want`` of them match ``match`` (field == value) and, with
    ``with_rule``, carry evidence of that rule (``exit.code``: the EXIT was processed too)."""

    def found() -> Optional[List[Dict[str, Any]]]:
        page = server.get_or_none(f"/api/v1/runs/{run_id}/incidents")
        items = page["items"] if page else []
        hits = [i for i in items if all(i.get(k) == v for k, v in match.items())
                and (not with_rule or any(e["rule"] == with_rule for e in i["evidence"]))]
        return items if len(hits) >= want else None

    items = poll(found, timeout=60)
    assert items is not None, f"no incident {match} for {run_id}: {server.get_or_none(f'/api/v1/runs/{run_id}')}"
    return items
