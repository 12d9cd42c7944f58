"""A request framed two ways: ``Content-Length`` and ``Transfer-Encoding: chunked`` together. uvicorn reads it
as chunked (RFC 9112) and the ingest queued it (200), keeping the connection open -- behind a proxy that
framed it by ``Content-Length`` instead, the rest is another request the proxy never saw (request
smuggling). Now it is a 400 naming both headers, and the connection is closed, so nothing after it on that
connection is read. Raw sockets against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server, raw_exchange


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _head(live: LiveServer, extra: str) -> bytes:
    return (f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.ingest_token}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def _chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


def test_content_length_and_chunked_together_is_a_400_and_the_connection_closes(live: LiveServer) -> None:
    body = json.dumps({"events": [event("framed-twice")]}).encode()
    smuggled = _head(live, "Content-Length: 2\r\nConnection: close\r\n") + b"{}"
    answer = raw_exchange(live, _head(live, "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n") + _chunked(body)
                       + smuggled)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer  # was 200, and the connection stayed open
    assert b"connection: close" in head.lower()
    assert json.loads(rest) == {"detail": "the request has both Content-Length (5) and Transfer-Encoding "
                                          "(chunked): send one of them"}
    assert answer.count(b"HTTP/1.1") == 1  # the request after it was never read
    assert live.get("/api/v1/runs/framed-twice").status_code == 404


def test_a_chunked_request_alone_is_still_ingested(live: LiveServer) -> None:
    body = json.dumps({"events": [event("chunked-only")]}).encode()
    answer = raw_exchange(live, _head(live, "Transfer-Encoding: chunked\r\nConnection: close\r\n") + _chunked(body))
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"accepted": 1, "duplicates": 0, "rejected": []}')
