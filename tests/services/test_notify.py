"""Webhook notifications (notify.py) against a real HTTP receiver on 127.0.0.1: the first sighting of a new
incident at or above the severity floor is posted once as Slack-compatible JSON; consequences, lesser
incidents and repeats are not; a flood is rate-limited into one summary; a dead receiver is retried and
counted, never blocking the caller; a restart sends nothing twice. And end to end: ``trainguard serve``
with ``TRAINGUARD_WEBHOOK_URL`` posts the incident of a real crashing training."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.services.e2e.test_serve import _train
from tests.support.net import free_port
from tests.support.waiting import poll
from trainguard_engine.pipeline import PipelineOutput
from trainguard_engine.records import Incident
from trainguard_server.notify import WebhookNotifier
from trainguard_server.storage.memory import MemoryIncidentStore


class Receiver:
    """An HTTP server that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: List[Any] = []
        self.delay_s = 0.0  # answer this much later (a slow webhook endpoint)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(outer.delay_s)
                outer.bodies.append(json.loads(data))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def incident(incident_id: str, severity: str = "critical", explained_by: str = "") -> Incident:
    return Incident(incident_id=incident_id, project="p", run_id="run-7", category="memory", subtype="oom",
                    severity=severity, status="open", title=f"CUDA OOM {incident_id}", first_step=120,
                    lead_rank=3, explained_by=explained_by)


def test_new_incidents_once_and_only_what_matters(receiver: Receiver) -> None:
    notifier = WebhookNotifier(receiver.url, dashboard_url="http://tg.example:4318")
    receiver.delay_s = 3.0  # a slow endpoint: posting inline would hold the processor for 3 s
    started = time.monotonic()
    notifier(PipelineOutput(incidents=[incident("a"), incident("b", severity="warning"),
                                       incident("c", explained_by="a")]))
    assert time.monotonic() - started < 2.0  # the processor only queues
    notifier(PipelineOutput(incidents=[incident("a")]))  # the same incident, updated: not news
    assert poll(lambda: len(receiver.bodies) == 1, 10)
    time.sleep(0.3)
    notifier.close()
    (body,) = receiver.bodies
    assert "[CRITICAL] memory/oom" in body["text"] and "CUDA OOM a" in body["text"]
    assert "run `run-7`" in body["text"] and "rank 3, step 120" in body["text"]
    assert "http://tg.example:4318/ui/#/incidents/a" in body["text"]
    assert (notifier.stats.sent, notifier.stats.deduplicated) == (1, 1)


def test_a_flood_is_rate_limited_into_one_summary(receiver: Receiver) -> None:
    now = [1000.0]
    notifier = WebhookNotifier(receiver.url, max_per_minute=3, clock=lambda: now[0])
    notifier(PipelineOutput(incidents=[incident(f"i{k}") for k in range(8)]))
    assert poll(lambda: len(receiver.bodies) == 3, 10)
    time.sleep(0.5)
    assert len(receiver.bodies) == 3 and notifier.stats.suppressed == 5
    now[0] += 61.0  # a minute later the summary goes out
    assert poll(lambda: len(receiver.bodies) == 4, 10)
    notifier.close()
    assert "5 more TrainGuard incident(s)" in receiver.bodies[-1]["text"]


def test_a_dead_receiver_is_retried_and_counted() -> None:
    notifier = WebhookNotifier(f"http://127.0.0.1:{free_port()}/hook", retries=2, timeout_s=1.0)
    notifier(PipelineOutput(incidents=[incident("a")]))
    assert poll(lambda: notifier.stats.failed == 1, 20)
    notifier.close()
    assert notifier.stats.sent == 0


def test_a_restart_sends_nothing_twice(receiver: Receiver) -> None:
    store = MemoryIncidentStore()
    first = WebhookNotifier(receiver.url, state=store)
    first(PipelineOutput(incidents=[incident("a")]))
    assert poll(lambda: len(receiver.bodies) == 1, 10)
    first.close()
    again = WebhookNotifier(receiver.url, state=store)  # restored incidents are re-emitted after a restart
    again(PipelineOutput(incidents=[incident("a"), incident("b")]))
    assert poll(lambda: len(receiver.bodies) == 2, 10)
    time.sleep(0.3)
    again.close()
    assert "CUDA OOM b" in receiver.bodies[1]["text"] and len(receiver.bodies) == 2


def test_serve_posts_a_real_crash(receiver: Receiver, tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data", env={"TRAINGUARD_WEBHOOK_URL": receiver.url,
                                                  "TRAINGUARD_WEBHOOK_MIN_SEVERITY": "error"}).start()
    try:
        proc = _train("crashing", server.http_url, server.tokens["ingest"], "notify-crash", steps=30)
        proc.communicate(timeout=120)
        assert poll(lambda: any("notify-crash" in b["text"] for b in receiver.bodies), 30), receiver.bodies
        (body,) = [b for b in receiver.bodies if "notify-crash" in b["text"]]
        assert "process/exception" in body["text"] and "RuntimeError" in body["text"]
    finally:
        server.stop()
