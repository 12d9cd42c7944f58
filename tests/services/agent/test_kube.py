"""The sidecar reads the training container's end from the pod's status (agent/kube.py).

There is no Kubernetes API server here (no cluster, no container runtime), so the API is stood in for by a
small HTTP server that serves Pod objects the way ``GET /api/v1/namespaces/{ns}/pods/{name}`` does; the Pod
objects (tests/fixtures/kubernetes) are checked against Kubernetes' own v1 Pod schema (kubernetes-validate,
strict) so their shape is the real one. The agent, the training job and ``trainguard serve`` are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.deploy.manifests import validate_core
from tests.services.agent.conftest import agent_command, agent_env, incidents, job
from tests.services.e2e.serve_process import ServeProcess
from tests.support.http_stub import QuietHandler
from tests.support.waiting import poll
from trainguard_server.agent.kube import KubeConfig, PodStatusReader, container_end

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "kubernetes"
POD_PATH = "/api/v1/namespaces/ml/pods/train-resnet-x7k2p"


def pod(name: str) -> Dict[str, Any]:
    doc: Dict[str, Any] = json.loads((FIXTURES / f"pod_trainer_{name}.json").read_text())
    return doc


@pytest.mark.parametrize("name", ["running", "oomkilled", "restarted"])
def test_the_pod_fixtures_are_valid_kubernetes_pods(name: str) -> None:
    validate_core(pod(name), "1.37")


def test_container_end_reads_the_terminated_state() -> None:
    assert container_end(pod("running"), "trainer") is None
    end = container_end(pod("oomkilled"), "trainer")
    assert end is not None
    assert (end.exit_code, end.signal, end.reason, end.telling_reason) == (137, 9, "OOMKilled", "OOMKilled")
    assert end.finished_at == "2026-11-29T11:47:21Z" and end.restart_count == 0
    assert container_end(pod("oomkilled"), "trainguard-agent") is None  # the sidecar still runs
    assert container_end(pod("oomkilled"), "nope") is None
    # restarted and running again: its earlier end only when asked for
    assert container_end(pod("restarted"), "trainer") is None
    last = container_end(pod("restarted"), "trainer", include_last=True)
    assert last is not None and (last.exit_code, last.signal, last.reason, last.restart_count) == (1, 0, "Error", 1)
    assert last.telling_reason == "" and "illegal memory access" in last.message


def test_in_cluster_config_from_the_service_account(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t0\n")
    (sa / "ca.crt").write_text("")
    (sa / "namespace").write_text("ml\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "HOSTNAME": "train-x"}
    config = KubeConfig.from_environment(env, service_account=sa)
    assert (config.api, config.namespace, config.pod) == ("https://10.96.0.1:443", "ml", "train-x")
    assert config.token_file == str(sa / "token") and config.ca_file == str(sa / "ca.crt")
    assert config.pod_url == "https://10.96.0.1:443/api/v1/namespaces/ml/pods/train-x"
    v6 = KubeConfig.from_environment({**env, "KUBERNETES_SERVICE_HOST": "fd00::1", "POD_NAME": "p",
                                      "POD_NAMESPACE": "team-a"}, service_account=sa)
    assert (v6.api, v6.namespace, v6.pod) == ("https://[fd00::1]:443", "team-a", "p")
    # the token goes over TLS or to this machine only (kubectl proxy), never in clear over the network
    assert KubeConfig.from_environment(env, api="http://10.0.0.5:8001", service_account=sa).token_file == ""
    assert KubeConfig.from_environment(env, api="http://127.0.0.1:8001",
                                       service_account=sa).token_file == str(sa / "token")
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubeConfig.from_environment({}, service_account=tmp_path / "none")
    with pytest.raises(ValueError, match="POD_NAME and POD_NAMESPACE"):
        KubeConfig.from_environment({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, service_account=tmp_path / "none")


class StandInApi:
    """Serves one Pod object at POD_PATH; ``status`` forces an HTTP error; records Authorization headers."""

    def __init__(self) -> None:
        self.pod: Dict[str, Any] = pod("running")
        self.status = 200
        self.token = ""
        self.authorizations: List[str] = []
        api = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                api.authorizations.append(self.headers.get("Authorization", ""))
                if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                    self.send_json(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                elif api.status != 200:
                    self.send_json(api.status, {"kind": "Status", "code": api.status})
                elif self.path != POD_PATH:
                    self.send_json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                else:
                    self.send_json(200, api.pod)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def api() -> Iterator[StandInApi]:
    stand_in = StandInApi()
    yield stand_in
    stand_in.close()


def test_the_reader_sends_the_current_token_and_never_raises(api: StandInApi, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    api.token = "first"
    reader = PodStatusReader(KubeConfig(api.url, "ml", "train-resnet-x7k2p", token_file=str(token)), "trainer")
    assert reader.read() is None and reader.error == "" and reader.seen_container
    token.write_text("rotated\n")  # the kubelet rotates projected tokens: read at every request
    api.token = "rotated"
    api.pod = pod("oomkilled")
    end = reader.read()
    assert end is not None and end.reason == "OOMKilled"
    assert api.authorizations == ["Bearer first", "Bearer rotated"]
    api.status = 403  # no RBAC
    assert reader.read() is None and "'get' on pods in ml" in reader.error
    api.status = 200
    wrong = PodStatusReader(KubeConfig(api.url, "ml", "other-pod"), "trainer")
    api.token = ""
    assert wrong.read() is None and "POD_NAME" in wrong.error
    named_wrong = PodStatusReader(KubeConfig(api.url, "ml", "train-resnet-x7k2p"), "pytorch")
    assert named_wrong.read() is None and named_wrong.misconfigured
    assert "no container named 'pytorch' (it has trainer, trainguard-agent)" in named_wrong.error
    api.pod = {"kind": "Status", "status": "Failure"}  # a proxy's or an old server's answer: not a Pod
    assert reader.read() is None and "not a Pod object" in reader.error and not reader.misconfigured
    api.pod = ["not", "an", "object"]  # type: ignore[assignment]
    assert reader.read() is None and "not a Pod object" in reader.error
    api.close()
    assert reader.read() is None and "cannot read the pod" in reader.error


def test_an_end_missed_between_two_reads_comes_from_the_last_state(api: StandInApi) -> None:
    """restartPolicy OnFailure: the kubelet restarts the trainer in place, faster than the next read."""
    reader = PodStatusReader(KubeConfig(api.url, "ml", "train-resnet-x7k2p"), "trainer")
    assert reader.read() is None and reader.first_restarts == 0
    api.pod = pod("restarted")  # running again, restartCount 1, the crash in lastState
    end = reader.read()
    assert end is not None and (end.exit_code, end.reason, end.restart_count) == (1, "Error", 1)
    assert "illegal memory access" in end.message
    late = PodStatusReader(KubeConfig(api.url, "ml", "train-resnet-x7k2p"), "trainer")
    assert late.read() is None  # a restart before this reader's first read is not this watch's end
    # backing off before the restart (CrashLoopBackOff): not restarted yet, the attempt it saw is lastState
    api.pod = pod("running")
    watcher = PodStatusReader(KubeConfig(api.url, "ml", "train-resnet-x7k2p"), "trainer")
    assert watcher.read() is None
    trainer = api.pod["status"]["containerStatuses"][0]
    ended = dict(pod("restarted")["status"]["containerStatuses"][0]["lastState"]["terminated"],
                 containerID=trainer["containerID"])
    trainer.update(ready=False, started=False, lastState={"terminated": ended},
                   state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}})
    validate_core(api.pod, "1.37")
    end = watcher.read()
    assert end is not None and (end.exit_code, end.restart_count) == (1, 0)


def test_sidecar_reports_the_oom_kill_kubernetes_saw(server: ServeProcess, api: StandInApi, tmp_path: Path) -> None:
    """A real job SIGKILLed (what the OOM-killer does) while the sidecar follows its log: the exit code and
    the reason come from the pod's status, and the incident says OOMKilled."""
    logs = tmp_path / "train"
    logs.mkdir()
    run_id = "sidecar-oomkilled"
    cmd = agent_command(server.http_url, tmp_path / "spool", "--log-file", str(logs / "*.log"),
                        "--pod-container", "trainer", "--kube-api", api.url, "--pod-poll-s", "0.2")
    env = agent_env(server.tokens["ingest"], run_id, POD_NAME="train-resnet-x7k2p", POD_NAMESPACE="ml")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    trainer: Optional[subprocess.Popen[bytes]] = None
    try:
        trainer = subprocess.Popen(job("hang", "--log", str(logs / "rank0.log")))
        assert poll(lambda: "step 3" in (logs / "rank0.log").read_text() if (logs / "rank0.log").exists()
                    else False, timeout=60)
        os.kill(trainer.pid, signal.SIGKILL)
        assert trainer.wait(10) == -signal.SIGKILL
        time.sleep(0.5)  # the agent keeps following the pod: still running as far as the kubelet knows
        assert agent.poll() is None
        api.pod = pod("oomkilled")  # the kubelet records the container's end
        _out, err = agent.communicate(timeout=60)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, err.decode()[-2000:]
    (incident,) = incidents(server, run_id, category="process", subtype="killed")
    assert "OOMKilled" in incident["title"] or "OOMKilled" in incident["summary"], incident
    assert server.get(f"/api/v1/runs/{run_id}")["exit_codes"] == {"0": 137}
    notes = [e for e in server.pages(f"/api/v1/runs/{run_id}/events", kinds="log")
             if "Kubernetes: container 'trainer' terminated" in json.dumps(e)]
    assert len(notes) == 1 and "reason OOMKilled, exit code 137, signal 9" in json.dumps(notes[0])


