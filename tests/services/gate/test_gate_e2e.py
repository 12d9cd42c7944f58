"""``trainguard gate`` end to end: a real ``trainguard serve``, real canary trainings with the SDK (the
``canary`` kind of trainguard_server.demo.trainings), baselines defined and candidates gated through the API
and through the CLI (over the API and on the data directory).

Baseline: three healthy runs, seeds 0-2. Candidates: the same code with seeds 3 and 4 (must pass: the loss
is deterministic by seed, and step time never fails under the default policy), an LR regression (LR / 10:
fails on the loss envelope), a code change raising a new exception (fails on the fingerprint) and a
memory regression (+256 MiB kept alive: fails on peak memory by default, warns under a policy that only
warns).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

BASE_TAG = "gate=e2e-base"
STEPS = 200
CANDIDATES: Dict[str, Tuple[str, ...]] = {
    "healthy-3": ("--seed", "3"),
    "healthy-4": ("--seed", "4"),
    "lr-regression": ("--seed", "5", "--lr", "0.005"),
    "new-exception": ("--seed", "6", "--raise-at", "120"),
    "memory-regression": ("--seed", "7", "--extra-memory-mb", "256"),
}


def canary(server: ServeProcess, run_id: str, *flags: str, steps: int = STEPS,
           step_sleep: float = 0.0) -> subprocess.Popen[str]:
    """A canary training reporting to ``server`` over HTTP as run ``run_id``."""
    env = dict(os.environ, TRAINGUARD_ENDPOINT=server.http_url, TRAINGUARD_TOKEN=server.tokens["ingest"],
               TRAINGUARD_RUN_ID=run_id, TRAINGUARD_FLUSH_INTERVAL="0.2",
               TRAINGUARD_SPOOL_DIR=str(server.data_dir.parent / f"spool-{run_id}"))
    return subprocess.Popen([sys.executable, "-m", "trainguard_server.demo.trainings", "canary",
                             "--steps", str(steps), "--step-sleep", str(step_sleep), *flags],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_to_end(server: ServeProcess, run_id: str, *flags: str) -> Tuple[int, str]:
    proc = canary(server, run_id, *flags)
    output, _ = proc.communicate(timeout=120)
    ended = poll(lambda: (r := server.get_or_none(f"/api/v1/runs/{run_id}")) and r["status"] != "running",
                 timeout=60)
    assert ended, f"run {run_id} never ended in the backend; output:\n{output}"
    return proc.returncode, output


def call(server: ServeProcess, method: str, path: str, body: Optional[Dict[str, Any]] = None,
         token: Optional[str] = "read") -> Tuple[int, Any]:
    """(HTTP status, JSON) of a request to the API with the named bootstrap token (None: no token)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {server.tokens[token]}"
    request = urllib.request.Request(server.http_url + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def gate_cli(server: Optional[ServeProcess], *args: str, env: Optional[Dict[str, str]] = None
             ) -> subprocess.CompletedProcess[str]:
    where = ["--api", server.http_url, "--read-token", server.tokens["read"]] if server else []
    return subprocess.run([sys.executable, "-m", "trainguard_server", "gate", *where, *args], text=True,
                          capture_output=True, timeout=120, env=dict(os.environ, **(env or {})))


class World:
    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self.exits: Dict[str, Tuple[int, str]] = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    server = ServeProcess(tmp_path_factory.mktemp("gate") / "data").start()
    try:
        w = World(server)
        jobs: List[Tuple[str, Tuple[str, ...]]] = [
            (f"base-{seed}", ("--seed", str(seed), "--tag", BASE_TAG)) for seed in range(3)]
        jobs += list(CANDIDATES.items())
        with ThreadPoolExecutor(max_workers=3) as pool:
            for run_id, result in zip([j[0] for j in jobs],
                                      pool.map(lambda job: run_to_end(server, job[0], *job[1]), jobs)):
                w.exits[run_id] = result
        status, baseline = call(server, "PUT", "/api/v1/baselines/mlp-main",
                                {"tag": BASE_TAG, "description": "three healthy seeds"})
        assert status == 200, baseline
        yield w
    finally:
        server.stop()


def gate(world: World, candidate: str, policy: Optional[Dict[str, Any]] = None,
         baseline: str = "mlp-main") -> Dict[str, Any]:
    status, verdict = call(world.server, "POST", "/api/v1/gate",
                           {"baseline": baseline, "candidate": candidate, "policy": policy})
    assert status == 200, verdict
    return verdict


def checks(verdict: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {c["name"]: c for c in verdict["checks"]}


def test_the_trainings_ended_as_intended(world: World) -> None:
    for run_id, (code, output) in world.exits.items():
        expected = 1 if run_id == "new-exception" else 0
        assert code == expected, f"{run_id} exited {code}:\n{output}"
    assert "shape '[-1, 17]' is invalid" in world.exits["new-exception"][1]


def test_a_baseline_from_a_tag_is_profiled(world: World) -> None:
    status, doc = call(world.server, "GET", "/api/v1/baselines/mlp-main")
    assert status == 200
    assert sorted(doc["runs"]) == ["base-0", "base-1", "base-2"] and doc["tag"] == BASE_TAG
    profile = doc["profile"]
    assert sorted(profile["runs"]) == ["base-0", "base-1", "base-2"] and profile["excluded"] == {}
    assert profile["loss"]["metric"] == "loss" and profile["loss"]["transform"] == "log"
    assert profile["loss"]["matched_steps"] == STEPS - 1 or profile["loss"]["matched_steps"] == STEPS
    assert profile["step_time"]["metric"] == "time/step_s"
    assert profile["peak_memory"]["metric"] == "mem/rss"  # CPU: the SDK reports the process RSS
    assert profile["incident_kinds"] == {} and profile["fingerprints"] == 0
    assert profile["total_steps"] == 3 * STEPS
    status, listing = call(world.server, "GET", "/api/v1/baselines")
    assert status == 200 and [b["name"] for b in listing["items"]] == ["mlp-main"]


@pytest.mark.parametrize("candidate", ["healthy-3", "healthy-4"])
def test_healthy_seeds_pass(world: World, candidate: str) -> None:
    verdict = gate(world, candidate)
    found = checks(verdict)
    assert verdict["exit_code"] == 0 and verdict["verdict"] in ("pass", "warn"), verdict["reason"]
    for name in ("status", "fingerprints", "incidents", "loss", "peak_memory"):
        assert found[name]["status"] == "pass", found[name]
    assert found["loss"]["figures"]["matched_steps"] >= STEPS - 1
    assert found["loss"]["figures"]["max_z"] < verdict["policy"]["loss"]["k"]
    assert found["step_time"]["status"] in ("pass", "warn")  # step time never fails by default


def test_an_lr_regression_fails_on_the_loss_envelope(world: World) -> None:
    verdict = gate(world, "lr-regression")
    found = checks(verdict)
    assert verdict["verdict"] == "fail" and verdict["exit_code"] == 1
    assert found["loss"]["status"] == "fail", found["loss"]
    assert found["loss"]["figures"]["longest_outside"] > verdict["policy"]["loss"]["max_consecutive"]
    assert "outside the baseline envelope" in found["loss"]["summary"]
    for name in ("status", "fingerprints", "incidents", "peak_memory"):
        assert found[name]["status"] == "pass", found[name]
    # the plot the summary draws: envelope and candidate at the matched steps, in the loss's units
    plot = verdict["plot"]
    assert len(plot["steps"]) == len(plot["center"]) == len(plot["band_high"]) == len(plot["candidate"])
    last = plot["candidate"][-1]
    assert last is not None and last > plot["band_high"][-1] > plot["center"][-1]


def test_a_new_exception_fails_on_the_fingerprint(world: World) -> None:
    verdict = gate(world, "new-exception")
    found = checks(verdict)
    assert verdict["verdict"] == "fail" and verdict["exit_code"] == 1
    assert found["fingerprints"]["status"] == "fail"
    _, incidents = call(world.server, "GET", "/api/v1/runs/new-exception/incidents")
    crash = [i for i in incidents["items"] if (i["category"], i["subtype"]) == ("process", "exception")]
    assert crash and found["fingerprints"]["figures"]["new"] == [crash[0]["fingerprint"]]
    assert "RuntimeError" in found["fingerprints"]["summary"]
    assert found["status"]["status"] == "fail"  # the run failed (exit 1)
    # a process/exception incident is severity "error": a new kind warns, the fingerprint is what fails
    assert found["incidents"]["status"] == "warn"
    # ignoring that fingerprint leaves the failed status as the only failure
    ignored = checks(gate(world, "new-exception", {"fingerprints": {"ignore": [crash[0]["fingerprint"]]}}))
    assert ignored["fingerprints"]["status"] == "pass" and ignored["status"]["status"] == "fail"


def test_a_memory_regression_fails_by_default_and_warns_under_a_warning_policy(world: World) -> None:
    verdict = gate(world, "memory-regression")
    found = checks(verdict)
    assert verdict["verdict"] == "fail" and found["peak_memory"]["status"] == "fail", found["peak_memory"]
    figures = found["peak_memory"]["figures"]
    assert figures["metric"] == "mem/rss" and figures["candidate"] - figures["baseline_median"] > 200 * 2**20
    assert figures["change_pct"] > 25
    assert found["loss"]["status"] == "pass"  # the same training otherwise
    warn_only = gate(world, "memory-regression", {"peak_memory": {"fail_pct": None, "warn_pct": 10}})
    assert warn_only["verdict"] == "warn" and warn_only["exit_code"] == 0
    assert checks(warn_only)["peak_memory"]["status"] == "warn"


def test_the_cli_over_the_api_writes_markdown_and_junit(world: World, tmp_path: Path) -> None:
    md, xml, js = tmp_path / "gate.md", tmp_path / "gate.xml", tmp_path / "gate.json"
    done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "lr-regression",
                    "--markdown", str(md), "--junit", str(xml), "--json", str(js))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gate FAIL (exit 1)" in done.stdout and "fail      loss" in done.stdout
    summary = md.read_text()
    assert "## TrainGuard gate: ❌ FAIL (exit 1)" in summary
    assert "```mermaid" in summary and "xychart-beta" in summary and "| loss | ❌ fail |" in summary
    suite = ET.parse(xml).getroot()
    assert suite.get("failures") == "1" and suite.get("errors") == "0"
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failed == ["loss"]
    assert json.loads(js.read_text())["verdict"] == "fail"
    # a healthy canary, with the API and token from the environment as a CI job would pass them
    done = gate_cli(None, "--baseline", "mlp-main", "--candidate", "healthy-3", "--junit", str(xml),
                    env={"TRAINGUARD_API": world.server.http_url,
                         "TRAINGUARD_READ_TOKEN": world.server.tokens["read"]})
    assert done.returncode == 0, done.stdout + done.stderr
    suite = ET.parse(xml).getroot()
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    # a policy file: the memory regression only warns under it (exit 0), and the CI's policy file is valid
    policy = tmp_path / "warn-only.yaml"
    policy.write_text("peak_memory:\n  warn_pct: 10\n  fail_pct: null  # warn only\n")
    done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "memory-regression",
                    "--policy", str(policy))
    assert done.returncode == 0 and "gate WARN (exit 0)" in done.stdout, done.stdout + done.stderr
    done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "healthy-4",
                    "--policy", str(Path(__file__).parents[3] / "deploy" / "ci" / "gate-policy.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_on_the_data_directory(world: World) -> None:
    data = str(world.server.data_dir)
    done = gate_cli(None, "--data-dir", data, "--baseline", "mlp-main", "--candidate", "healthy-4")
    assert done.returncode == 0, done.stdout + done.stderr
    # defining another baseline from a run list there, then reading it back through the API
    done = gate_cli(None, "--data-dir", data, "--baseline", "two-seeds", "--baseline-runs", "base-0,base-1")
    assert done.returncode == 0 and "2 usable run(s)" in done.stdout, done.stdout + done.stderr
    status, doc = call(world.server, "GET", "/api/v1/baselines/two-seeds")
    assert status == 200 and doc["runs"] == ["base-0", "base-1"]
    done = gate_cli(None, "--data-dir", data, "--baseline", "two-seeds", "--candidate", "lr-regression")
    assert done.returncode == 1, done.stdout + done.stderr


def test_what_the_gate_cannot_decide_exits_2_with_the_reason(world: World, tmp_path: Path) -> None:
    verdict = gate(world, "healthy-3", baseline="no-such-baseline")
    assert verdict["exit_code"] == 2 and "no baseline 'no-such-baseline'" in verdict["reason"]
    done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "no-such-run", "--wait-timeout", "0.5",
                    "--junit", str(tmp_path / "u.xml"))
    assert done.returncode == 2 and "no run 'no-such-run'" in done.stdout
    assert ET.parse(tmp_path / "u.xml").getroot().get("errors") == "1"
    # one usable run is not a baseline
    status, _ = call(world.server, "PUT", "/api/v1/baselines/one-run", {"runs": ["base-0"]})
    assert status == 200
    verdict = gate(world, "healthy-3", baseline="one-run")
    assert verdict["exit_code"] == 2 and "1 usable run(s), the policy needs 2" in verdict["reason"]
    # a failed run in the baseline is left out, with the reason
    status, doc = call(world.server, "PUT", "/api/v1/baselines/with-crash",
                       {"runs": ["base-0", "base-1", "new-exception"]})
    assert status == 200 and doc["profile"]["excluded"] == {
        "new-exception": "status failed (baseline.statuses: finished)"}
    # the candidate is one of the baseline's runs
    assert gate(world, "base-1")["exit_code"] == 2
    # a canary still running
    proc = canary(world.server, "still-running", "--seed", "9", steps=100_000, step_sleep=0.005)
    try:
        assert poll(lambda: (r := world.server.get_or_none("/api/v1/runs/still-running")) and r["last_step"] > 5,
                    timeout=60)
        verdict = gate(world, "still-running")
        assert verdict["exit_code"] == 2 and "is still running" in verdict["reason"]
        done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "still-running",
                        "--wait-timeout", "0.5")
        assert done.returncode == 2 and "still running" in done.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_requests_the_gate_refuses(world: World) -> None:
    assert call(world.server, "POST", "/api/v1/gate", {"baseline": "mlp-main", "candidate": "healthy-3"},
                token=None)[0] == 401
    assert call(world.server, "GET", "/api/v1/baselines/mlp-main", token="ingest")[0] == 403
    status, answer = call(world.server, "POST", "/api/v1/gate", {"baseline": "mlp-main", "candidate": "healthy-3",
                                                                "policy": {"loss": {"kk": 3}}})
    assert status == 422 and "unknown key loss.kk" in answer["detail"]
    status, answer = call(world.server, "PUT", "/api/v1/baselines/nothing", {"tag": "gate=none"})
    assert status == 422 and "no run of project 'default' has the tag 'gate=none'" in answer["detail"]
    status, answer = call(world.server, "PUT", "/api/v1/baselines/blank", {"tag": "\u000b", "policy": None})
    assert status == 422 and "invalid tag filter" in answer["detail"], (status, answer)  # was a 500
    status, answer = call(world.server, "PUT", "/api/v1/baselines/ghosts", {"runs": ["base-0", "ghost"]})
    assert status == 422 and "unknown run(s) in project 'default': ghost" in answer["detail"]
    status, answer = call(world.server, "PUT", "/api/v1/baselines/bad%20name", {"runs": ["base-0"]})
    assert status == 422 and "a baseline name is" in answer["detail"]
    done = gate_cli(world.server, "--baseline", "mlp-main", "--candidate", "healthy-3", "--policy",
                    str(Path(__file__).parent / "no-such-policy.yaml"))
    assert done.returncode == 2 and "cannot read the policy file" in done.stderr
    done = gate_cli(None, "--api", "http://127.0.0.1:9", "--read-token", "x", "--baseline", "b",
                    "--candidate", "r", "--wait-timeout", "0")
    assert done.returncode == 2 and "cannot reach" in done.stderr, done.stderr
