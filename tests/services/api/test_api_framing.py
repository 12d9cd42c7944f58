"""The query API's routes (not only ingest) refuse a request framed two ways: ``Content-Length`` and
``Transfer-Encoding: chunked`` together. uvicorn read such a request as chunked and the API answered it,
keeping the connection open -- behind a proxy that framed it by ``Content-Length``, the rest is another
request the proxy never saw. Now every route answers 400 naming both headers and closes the connection
(the rule ingest applies, from one module: request_headers.py). Raw sockets against ``trainguard serve``
(EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, live_server, raw_exchange

DETAIL = "the request has both Content-Length (5) and Transfer-Encoding (chunked): send one of them"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _request(live: LiveServer, method: str, path: str, extra: str, body: bytes = b"") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.read_token}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()
    return head + body


def _chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


@pytest.mark.parametrize("method, path", [("GET", "/api/v1/runs"),
                                          ("POST", "/api/v1/incidents/nope/notes"),
                                          ("GET", "/healthz")])
def test_query_api_refuses_content_length_with_chunked_and_closes(live: LiveServer, method: str,
                                                                  path: str) -> None:
    body = json.dumps({"by": "ana", "text": "hello"}).encode()
    after = _request(live, "GET", "/api/v1/runs", "Connection: close\r\n")
    answer = raw_exchange(live, _request(live, method, path, "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                                      _chunked(body)) + after)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer  # was 200 (runs, healthz) / 404 (notes)
    assert b"connection: close" in head.lower()
    assert json.loads(rest) == {"detail": DETAIL}
    assert answer.count(b"HTTP/1.1") == 1  # the request after it on that connection was never read


def test_one_framing_is_still_answered(live: LiveServer) -> None:
    answer = raw_exchange(live, _request(live, "GET", "/api/v1/runs", "Connection: close\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    chunked = raw_exchange(live, _request(live, "POST", "/api/v1/incidents/nope/notes",
                                       "Transfer-Encoding: chunked\r\nConnection: close\r\n",
                                       _chunked(json.dumps({"by": "ana", "text": "hi"}).encode())))
    assert chunked.startswith(b"HTTP/1.1 404 "), chunked  # read (chunked alone is fine): no such incident