def test_sidecar_without_rbac_says_why_the_exit_code_is_unknown(server: ServeProcess, api: StandInApi,
                                                               tmp_path: Path) -> None:
    api.status = 403
    logs = tmp_path / "train"
    logs.mkdir()
    (logs / "rank0.log").write_text("step 1 loss 0.5\n")
    run_id = "sidecar-no-rbac"
    cmd = agent_command(server.http_url, tmp_path / "spool", "--log-file", str(logs / "*.log"),
                        "--pod-container", "trainer", "--kube-api", api.url, "--pod-poll-s", "0.2")
    env = agent_env(server.tokens["ingest"], run_id, POD_NAME="train-resnet-x7k2p", POD_NAMESPACE="ml")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # the agent asks the API from its watch loop, which it enters with its SIGTERM handler in place
    assert poll(lambda: len(api.authorizations) >= 2, timeout=60)
    agent.send_signal(signal.SIGTERM)  # the kubelet stops the sidecar
    _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err.decode()[-2000:]
    assert "HTTP 403" in err.decode()

    def warning() -> Optional[str]:
        for e in server.pages(f"/api/v1/runs/{run_id}/events", kinds="log"):
            text = json.dumps(e)
            if "exit code is unknown" in text:
                return text
        return None

    text = poll(warning, timeout=30)
    assert text is not None and "TRAINGUARD_AGENT_POD_CONTAINER" in text and "HTTP 403" in text


