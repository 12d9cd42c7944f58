"""A query-API answer its client does not read keeps its project's request slot until it is (nearly) written,
so unread answers are bounded by the project's slots, not by how many connections a client opens. Before
(stop 41, black-box against ``trainguard serve``): the slot was given back as soon as the app returned, while
uvicorn held the whole answer in the connection's write buffer (``close()`` keeps it until the peer reads):
project B's read token, 60 connections asking for a 2.4 MB page of its events and never reading, took the
server from 155 to 517 MB, kept after they closed. Now the answer goes to uvicorn in pieces (uvicorn waits
for its write buffer to drain between them): B's ninth unread request waits for a slot (then 429) while
project A's reads are answered. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1), raw sockets."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from typing import Iterator, List
from urllib.parse import urlparse

import httpx
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server

SLOTS = 4
WRITE_TIMEOUT_S = 3.0  # api_answer_write_timeout_s here (default 30): well past the first test's 1 s look


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("unread"), api_max_requests_per_project=SLOTS,
                     api_request_wait_s=0.5, api_answer_write_timeout_s=WRITE_TIMEOUT_S) as server:
        yield server


def _fat_run(live: LiveServer) -> str:
    """A run of the bootstrap project with ~9 MB of log events (one page: up to api_max_page_bytes)."""
    for k in range(8):
        events = []
        for i in range(20):
            e = event("fat", k * 20 + i, log={"logger": "x", "level": "INFO", "message": "y" * 60_000,
                                              "source": "logging"})
            del e["metrics"]
            events.append(e)
        assert live.post_events(events).json()["accepted"] == 20
    live.wait_for(lambda: len(live.get("/api/v1/runs/fat/events", limit=500).content) > 6_000_000, timeout=60)
    return "fat"


def _unread(live: LiveServer, stack: ExitStack, path: str) -> socket.socket:
    url = urlparse(live.url)
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    conn.connect((url.hostname, url.port))
    stack.enter_context(conn)
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.read_token}\r\n\r\n".encode())
    return conn


def test_unread_answers_hold_their_projects_slots_only(live: LiveServer) -> None:
    run = _fat_run(live)
    other = live.server.stores.projects.create_token("unread-other", "read")
    with ExitStack() as stack:
        conns: List[socket.socket] = [_unread(live, stack, f"/api/v1/runs/{run}/events?limit=500")
                                      for _ in range(SLOTS)]
        time.sleep(1.0)  # the answers are written as far as the client's window lets them
        r = live.get("/api/v1/runs")
        assert r.status_code == 429, r.text  # was 200: the slots were free, the answers buffered unread
        assert "TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT" in r.json()["detail"]
        with httpx.Client(base_url=live.url, timeout=10) as client:  # another project is not affected
            assert client.get("/api/v1/runs", headers={"Authorization": f"Bearer {other}"}).status_code == 200
        for conn in conns:
            conn.close()
    deadline = time.monotonic() + 10
    while live.get("/api/v1/runs").status_code != 200:  # closed connections give their slots back
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_read_answer_is_whole(live: LiveServer) -> None:
    r = live.get("/api/v1/runs/fat/events", limit=500)
    assert r.status_code == 200
    body = r.json()
    assert body["items"] and int(r.headers["content-length"]) == len(r.content)


def test_answers_never_read_give_their_slots_back_after_the_write_timeout(live: LiveServer) -> None:
    """Clients that keep their connections open and never read hold their project's slots for
    api_answer_write_timeout_s a piece, not for as long as they stay connected (stop 41 review: 8 such
    connections kept project B's reads at 429 at 8, 35 and 95 s)."""
    seen = live.get("/api/v1/runs/fat/events", limit=1)
    run = "fat" if seen.status_code == 200 and seen.json()["items"] else _fat_run(live)
    with ExitStack() as stack:
        conns = [_unread(live, stack, f"/api/v1/runs/{run}/events?limit=500") for _ in range(SLOTS)]
        time.sleep(1.0)
        assert live.get("/api/v1/runs").status_code == 429  # held while the pieces wait
        deadline = time.monotonic() + WRITE_TIMEOUT_S + 15
        while live.get("/api/v1/runs").status_code != 200:  # the connections are still open here
            assert time.monotonic() < deadline, "slots still held past api_answer_write_timeout_s"
            time.sleep(0.2)
        short = 0
        for conn in conns:  # answers ended early: what arrives is shorter than the Content-Length
            conn.settimeout(10)
            got = b""
            while chunk := conn.recv(1 << 20):
                got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            short += len(body) < length
        assert short >= 1  # (one may have been written whole while the others gave their slots back)
