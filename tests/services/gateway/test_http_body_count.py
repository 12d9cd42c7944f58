"""A project's HTTP ingest bodies being read at once are bounded (``project_max_http_bodies``, security.md
H43): one more is answered 429 + ``Retry-After`` + ``Connection: close`` before its body is read, while
another project's ingest is served; a body read (whole, or given up by its client) gives its turn back.
Before (stop 44), a body trickled one byte just inside ``http_body_timeout_s`` was held for as long as it
trickled and nothing bounded how many one project held: its slow uploads took the server's descriptors
(1,100 of them against an open-files limit of 1,024 and another project's ingest failed). Against
``trainguard serve`` (EmbeddedServer on 127.0.0.1), raw sockets; no wall-clock asserts."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Iterator
from urllib.parse import urlparse

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server, read_answer
from trainguard_server.gateway.body_count import DEFAULT_LIMIT, ProjectBodies

LIMIT = 2


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("bodies"), project_max_http_bodies=LIMIT) as server:
        yield server


def _bodies(live: LiveServer) -> ProjectBodies:
    assert live.server.gateway is not None
    return live.server.gateway.http_bodies


def _wait(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _head(token: str, length: int) -> bytes:
    return (f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _slow(live: LiveServer, stack: ExitStack, token: str, body: bytes) -> socket.socket:
    """A request whose head and first byte of body are sent, then nothing (a trickle between bytes)."""
    url = urlparse(live.url)
    conn = stack.enter_context(socket.create_connection((url.hostname, url.port), timeout=20))
    conn.sendall(_head(token, len(body)) + body[:1])
    return conn


def _post(live: LiveServer, token: str, run: str) -> tuple[bytes, bytes]:
    body = json.dumps({"events": [event(run)]}).encode()
    url = urlparse(live.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as conn:
        conn.sendall(_head(token, len(body)) + body)
        head, _, answer = read_answer(conn).partition(b"\r\n\r\n")
    return head, answer


def test_past_the_bound_a_projects_body_is_429_before_it_is_read_and_another_project_is_served(
        live: LiveServer) -> None:
    project = "default"
    other = live.server.stores.projects.create_token("bodies-other", "ingest")
    body = json.dumps({"events": [event("slow-bodies")]}).encode()
    bodies = _bodies(live)
    with ExitStack() as stack:
        slow = [_slow(live, stack, live.ingest_token, body) for _ in range(LIMIT)]
        _wait(lambda: bodies.reading(project) == LIMIT)
        head, answer = _post(live, live.ingest_token, "one-too-many")  # was: read and 200
        assert head.startswith(b"HTTP/1.1 429"), head
        lowered = head.lower()
        assert b"retry-after:" in lowered and b"connection: close" in lowered, head
        detail = json.loads(answer)["detail"]
        assert "project_max_http_bodies=2" in detail and "TRAINGUARD_PROJECT_MAX_HTTP_BODIES" in detail, detail
        assert "nothing of this request was queued" in detail, detail
        assert bodies.reading(project) == LIMIT  # the refused one took no turn
        head, answer = _post(live, other, "other-project")  # another tenant is served meanwhile
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(answer)["accepted"] == 1
        # a slow body that ends gives its turn back: one completes, one is given up by its client
        slow[0].sendall(body[1:])
        head, _, answer = read_answer(slow[0]).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        slow[1].close()
        _wait(lambda: bodies.reading(project) == 0)
    head, _ = _post(live, live.ingest_token, "after")
    assert head.startswith(b"HTTP/1.1 200"), head


def test_the_setting_reaches_the_gateway(live: LiveServer) -> None:
    assert _bodies(live).limit == LIMIT and DEFAULT_LIMIT == 256


def test_bodies_read_one_after_another_never_meet_the_bound(live: LiveServer) -> None:
    for k in range(3 * LIMIT):
        head, _ = _post(live, live.ingest_token, f"sequential-{k}")
        assert head.startswith(b"HTTP/1.1 200"), head
    assert _bodies(live).reading("default") == 0


def test_a_request_refused_before_its_body_takes_no_turn(live: LiveServer) -> None:
    """401 (bad token) and 415 (media type) come before the count: nothing to give back."""
    url = urlparse(live.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as conn:
        conn.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 5\r\n\r\n")
        assert read_answer(conn).startswith(b"HTTP/1.1 401")
    assert _bodies(live).reading("default") == 0


def test_unit_counts_per_project() -> None:
    bodies = ProjectBodies(2)
    assert bodies.enter("a") is None and bodies.enter("a") is None
    why = bodies.enter("a")
    assert why is not None and "'a' has 2 HTTP ingest bodies" in why
    assert bodies.enter("b") is None  # another project has its own turns
    bodies.leave("a")
    assert bodies.enter("a") is None
    for _ in range(3):
        bodies.leave("a")
    assert bodies.reading("a") == 0 and bodies.reading("b") == 1
    unbounded = ProjectBodies(0)
    assert all(unbounded.enter("a") is None for _ in range(10 * DEFAULT_LIMIT))