def test_sidecar_terminated_by_the_kubelet_still_reports_the_end(server: ServeProcess, api: StandInApi,
                                                                 tmp_path: Path) -> None:
    """The native-sidecar order of events: the trainer writes its exit file and exits, the kubelet sends the
    sidecar SIGTERM a moment later -- while it is still asking the pod for the reason. The agent finishes:
    the EXIT (with the pod's code and reason) is delivered, and it exits 0, not by the signal."""
    logs = tmp_path / "train"
    logs.mkdir()
    run_id = "sidecar-sigterm"
    cmd = agent_command(server.http_url, tmp_path / "spool", "--log-file", str(logs / "*.log"),
                        "--exit-file", str(logs / "exit-code"), "--pod-container", "trainer",
                        "--kube-api", api.url, "--pod-poll-s", "0.2")
    env = agent_env(server.tokens["ingest"], run_id, POD_NAME="train-resnet-x7k2p", POD_NAMESPACE="ml")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert poll(lambda: len(api.authorizations) >= 1, timeout=60)  # the agent is in its loop
        trainer = subprocess.run(job("crash", "--log", str(logs / "rank0.log"), "--exit-file",
                                     str(logs / "exit-code")), capture_output=True, timeout=60)
        assert trainer.returncode == 1
        asked = len(api.authorizations)
        assert poll(lambda: len(api.authorizations) >= asked + 3, timeout=30)  # waiting on the pod now
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        ended = pod("oomkilled")
        ended["status"]["containerStatuses"][0]["state"]["terminated"].update(exitCode=1, reason="Error")
        api.pod = ended
        _out, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, err.decode()[-2000:]
    incidents(server, run_id, category="process", subtype="exception", with_rule="exit.code")
    assert server.get(f"/api/v1/runs/{run_id}")["exit_codes"] == {"0": 1}
