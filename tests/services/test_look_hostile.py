"""``trainguard runs`` / ``trainguard incidents RUN`` with hostile data in the server (a probe of a running
``trainguard serve``): an exception message holding ANSI escapes reached the terminal through the incident's
title (``Crashed: RuntimeError: boom<ESC>[2J...`` cleared the operator's screen), and a run id with a space
or ``?`` (legal: ids are one URL path segment) ended ``trainguard incidents`` in a traceback (``URL can't
contain control characters``) or read another run. Now control characters print as their escapes and the run
id is percent-encoded. Against ``trainguard serve`` in the test process (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "boom\x1b[2J\x1b[41mALL GOOD"
ODD_RUN = "exp 7?x=1#frag"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        crash = {"event_id": uuid.uuid4().hex, "run_id": ODD_RUN, "step": 2, "severity": "CRITICAL",
                 "time_unix_nano": event("x")["time_unix_nano"],
                 "exception": {"type": "RuntimeError", "message": HOSTILE,
                               "frames": [{"filename": "train.py", "function": "main", "lineno": 3,
                                           "in_app": True}]}}
        r = server.post_events([event(ODD_RUN, step=1), crash, event("exp 7")])
        assert r.json()["accepted"] == 3, r.text
        server.wait_for(lambda: bool(server.get("/api/v1/runs/exp%207%3Fx%3D1%23frag/incidents").json()
                                     .get("items")))
        yield server


def cli(live: LiveServer, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    return subprocess.run([sys.executable, "-m", "trainguard_server", *argv, "--api", live.url,
                           "--read-token", live.read_token], capture_output=True, text=True, env=env, timeout=60)


def test_incidents_of_an_odd_run_id_print_escapes_not_terminal_controls(live: LiveServer) -> None:
    done = cli(live, "incidents", ODD_RUN)
    assert done.returncode == 0, done.stderr  # was 1: InvalidURL traceback
    assert "\x1b" not in done.stdout
    assert f"run {ODD_RUN} (-): " in done.stdout
    assert "Crashed: RuntimeError: boom\\x1b[2J\\x1b[41mALL GOOD" in done.stdout
    assert done.stdout.rstrip().endswith("/ui/#/runs/exp%207%3Fx%3D1%23frag")

