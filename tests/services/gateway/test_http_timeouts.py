"""Issue 18, finding 12: HTTP connections never timed out (a half-sent request head was still open after 130 s).
The uvicorn servers now bound the request head, a stalled body and keep-alive (settings
``http_header_timeout_s``, ``http_body_timeout_s``, ``http_keep_alive_s``). Raw sockets against real servers on
127.0.0.1: the HttpThread that ``trainguard serve`` and the agent run, and ``trainguard serve`` itself."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Iterator, Tuple

import pytest
from fastapi import FastAPI

from tests.services.gateway.embedded_server import live_server
from tests.services.gateway.helpers import Tokens, metric_event, new_gateway
from trainguard_server.gateway.http import ingest_router
from trainguard_server.http_thread import HttpThread
from trainguard_server.http_timeouts import HttpTimeouts

TIMEOUTS = HttpTimeouts(header_s=0.6, body_idle_s=0.6, keep_alive_s=0.6)
SLOW_S = 1.5  # longer than every timeout above
WAIT_S = 8.0  # what a test waits for the server to close before calling it "never"


@pytest.fixture(scope="module")
def server() -> Iterator[Tuple[int, Tokens]]:
    gateway, _, tokens = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))

    @app.get("/slow")
    async def slow() -> dict:  # type: ignore[type-arg]
        await asyncio.sleep(SLOW_S)
        return {"slow": True}

    http = HttpThread(app, "127.0.0.1", 0, "test-http", timeouts=TIMEOUTS)
    http.start()
    yield http.port, tokens
    http.stop(5)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def _read_until_closed(sock: socket.socket) -> Tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took (raises socket.timeout)."""
    started, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response on a kept-alive connection: the head, then content-length bytes of body
    (they may come in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _ingest_head(tokens: Tokens, length: int) -> bytes:
    return (f"POST /v1/ingest HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {tokens.ingest}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_half_sent_request_head_gets_408_and_is_closed(server: Tuple[int, Tokens]) -> None:
    port, _ = server
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: t\r\nContent-")
        data, elapsed = _read_until_closed(sock)  # was: socket.timeout, the connection stayed open
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert elapsed < WAIT_S / 2


def test_a_head_trickled_byte_by_byte_is_cut_at_the_header_deadline(server: Tuple[int, Tokens]) -> None:
    port, _ = server
    head = b"GET /slow HTTP/1.1\r\nHost: t\r\nX-Padding: " + b"a" * 200
    with _connect(port) as sock:
        started = time.monotonic()
        closed = False
        for byte in head:  # one byte every 50 ms: never idle, never done
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - started > WAIT_S:
                break
        if not closed:
            sock.settimeout(WAIT_S)
            data, _ = _read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < WAIT_S  # the deadline counts from the first byte, not the last


def test_a_connection_that_sends_nothing_is_closed(server: Tuple[int, Tokens]) -> None:
    port, _ = server
    with _connect(port) as sock:
        data, elapsed = _read_until_closed(sock)
    assert data == b""  # nothing asked, nothing answered: just closed
    assert elapsed < WAIT_S / 2


def test_a_stalled_body_gets_408_and_is_closed(server: Tuple[int, Tokens]) -> None:
    port, tokens = server
    with _connect(port) as sock:
        sock.sendall(_ingest_head(tokens, 1000) + b'{"events": [')
        data, elapsed = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert elapsed < WAIT_S / 2


def test_slow_but_steady_uploads_and_slow_answers_are_not_cut(server: Tuple[int, Tokens]) -> None:
    port, tokens = server
    body = json.dumps({"events": [metric_event(i) for i in range(3)]}).encode()
    with _connect(port) as sock:
        sock.sendall(_ingest_head(tokens, len(body)))
        started = time.monotonic()
        for k in range(0, len(body), len(body) // 6 + 1):  # body idle < body_idle_s, total > body_idle_s
            sock.sendall(body[k:k + len(body) // 6 + 1])
            time.sleep(0.3)
        assert time.monotonic() - started > TIMEOUTS.body_idle_s
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 200 OK\r\n"), response
        assert b'"accepted": 3' in response
        # the same connection: a handler slower than every timeout still answers
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b'{"slow":true}')
        # then idle: the keep-alive timeout closes it
        data, elapsed = _read_until_closed(sock)
        assert data == b"" and elapsed < WAIT_S / 2


def test_trainguard_serve_applies_the_settings(tmp_path: Path) -> None:
    with live_server(tmp_path / "data", http_header_timeout_s=0.5) as live:
        port = live.server.http_port
        with _connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            data, elapsed = _read_until_closed(sock)  # was: still open after WAIT_S
        assert data.startswith(b"HTTP/1.1 408") and elapsed < WAIT_S / 2
        assert live.client.get("/healthz").json() == {"status": "ok"}


def test_a_request_head_past_h11s_limit_is_answered_400_while_the_client_still_sends(
        server: Tuple[int, Tokens]) -> None:
    """A 200 KB request line, sent in pieces: h11 refuses the head once 16 KiB of it are buffered, and uvicorn
    closed the connection at once with the client still sending -- a reset, the 400 lost (stop 43,
    bench/hostile_probe.py api/hostile-path-ids status 0). Now the 400 and a FIN go out and the rest is read
    and dropped until the client closes (or header_s)."""
    port, _tokens = server
    sock = _connect(port)
    head = b"GET /" + b"x" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        for i in range(0, len(head), 8192):
            sock.sendall(head[i:i + 8192])
            time.sleep(0.002)
        sock.shutdown(socket.SHUT_WR)
        answer, _took = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]


def test_a_pipelined_request_whose_body_stalls_after_a_response_gets_408(server: Tuple[int, Tokens]) -> None:
    """Keep-alive + pipelining: a first request, and in the same segment the head of a second one and part of
    its body, then silence. The second request starts when the first one's response completes (uvicorn's
    ``on_response_complete`` hands the buffered bytes to the app): no byte arrives after that, so only a timer
    armed there can end the stalled body. 1a27038 dropped that hook: the connection was held for ever (the app
    waiting for a body that never comes, no timer armed)."""
    port, tokens = server
    first = b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n"
    with _connect(port) as sock:
        sock.sendall(first + _ingest_head(tokens, 1000) + b'{"events": [')
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 200 OK\r\n"), response
        data, elapsed = _read_until_closed(sock)  # was: socket.timeout (held for ever)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), data[:200]
    assert elapsed < WAIT_S


def test_a_pipelined_half_head_after_a_response_is_cut_at_the_header_deadline(
        server: Tuple[int, Tokens]) -> None:
    """The same with only part of the second request's head buffered: it is answered 408 at the header
    deadline, counted from the response (the keep-alive timer alone would close it without an answer, and a
    trickle of bytes restarts nothing)."""
    port, _tokens = server
    first = b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n"
    with _connect(port) as sock:
        sock.sendall(first + b"POST /v1/ingest HTTP/1.1\r\nHost: t\r\nContent-")
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 200 OK\r\n"), response
        data, elapsed = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), data[:200]
    assert elapsed < WAIT_S


def test_a_request_answered_before_its_body_keeps_the_keep_alive_timer() -> None:
    """The hook above arms the timers only when the next request has begun: a request answered before its
    body was read (here 401: the token is checked first) whose client then goes quiet is still closed by the
    keep-alive timer (0.6 s), not held for the body timer (60 s here)."""
    gateway, _, _tokens = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    http = HttpThread(app, "127.0.0.1", 0, "test-http",
                      timeouts=HttpTimeouts(header_s=0.6, body_idle_s=60.0, keep_alive_s=0.6))
    http.start()
    try:
        with _connect(http.port) as sock:
            sock.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer nope\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"events\": [")
            data, _elapsed = _read_until_closed(sock)  # socket.timeout (WAIT_S) if held for the body timer
        assert data.startswith(b"HTTP/1.1 401 "), data[:200]
    finally:
        http.stop(5)
