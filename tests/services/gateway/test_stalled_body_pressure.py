"""An HTTP ingest body that stalls while the process's ingest bytes in flight are full is ended after
``http_body_pressure_timeout_s`` (408, ``Connection: close``, its bytes given back), not after the 30 s
``http_body_timeout_s``. Before (stop 41), uploads sent short of their ``Content-Length`` and stalled held
their bytes 30 s whatever the pressure: other requests were answered 429 (or admitted only up to their fair
share, H27) for as long. Without pressure (room for one more ``max_batch_bytes`` body) a slow body keeps the
ordinary timeout. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1), raw sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from contextlib import ExitStack
from typing import AsyncIterator, Iterator
from urllib.parse import urlparse

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server, read_answer
from trainguard_server.gateway.http import BodyStalled, _Held, _read_body
from trainguard_server.gateway.inflight import InflightBytes

MiB = 2**20


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("pressure"), max_batch_bytes=MiB, project_max_inflight_bytes=2 * MiB,
                     ingest_max_inflight_bytes=3 * MiB, http_body_pressure_timeout_s=0.5) as server:
        yield server


def _inflight(live: LiveServer) -> InflightBytes:
    assert live.server.gateway is not None and live.server.gateway.body_bytes is not None
    return live.server.gateway.body_bytes


def _wait(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _stall(live: LiveServer, stack: ExitStack, token: str, declared: int, sent: int) -> socket.socket:
    url = urlparse(live.url)
    conn = stack.enter_context(socket.create_connection((url.hostname, url.port), timeout=5))
    conn.sendall((f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode() + b" " * sent)
    return conn


def _answer(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(65536):  # the server closes the connection after its answer
        out += chunk
    return out


def test_stalled_bodies_are_ended_while_the_total_is_full(small: LiveServer) -> None:
    """Three bodies of 1 MiB sent 1 byte short fill the 3 MiB total: stalled ones are ended (408) until a
    whole ``max_batch_bytes`` body fits again -- here one -- in about the pressure timeout, not 30 s."""
    other = small.server.stores.projects.create_token("pressure-other", "ingest")
    counts = _inflight(small)
    with ExitStack() as stack:
        started = time.monotonic()
        stalled = [_stall(small, stack, small.ingest_token, MiB, MiB - 1),
                   _stall(small, stack, small.ingest_token, MiB, MiB - 1),
                   _stall(small, stack, other, MiB, MiB - 1)]
        _wait(lambda: counts.held() > 2 * MiB)  # all three held (the total has no room for a 1 MiB body)
        _wait(lambda: counts.held() + MiB <= 3 * MiB, timeout=5)  # was: held for the 30 s body timeout
        assert time.monotonic() - started < 5
        ended = []
        for conn in stalled:
            conn.settimeout(0.5)
            try:
                answer = _answer(conn)
            except socket.timeout:
                continue  # still waiting: there is room for another body now
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer[:300]
            assert b"connection: close" in head.lower()
            detail = json.loads(body)["detail"]
            assert "http_body_pressure_timeout_s=0.5" in detail, detail
            assert "TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES" in detail, detail
            ended.append(conn)
        assert len(ended) == 1
        # room for it in the total: admitted. A third project's event: which stalled body was ended depends on
        # arrival order, and when it was the other project's, this project still holds its 2 MiB bound (a 429
        # of its own bound, not of the total -- a flaky failure of a fresh-clone CI, stop 41)
        third = small.server.stores.projects.create_token("pressure-third", "ingest")
        r = small.client.post("/v1/ingest", content=json.dumps({"events": [event("after-pressure")]}).encode(),
                              headers={"Authorization": f"Bearer {third}", "Content-Type": "application/json"})
        assert (r.status_code, r.json().get("accepted")) == (200, 1), r.text
    _wait(lambda: counts.held() == 0)


def test_a_slow_body_without_pressure_keeps_the_ordinary_timeout(small: LiveServer) -> None:
    body = json.dumps({"events": [event("slow-no-pressure")]}).encode()
    with ExitStack() as stack:
        conn = _stall(small, stack, small.ingest_token, len(body), 0)
        conn.sendall(body[:10])
        _wait(lambda: _inflight(small).held() == 10)
        time.sleep(1.5)  # three pressure timeouts, but room for a whole max_batch_bytes body: no pressure
        assert _inflight(small).held() == 10
        conn.sendall(body[10:])
        head, _, answer = read_answer(conn).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(answer)["accepted"] == 1


class _Stalling:
    """A request whose body sends ``first`` and then nothing."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.first
        await asyncio.Event().wait()  # never set
        yield b""  # pragma: no cover


def _full() -> InflightBytes:
    counts = InflightBytes(total=1_000, per_project=0, max_request=500)
    assert counts.take("other", 400) is None
    return counts


def test_unit_a_stalled_body_under_pressure_is_408_and_gives_its_bytes_back() -> None:
    counts = _full()
    held = _Held(counts, "p", 1.0)

    async def read() -> None:
        await _read_body(_Stalling(b"x" * 200), 10_000, held, 0.05)  # type: ignore[arg-type]

    started = time.monotonic()
    with pytest.raises(BodyStalled, match=r"http_body_pressure_timeout_s=0\.05"):
        asyncio.run(read())
    assert time.monotonic() - started < 1
    assert counts.held("p") == 0 and counts.held() == 400


def test_unit_another_cancellation_is_not_turned_into_a_408() -> None:
    counts = _full()
    held = _Held(counts, "p", 1.0)

    async def read_then_cancel() -> None:
        task = asyncio.ensure_future(_read_body(_Stalling(b"x"), 10_000, held, 5.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(read_then_cancel())
