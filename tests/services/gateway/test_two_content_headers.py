"""A request to ``POST /v1/ingest`` with two ``Content-Type`` or two ``Content-Encoding`` headers: the gateway
read the first and ignored the rest, so ``Content-Encoding: gzip`` + ``Content-Encoding: identity`` was
inflated as gzip and ``application/json`` + ``application/x-protobuf`` decoded as JSON, while a proxy or WAF
reading the last (or, for Content-Encoding, the list RFC 9110 5.3 makes of them: ``gzip, identity``) saw
another body than the one stored. Now two Content-Type headers are a 400 naming both, and Content-Encoding
lines are read as the one list they are (415 for anything but a single gzip or identity), before the body is
read; one of each works as before. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import gzip
import json
from typing import Iterator, List, Tuple

import httpx
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _post(live: LiveServer, body: bytes, headers: List[Tuple[str, str]]) -> httpx.Response:
    return live.client.post("/v1/ingest", content=body, headers=httpx.Headers(
        [("Authorization", f"Bearer {live.ingest_token}"), *headers]))


def _body(run_id: str) -> bytes:
    return json.dumps({"events": [event(run_id)]}).encode()


def test_two_content_types_are_refused(live: LiveServer) -> None:
    r = _post(live, _body("two-ctype"), [("Content-Type", "application/json"),
                                         ("Content-Type", "application/x-protobuf")])
    assert (r.status_code, r.json()) == (400, {  # was 200, accepted 1 (read as the first, JSON)
        "detail": "2 Content-Type headers were sent ('application/json', 'application/x-protobuf'); send "
                  "exactly one: application/json or application/x-protobuf"})
    assert live.get("/api/v1/runs/two-ctype").status_code == 404


def test_two_content_encodings_are_one_list_and_refused(live: LiveServer) -> None:
    r = _post(live, gzip.compress(_body("two-cenc")), [("Content-Type", "application/json"),
                                                       ("Content-Encoding", "gzip"),
                                                       ("Content-Encoding", "identity")])
    assert (r.status_code, r.json()) == (415, {  # was 200, accepted 1 (inflated as gzip, the first)
        "detail": "Content-Encoding 'gzip, identity' is not supported; use gzip or none"})
    r = _post(live, _body("two-cenc-plain"), [("Content-Type", "application/json"),
                                              ("Content-Encoding", "identity"), ("Content-Encoding", "gzip")])
    assert r.status_code == 415  # was 200: identity, the first, won


def test_one_of_each_still_works_and_the_next_batch_is_stored(live: LiveServer) -> None:
    r = _post(live, gzip.compress(_body("one-each")), [("Content-Type", "application/json"),
                                                       ("Content-Encoding", "gzip")])
    assert r.json()["accepted"] == 1
    live.wait_for(lambda: live.get("/api/v1/runs/one-each").status_code == 200)
