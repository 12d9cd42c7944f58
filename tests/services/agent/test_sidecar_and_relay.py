"""Sidecar mode against the log file of a real training run, and the relay through a gateway outage and
a restart of the agent itself, against a real ``trainguard serve``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.services.agent.conftest import agent_command, agent_env, drained, incidents, job
from tests.services.e2e.serve_process import ServeProcess
from tests.support.net import free_port
from tests.support.waiting import poll
from trainguard.core.tracebacks import parse_traceback_text


def _sidecar(server_url: str, token: str, run_id: str, spool: Path, logs: Path) -> subprocess.Popen[bytes]:
    cmd = agent_command(server_url, spool, "--log-file", str(logs / "*.log"), "--exit-file",
                        str(logs / "exit-code"))
    return subprocess.Popen(cmd, env=agent_env(token, run_id), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sidecar_follows_the_log_file_of_a_real_run(server: ServeProcess, tmp_path: Path) -> None:
    logs = tmp_path / "train"
    logs.mkdir()
    token = server.tokens["ingest"]
    agent = _sidecar(server.http_url, token, "sidecar-crash", tmp_path / "spool", logs)
    time.sleep(1.0)  # the agent is up before the job, as a native sidecar starts first
    trainer = subprocess.run(job("crash", "--log", str(logs / "rank0.log"), "--exit-file", str(logs / "exit-code")),
                             capture_output=True, timeout=60)
    assert trainer.returncode == 1 and trainer.stdout == b""
    _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err.decode()
    text = (logs / "rank0.log").read_text()
    assert "step 7 loss" in text and "IndexError" in text
    expected = parse_traceback_text(text[text.index("Traceback"):])[-1].fingerprint().to_dict()["fingerprint"]
    (incident,) = incidents(server, "sidecar-crash", category="process", subtype="exception",
                            with_rule="exit.code")
    assert incident["fingerprint"] == expected
    assert server.get("/api/v1/runs/sidecar-crash")["exit_codes"] == {"0": 1}

    # a restarted sidecar (new spool, same file) sends the same event ids: nothing is counted twice
    again = _sidecar(server.http_url, token, "sidecar-crash", tmp_path / "spool2", logs)
    again.communicate(timeout=60)
    assert again.returncode == 0
    drained(server)  # what the second sidecar sent is processed: "nothing added" is now a real check
    exceptions = server.pages("/api/v1/runs/sidecar-crash/events", kinds="exception")
    assert len(exceptions) == 1
    (incident,) = server.get("/api/v1/runs/sidecar-crash/incidents")["items"]
    assert incident["count"] == 1


def test_relay_survives_gateway_down_and_its_own_restart(tmp_path: Path) -> None:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    spool = tmp_path / "spool"
    serve = ServeProcess(tmp_path / "data")
    serve.http_port = port
    # the server's tokens exist only once it ran: start it once to create them, then take it down
    serve.start()
    token = serve.tokens["ingest"]
    serve.stop()

    # 1. the gateway is down for the whole job: the SDK sends to the agent, the agent spools
    steps = 40
    cmd = agent_command(upstream, spool, "--drain-timeout-s", "1", "--", *job("healthy", "--sdk", "--steps",
                                                                              str(steps)))
    env = agent_env(token, "relay-outage", TRAINGUARD_FLUSH_INTERVAL="0.1")
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.count(b"\n") == steps
    assert "not delivered yet" in done.stderr.decode(), done.stderr.decode()[-2000:]
    assert any(spool.iterdir())

    # 2. the gateway comes back; a new agent process on the same spool delivers everything
    serve.start()
    try:
        (spool.parent / "done").mkdir()
        (spool.parent / "done" / "exit-code").write_text("0\n")
        restarted = subprocess.run(agent_command(upstream, spool, "--exit-file", str(spool.parent / "done" /
                                                                                    "exit-code")),
                                   env=agent_env(token, "relay-outage"), capture_output=True, timeout=120)
        assert restarted.returncode == 0, restarted.stderr.decode()[-2000:]

        def finished() -> object:
            run = serve.get_or_none("/api/v1/runs/relay-outage")
            return run if run and run["status"] == "finished" and run["last_step"] == steps - 1 else None

        run = poll(finished, timeout=30)
        assert run is not None, serve.get_or_none("/api/v1/runs/relay-outage")
        assert run["exit_codes"] == {"0": 0}
        exits = [e["payload"] for e in serve.pages("/api/v1/runs/relay-outage/events", kinds="lifecycle")
                 if e["payload"]["lifecycle"].get("phase") == "EXIT"]
        # the SDK's own EXIT: everything it produced was sent (to the agent), nothing dropped
        (sdk_exit,) = [e for e in exits if not e["sdk"].startswith("trainguard-agent")]
        stats = sdk_exit["lifecycle"]["sdk_stats"]
        assert not any(v for k, v in stats.items() if k.startswith("dropped")), stats
        # every step's loss arrived
        series = serve.get("/api/v1/runs/relay-outage/metrics", names="loss")
        buckets = [b for by_rank in series["series"].values() for bs in by_rank.values() for b in bs]
        assert sum(b["count"] for b in buckets) == steps, buckets[:3]
    finally:
        serve.stop()


def test_upstreams_deliver_queued_bytes_over_grpc_and_http(server: ServeProcess) -> None:
    """What the forwarder sends: a serialized IngestRequest as queued, to a real gateway both ways."""
    from trainguard.transport.base import TransportError
    from trainguard.v1 import events_pb2
    from trainguard_server.agent.upstream import open_upstream
    from trainguard_server.gateway.ingest import join_events

    def envelope(i: int, transport: str) -> bytes:
        env = events_pb2.Envelope(event_id=f"{transport}-{i:08d}", run_id=f"upstream-{transport}",
                                  time_unix_nano=time.time_ns(), step=i)
        env.log.message = f"WARNING: line {i}"
        return env.SerializeToString()

    for transport, url in (("grpc", f"grpc://{server.grpc_target}"), ("http", server.http_url)):
        upstream = open_upstream(url, server.tokens["ingest"])
        try:
            result = upstream.send(join_events([envelope(i, transport) for i in range(3)]), 10.0)
            assert (result.accepted, result.duplicates, result.rejected) == (3, 0, [])
            again = upstream.send(join_events([envelope(0, transport)]), 10.0)
            assert again.accepted + again.duplicates == 1
            try:
                open_upstream(url, "wrong-token").send(join_events([envelope(9, transport)]), 10.0)
            except TransportError as exc:
                assert not exc.retryable and exc.status in ("401", "UNAUTHENTICATED")
            else:
                raise AssertionError("a wrong token was accepted")
        finally:
            upstream.close()
    assert poll(lambda: len(server.run_events("upstream-grpc", kinds="log")) == 3
                if server.get_or_none("/api/v1/runs/upstream-grpc") else False, timeout=20)
