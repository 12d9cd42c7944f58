"""``trainguard agent -- <job>`` around real torch trainings without the SDK, against a real ``trainguard
serve``: output passed through byte for byte, exit code / signal preserved, the failure classified from
what the job printed, a hang reported with the job's Python stacks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.services.agent.conftest import agent_command, agent_env, incidents, job, run_agent
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.core.tracebacks import parse_traceback_text


def _events(server: ServeProcess, run_id: str, kinds: str) -> list:
    return server.pages(f"/api/v1/runs/{run_id}/events", kinds=kinds)


def test_clean_exit_passes_output_through_untouched(server: ServeProcess, tmp_path: Path) -> None:
    # the same job unwrapped, run meanwhile (its output is deterministic: seeded, one line per step)
    direct = subprocess.Popen(job("healthy"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wrapped = run_agent(server, tmp_path, "agent-clean", job("healthy"))
        direct_out, direct_err = direct.communicate(timeout=60)
    finally:
        if direct.poll() is None:
            direct.kill()
            direct.communicate()
    assert direct.returncode == 0 and wrapped.returncode == 0, wrapped.stderr.decode()
    assert wrapped.stdout == direct_out and wrapped.stdout.count(b"\n") == 20
    assert wrapped.stderr == direct_err == b""
    run = poll(lambda: (r := server.get_or_none("/api/v1/runs/agent-clean")) and r["status"] == "finished" and r)
    assert run, server.get_or_none("/api/v1/runs/agent-clean")
    assert run["health"] != "critical" and not server.get("/api/v1/runs/agent-clean/incidents")["items"]
    assert run["exit_codes"] == {"0": 0} and run["tags"]["agent"] == "true"


def test_crash_traceback_fingerprinted_and_exit_code_preserved(server: ServeProcess, tmp_path: Path) -> None:
    done = run_agent(server, tmp_path, "agent-crash", job("crash"))
    assert done.returncode == 1
    stderr = done.stderr.decode()
    assert stderr.startswith("Traceback (most recent call last):") and "IndexError: list index out of range" in stderr
    expected = parse_traceback_text(stderr)[-1].fingerprint().to_dict()["fingerprint"]
    (incident,) = incidents(server, "agent-crash", category="process", subtype="exception", with_rule="exit.code")
    assert incident["fingerprint"] == expected
    assert "IndexError" in incident["title"]
    rules = {e["rule"]: e for e in incident["evidence"]}
    assert rules["exit.code"]["value"] == 1
    (exc,) = _events(server, "agent-crash", "exception")
    assert exc["payload"]["exception"]["mechanism"] == "log"
    assert exc["payload"]["exception"]["fingerprint"] == expected
    assert server.get("/api/v1/runs/agent-crash")["exit_codes"] == {"0": 1}
    # the exception carries the step the agent last saw printed: none (no SDK), so -1
    assert exc["step"] == -1


def test_cuda_oom_text_classified_as_memory_oom(server: ServeProcess, tmp_path: Path) -> None:
    done = run_agent(server, tmp_path, "agent-oom", job("oom"))
    assert done.returncode == 1
    assert b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 GiB" in done.stderr
    items = incidents(server, "agent-oom", category="memory", subtype="oom")
    oom = next(i for i in items if i["subtype"] == "oom")
    assert "256" in oom["title"] or "256" in oom["summary"], oom
    assert not [i for i in items if i["category"] == "process"], items


def test_collective_timeout_from_torchrun_output(server: ServeProcess, tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
                "--standalone", str(Path(job("comm_timeout")[1])), "comm_timeout"]
    done = run_agent(server, tmp_path, "agent-comm", torchrun, timeout=180)
    output = done.stderr.decode() + done.stdout.decode()
    assert done.returncode == 1, output[-3000:]
    assert "Timed out waiting 3000ms" in output
    items = incidents(server, "agent-comm", category="comm", subtype="timeout")
    timeout = next(i for i in items if i["subtype"] == "timeout")
    assert timeout["lead_rank"] in (0, 1)
    assert not [i for i in items if i["category"] == "process"], [(i["category"], i["subtype"]) for i in items]


def test_hang_reported_with_stacks_and_signal_preserved(server: ServeProcess, tmp_path: Path) -> None:
    cmd = agent_command(server.http_url, tmp_path / "spool", "--hang-floor-s", "3", "--hang-factor", "10",
                        "--", *job("hang"))
    agent = subprocess.Popen(cmd, env=agent_env(server.tokens["ingest"], "agent-hang"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        items = incidents(server, "agent-hang", category="progress", subtype="stalled")
        stall = next(i for i in items if i["subtype"] == "stalled")
        hang = next(e for e in stall["evidence"] if e["rule"] == "agent.hang")
        assert 3.0 <= hang["value"] < 10.0 and hang["threshold"] == 3.0, hang
        assert "wait_for_batch" in hang["description"], hang["description"]
        report = next(e for e in _events(server, "agent-hang", "log")
                      if e["payload"]["log"].get("source") == "agent:hang")
        text = report["payload"]["log"]["message"]
        assert "step 7 loss" in text and "Python stacks (py-spy)" in text and "wait_for_batch" in text
        assert stall["first_step"] == -1 and stall["lead_rank"] == 0
        time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == -signal.SIGTERM, err.decode()[-2000:]
    assert out.count(b"\n") == 8  # steps 0-7 printed, nothing added
    exits = poll(lambda: [e["payload"]["lifecycle"] for e in _events(server, "agent-hang", "lifecycle")
                          if e["payload"]["lifecycle"].get("phase") == "EXIT"], timeout=60)
    assert [(e["exit_code"], e["signal"], e["reason"]) for e in exits] == [(143, 15, "signal")]
    def killed_while_stalled() -> object:
        return next((i for i in server.get("/api/v1/runs/agent-hang/incidents")["items"]
                     if i["subtype"] == "stalled" and any("while stalled" in t["what"] for t in i["timeline"])),
                    None)

    final = poll(killed_while_stalled, timeout=15)
    assert final is not None and final["status"] != "resolved", server.get("/api/v1/runs/agent-hang/incidents")

def test_agent_refuses_other_tokens_and_bad_input(server: ServeProcess, tmp_path: Path) -> None:
    """The relay's local gateway answers like the platform's: 401 for a wrong token, per-item 400s."""
    import json
    import urllib.error
    import urllib.request

    cmd = agent_command(server.http_url, tmp_path / "spool", "--listen", "127.0.0.1:0", "--", sys.executable,
                        "-c", "import time; time.sleep(30)")
    env = agent_env(server.tokens["ingest"], "agent-auth")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        status = None
        port = poll(lambda: _listening_port(agent.pid), timeout=20)
        assert port, "agent did not listen"
        url = f"http://127.0.0.1:{port}/v1/ingest"

        def post(body: bytes, token: str) -> tuple:
            req = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {token}",
                                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        status, body = post(b'{"events": []}', "wrong")
        assert status == 401 and "own ingest token" in body["detail"]
        good = {"event_id": "e" * 32, "run_id": "agent-auth", "time_unix_nano": time.time_ns(), "step": 1,
                "metrics": {"points": [{"name": "loss", "value": 1.0}]}}
        bad = {"event_id": "f" * 32, "run_id": "", "metrics": {"points": []}}
        status, body = post(json.dumps({"events": [good, bad]}).encode(), server.tokens["ingest"])
        assert status == 200 and body["accepted"] == 1
        assert body["rejected"][0]["index"] == 1 and body["rejected"][0]["code"] == "missing_field"
        health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert json.loads(health.read()) == {"status": "ok"}
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=60)


def _listening_port(pid: int) -> int:
    """The TCP port a process listens on (from /proc/net/tcp and its socket inodes), 0 if none yet."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:
                return int(parts[1].rsplit(":", 1)[1], 16)
    return 0
