"""Live updates: ``GET /api/v1/runs/{run}/stream`` (server-sent events) against a real ``trainguard serve``,
and the dashboard's run page moving without a reload while the run reports -- new steps, then a NaN loss
that opens an incident."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from selenium.webdriver.common.by import By

from tests.services.e2e.serve_process import ServeProcess
from tests.support.browser import shows
from tests.support.waiting import poll
from trainguard.core import events as ev
from trainguard.transport.http import HttpTransport


@pytest.fixture
def server(tmp_path: Any) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path / "data").start()
    yield proc
    proc.stop()


class Run:
    """A run reporting through the gateway as the SDK does: START, then metrics step by step."""

    def __init__(self, server: ServeProcess) -> None:
        self.run_id = f"live-{uuid.uuid4().hex[:6]}"
        self.ident = {"project": "", "run_id": self.run_id, "trace_id": self.run_id, "host": "node-0",
                      "pid": 4242, "rank": 0, "local_rank": 0, "world_size": 1, "group_rank": 0,
                      "run_name": "live", "sdk": "trainguard-python/test"}
        self.sender = HttpTransport(server.http_url, server.tokens["ingest"], "trainguard-test")
        self.send([ev.envelope(self.ident, "lifecycle", {"phase": "START", "argv": [], "tags": {}, "config": {}},
                               step=0, time_unix_nano=time.time_ns())])

    def send(self, events: List[Dict[str, Any]]) -> None:
        result = self.sender.send(events, 10.0)
        assert not result.rejected, result.rejected

    def steps(self, first: int, count: int, loss: float = 2.0) -> None:
        self.send([ev.envelope(self.ident, "metrics", ev.metrics_payload(
            {"loss": loss - 0.01 * s, "grad/global_norm": 1.0}), step=s, time_unix_nano=time.time_ns())
            for s in range(first, first + count)])

    def nan(self, step: int) -> None:
        self.send([ev.envelope(self.ident, "metrics", ev.metrics_payload(
            {"loss": float("nan")}, alert="non_finite:loss", recent=[]), step=step,
            time_unix_nano=time.time_ns(), severity="ERROR")])


def read_events(conn: http.client.HTTPResponse, until: Any, timeout: float = 20.0) -> List[Tuple[str, Any]]:
    """SSE messages (event, data) until ``until(messages)`` is true."""
    got: List[Tuple[str, Any]] = []
    deadline = time.monotonic() + timeout
    event, data = "message", ""
    while time.monotonic() < deadline and not until(got):
        line = conn.fp.readline().decode()
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: "):
            data += line[6:].strip()
        elif line == "\n" and data:
            got.append((event, json.loads(data)))
            event, data = "message", ""
    return got


def open_stream(server: ServeProcess, run_id: str, token: str) -> Tuple[http.client.HTTPConnection,
                                                                       http.client.HTTPResponse]:
    host, port = server.http_url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", f"/api/v1/runs/{run_id}/stream?interval=0.2", headers={"Authorization": f"Bearer {token}"})
    return conn, conn.getresponse()


def test_stream_sends_the_run_then_what_changes(server: ServeProcess) -> None:
    run = Run(server)
    run.steps(0, 5)
    assert poll(lambda: (server.get_or_none(f"/api/v1/runs/{run.run_id}") or {}).get("last_step") == 4)
    conn, resp = open_stream(server, run.run_id, server.tokens["read"])
    try:
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
        first = read_events(resp, lambda m: len(m) >= 2)
        assert [e for e, _ in first] == ["run", "incidents"]
        assert first[0][1]["last_step"] == 4 and first[1][1] == []
        run.steps(5, 5)
        later = read_events(resp, lambda m: any(e == "run" and d["last_step"] == 9 for e, d in m))
        assert any(e == "run" and d["last_step"] == 9 for e, d in later)
        run.nan(10)
        news = read_events(resp, lambda m: any(e == "incidents" and d for e, d in m))
        (incidents,) = [d for e, d in news if e == "incidents"][-1:]
        assert [(i["category"], i["subtype"]) for i in incidents] == [("loss", "non_finite")]
    finally:
        conn.close()


def test_stream_refuses_unknown_runs_and_missing_tokens(server: ServeProcess) -> None:
    run = Run(server)
    run.steps(0, 2)
    assert poll(lambda: server.get_or_none(f"/api/v1/runs/{run.run_id}"))
    conn, resp = open_stream(server, "no-such-run", server.tokens["read"])
    assert resp.status == 404 and "no-such-run" in json.loads(resp.read())["detail"]
    conn.close()
    conn, resp = open_stream(server, run.run_id, server.tokens["ingest"])
    assert resp.status == 403
    conn.close()


def test_run_page_moves_without_reload(server: ServeProcess, browser: Any) -> None:
    run = Run(server)
    run.steps(0, 20)
    assert poll(lambda: (server.get_or_none(f"/api/v1/runs/{run.run_id}") or {}).get("last_step") == 19)
    browser.get(server.http_url + "/ui/")
    browser.execute_script(f"localStorage.setItem('trainguard.readToken', {json.dumps(server.tokens['read'])})")
    browser.get(server.http_url + f"/ui/#/runs/{run.run_id}")
    shows(browser, "last-step", "19")
    assert browser.find_element(By.ID, "live").text == "live"
    assert not browser.find_elements(By.CSS_SELECTOR, "#incidents tbody tr")
    browser.execute_script("window.__same_page = true;")  # gone if the page reloads
    run.steps(20, 10)
    shows(browser, "last-step", "29")
    run.nan(30)
    shows(browser, "incidents", "loss/non_finite")  # the new incident's row
    assert browser.execute_script("return window.__same_page === true;")
