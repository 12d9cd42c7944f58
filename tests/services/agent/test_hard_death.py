"""``trainguard agent -- <a real torch training that dies hard>``: what the SDK of the killed rank wrote ahead
(the NaN alert, the exception it reported) and faulthandler's dump of an abort reach a real
``trainguard serve`` through the agent, once each (issue 16, "a hard death loses the last second"); a dead
process's spool that was going elsewhere is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import List

import pytest

from tests.sdk.test_hard_death import JOB, NAN_AT, REPO, exceptions, job_env, nan_alerts, run_events, run_job
from tests.services.agent.conftest import agent_command, agent_env
from tests.services.e2e.serve_process import ServeProcess
from tests.support.net import free_port


def foreign_spool(root: Path) -> Path:
    """A dead process's spool under ``root`` whose events were going to another platform (a non-loopback
    endpoint that never answers): SIGKILLed after its NaN, it left its write-ahead file there."""
    port = free_port()  # nobody listens; the endpoint's host is what makes it foreign
    env = job_env(f"http://192.0.2.1:{port}", "other-platform-token", f"foreign-{uuid.uuid4().hex[:6]}", root)
    env["TRAINGUARD_CONNECT_TIMEOUT"] = "0.2"
    done = run_job(env, "train", "sigkill", "--steps", "20", "--nan-at", "10")
    assert done.returncode == -signal.SIGKILL, done.stderr
    (left,) = [p for p in root.glob("*/*") if p.is_dir()]
    return left


@pytest.mark.parametrize("how", ["sigkill", "abort"])
def test_the_agent_delivers_what_a_killed_rank_left(server: ServeProcess, tmp_path: Path, how: str) -> None:
    spool = tmp_path / "agent-spool"
    sdk_root = spool / "sdk"  # where the agent tells its job's SDK to spool
    foreign = foreign_spool(sdk_root)
    foreign_files = {p.name: p.read_bytes() for p in foreign.iterdir()}
    assert "write-ahead.jsonl" in foreign_files
    run_id = f"agent-hard-{how}-{uuid.uuid4().hex[:6]}"
    env = agent_env(server.tokens["ingest"], run_id,
                    PYTHONPATH=os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)]))
    cmd = agent_command(server.http_url, spool, "--", *job_command("train", how, "--nan-at", str(NAN_AT)))
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    # the agent ends as its job did (a SIGKILL it cannot send itself: 137)
    assert done.returncode == (128 + signal.SIGKILL if how == "sigkill" else -signal.SIGABRT), \
        done.stderr.decode()[-2000:]

    events = run_events(server, run_id)
    assert len({e["event_id"] for e in events}) == len(events)
    (alert,) = nan_alerts(events)
    assert alert["step"] == NAN_AT and not alert["payload"]["sdk"].startswith("trainguard-agent")
    (raised,) = exceptions(events, "FloatingPointError")
    assert raised["message"] == f"loss is nan at step {NAN_AT}"
    fatal = exceptions(events, "Fatal Python error")
    assert [f["mechanism"] for f in fatal] == ([] if how == "sigkill" else ["faulthandler"])
    exits = [e["payload"]["lifecycle"] for e in events if e["kind"] == "lifecycle"
             and e["payload"]["lifecycle"]["phase"] == "EXIT"]
    expected_signal = signal.SIGKILL if how == "sigkill" else signal.SIGABRT
    assert [(x["exit_code"], x["signal"]) for x in exits] == [(128 + expected_signal, expected_signal)]

    # the killed rank's spool is gone; the one going elsewhere was not touched
    assert [p for p in sdk_root.glob("*/*") if p != foreign] == []
    assert {p.name: p.read_bytes() for p in foreign.iterdir()} == foreign_files



def job_command(*args: str) -> List[str]:
    return [sys.executable, str(JOB), *args]
