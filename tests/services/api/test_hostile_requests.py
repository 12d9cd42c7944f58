"""Hostile requests to the query API of ``trainguard serve`` (EmbeddedServer: uvicorn on 127.0.0.1, SQLite
stores), with a valid read token:

* a 300 MB note was buffered whole and decoded before its 4,000-character limit refused it (~560 MB more
  resident memory for one request): a few at once could take the memory every project's ingest runs in.
  Now a body over ``MAX_BODY_BYTES`` is a 413 from its ``Content-Length``, or once that much has arrived;
* a body that is not UTF-8 or nested too deeply answered ``There was an error parsing the body``, and one
  with a JSON syntax error ``body.5: JSON decode error``: now each says what and where; a key given twice
  (``{"by": "ana", "by": "mallory"}``) was read last-wins: now a 422 naming it;
* ``limit=`` beyond int64 was told ``less than or equal to 9223372036854775807`` where the route takes 500.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, live_server
from trainguard_server.api.preflight import MAX_BODY_BYTES

NOTE = "/api/v1/incidents/no-such-incident/notes"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _post(live: LiveServer, path: str, content: Any, token: str = "read") -> Dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {live.read_token}"
    r = live.client.post(path, content=content, headers=headers)
    return {"status": r.status_code, **r.json()}


def test_a_body_over_the_limit_is_a_413_from_its_content_length(live: LiveServer) -> None:
    body = json.dumps({"by": "ana", "text": "x" * (MAX_BODY_BYTES + 1)}).encode()
    assert _post(live, NOTE, body) == {"status": 413, "detail": (
        f"request body of {len(body)} bytes is larger than {MAX_BODY_BYTES} bytes, the most this API takes "
        f"(its bodies are small JSON objects)")}  # was 422 after buffering and decoding all of it


def test_a_chunked_body_over_the_limit_is_a_413_once_that_much_arrived(live: LiveServer) -> None:
    sent = []

    def chunks() -> Iterator[bytes]:
        yield b'{"by": "ana", "text": "'
        for _ in range(64):  # 64 MiB offered; the server stops reading after ~1 MiB
            sent.append(1)
            yield b"x" * (1 << 20)
        yield b'"}'

    assert _post(live, NOTE, chunks()) == {"status": 413, "detail": (
        f"request body of more bytes is larger than {MAX_BODY_BYTES} bytes, the most this API takes "
        f"(its bodies are small JSON objects)")}


def test_the_token_is_still_checked_first(live: LiveServer) -> None:
    assert _post(live, NOTE, b"x" * (MAX_BODY_BYTES + 1), token="")["status"] == 401


def test_a_body_within_the_limit_still_reaches_the_route(live: LiveServer) -> None:
    assert _post(live, NOTE, json.dumps({"by": "ana", "text": "a note"}).encode()) == {
        "status": 404, "detail": "incident 'no-such-incident' not found"}
    verdict = _post(live, "/api/v1/gate", json.dumps({"baseline": "none", "candidate": "run-x"}).encode())
    assert (verdict["status"], verdict["verdict"]) == (200, "undecided")


@pytest.mark.parametrize("body,status,detail", [
    (b'{"by": "ana", "text": "\xff"}', 400, "body: not valid UTF-8 (invalid start byte at byte 23)"),
    (b'{"by": ' + b"[" * 5000 + b"]" * 5000 + b', "text": "t"}', 400,
     "body: JSON nested too deeply to decode (the API's bodies nest a few levels)"),
    (b'{"by": "ana", "text": }', 422, "body: malformed JSON at char 22: Expecting value"),
    (b'{"by": "ana", "by": "mallory", "text": "t"}', 422,
     'body: duplicate key "by" in one object (each field may be given once)'),  # was read last-wins
])
def test_an_undecodable_body_says_what_is_wrong(live: LiveServer, body: bytes, status: int, detail: str) -> None:
    assert _post(live, NOTE, body) == {"status": status, "detail": detail}  # was "There was an error ..."


@pytest.mark.parametrize("path,message", [
    ("/api/v1/runs?limit=99999999999999999999999", "query.limit: Input should be less than or equal to 500"),
    ("/api/v1/runs/r/metrics?names=loss&max_points=99999999999999999999999",
     "query.max_points: Input should be less than or equal to 10000"),
    ("/api/v1/runs?limit=-99999999999999999999999", "query.limit: Input should be greater than or equal to 1"),
])
def test_an_integer_beyond_int64_is_told_the_routes_own_bound(live: LiveServer, path: str, message: str) -> None:
    r = live.client.get(path, headers=live.read_headers)
    assert (r.status_code, r.json()) == (422, {"detail": message})


@pytest.mark.parametrize("value", ["NaN", "inf", "-Infinity"])
def test_a_non_finite_stream_interval_is_named_as_such(live: LiveServer, value: str) -> None:
    r = live.client.get("/api/v1/runs/r/stream", params={"interval": value}, headers=live.read_headers)
    assert (r.status_code, r.json()) == (422, {"detail": "query.interval: Input should be a finite number"})
    # was "Input should be less than or equal to 60" for NaN
