"""A training process that dies hard -- SIGKILL, ``os.abort()``, a C++ ``std::terminate`` -- right after its
loss turned NaN: the NaN alert and the exception it reported still reach a real ``trainguard serve``, once
each, delivered from its spool by the next SDK process on the host (issue 16, "a hard death loses the last
second"); and what a process spooled at exit while the backend was down is delivered by a later process
(issue 18, finding 4: a spool per pid was never replayed).

The job is a real torch training (tests/sdk/hard_death_job.py), killed for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from tests.services.agent.conftest import drained
from tests.services.e2e.serve_process import ServeProcess
from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "hard_death_job.py"
NAN_AT = 300
EXIT_CODES = {"sigkill": -signal.SIGKILL, "abort": -signal.SIGABRT, "terminate": -signal.SIGABRT, "exit": 0}
KILLED = ("sigkill", "abort", "terminate")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("hard-death-serve") / "data").start()
    yield proc
    proc.stop()


def job_env(endpoint: str, token: str, run_id: str, spool: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_ENDPOINT=endpoint, TRAINGUARD_TOKEN=token, TRAINGUARD_RUN_ID=run_id,
               TRAINGUARD_SPOOL_DIR=str(spool),
               PYTHONPATH=os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)]))
    return env


def run_job(env: Dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(JOB), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def killed(server: ServeProcess, tmp_path_factory: pytest.TempPathFactory
           ) -> Dict[str, Tuple[Dict[str, str], subprocess.CompletedProcess[str]]]:
    """The three jobs killed each its own way, run at the same time (as three hosts' ranks would die: each has
    its run id and its spool) -- the torch start-ups overlap instead of adding up. ``how`` -> (the job's
    environment, how it ended); each test then runs its own next process and checks its own run."""
    started = {}
    for how in KILLED:
        run_id = f"hard-{how}-{uuid.uuid4().hex[:6]}"
        env = job_env(server.http_url, server.tokens["ingest"], run_id, tmp_path_factory.mktemp(how) / "spool")
        started[how] = env, subprocess.Popen([sys.executable, str(JOB), "train", how, "--nan-at", str(NAN_AT)],
                                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ended = {}
    try:
        for how, (env, proc) in started.items():
            out, err = proc.communicate(timeout=120)
            ended[how] = env, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return ended


def next_process(env: Dict[str, str]) -> Dict[str, Any]:
    """The next SDK process on the host (another run, same endpoint and spool); its report."""
    out = run_job(dict(env, TRAINGUARD_RUN_ID=f"next-{uuid.uuid4().hex[:6]}"), "deliver", "--wait", "30")
    assert out.returncode == 0, out.stderr
    report: Dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def run_events(server: ServeProcess, run_id: str) -> List[Dict[str, Any]]:
    drained(server)
    if server.get_or_none(f"/api/v1/runs/{run_id}") is None:
        return []
    events: List[Dict[str, Any]] = server.pages(f"/api/v1/runs/{run_id}/events")
    return events


def nan_alerts(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [e for e in events if e["kind"] == "metrics"
            and e["payload"].get("metrics", {}).get("alert") == "non_finite:loss"]


def exceptions(events: List[Dict[str, Any]], exc_type: str) -> List[Dict[str, Any]]:
    return [e["payload"]["exception"] for e in events
            if e["kind"] == "exception" and e["payload"]["exception"]["type"] == exc_type]


@pytest.mark.parametrize("how", KILLED)
def test_the_nan_alert_and_the_exception_of_a_killed_rank_arrive_once(
        server: ServeProcess, killed: Dict[str, Tuple[Dict[str, str], subprocess.CompletedProcess[str]]],
        how: str) -> None:
    env, job = killed[how]
    run_id = env["TRAINGUARD_RUN_ID"]
    assert job.returncode == EXIT_CODES[how], job.stderr
    if how == "terminate":
        assert "terminate called" in job.stderr
    else:
        assert job.stderr == ""  # what the process printed is what it would print without the SDK

    report = next_process(env)
    assert report["left"] == [], "the dead process's spool was delivered and removed"
    accounting = report["accounting"]
    assert accounting["sent"] + accounting["spooled"] + accounting["dropped"] == accounting["logged"]
    assert accounting["queued"] == 0 and accounting["dropped"] == 0

    events = run_events(server, run_id)
    assert len({e["event_id"] for e in events}) == len(events)
    (alert,) = nan_alerts(events)
    assert alert["step"] == NAN_AT
    # the values before it came along, those the worker had not sent yet included
    recent = [p["step"] for p in alert["payload"]["metrics"]["recent"] if p["name"] == "loss"]
    assert recent == list(range(NAN_AT - 20, NAN_AT))
    (raised,) = exceptions(events, "FloatingPointError")
    assert raised["message"] == f"loss is nan at step {NAN_AT}" and raised["handled"] is True
    assert any(p["name"] == "loss" for p in raised.get("recent_metrics", [])), "its context came along"
    assert [e["payload"]["lifecycle"]["phase"] for e in events if e["kind"] == "lifecycle"] == ["START"]
    fatal = exceptions(events, "Fatal Python error")
    if how == "sigkill":  # nothing runs after a SIGKILL: no native traceback to keep
        assert fatal == []
        return
    (dump,) = fatal  # faulthandler's dump of the abort, kept in the spool instead of lost
    assert dump["message"] == "Aborted" and dump["mechanism"] == "faulthandler"
    assert [f["function"] for f in dump["frames"]][-2:] == ["train", "die"]


def test_what_a_process_spooled_at_exit_is_delivered_by_a_later_one(tmp_path: Path) -> None:
    """The backend is down while the job runs and ends normally: shutdown spools what is left; a later
    SDK process with the same endpoint delivers it once the backend is back."""
    port = free_port()
    serve = ServeProcess(tmp_path / "data")
    serve.http_port = port
    serve.start()  # once, to create the tokens; then it is down while the job runs
    token = serve.tokens["ingest"]
    serve.stop()
    run_id = f"spooled-{uuid.uuid4().hex[:6]}"
    env = job_env(f"http://127.0.0.1:{port}", token, run_id, tmp_path / "spool")
    job = run_job(env, "train", "exit", "--steps", "40", "--nan-at", "1000")
    assert job.returncode == 0, job.stderr
    assert list((tmp_path / "spool").rglob("*-*.json")), "the job left its events in the spool"

    serve.start()
    try:
        report = next_process(env)
        assert report["left"] == [], (report, job.stderr)
        assert report["replayed"] >= 42, (report, job.stderr)  # 40 metric events, START and EXIT
        events = run_events(serve, run_id)
        phases = sorted(e["payload"]["lifecycle"]["phase"] for e in events if e["kind"] == "lifecycle")
        assert phases == ["EXIT", "START"], (phases, report, job.stderr)
        summary = {m["name"]: m for m in serve.get(f"/api/v1/runs/{run_id}/metrics/summary")}
        assert (summary["loss"]["count"], summary["loss"]["last_step"]) == (40, 39), (report, job.stderr)
    finally:
        serve.stop()
