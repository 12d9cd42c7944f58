"""Issue 18, finding 8: a gzip "member bomb" -- a body of thousands of empty gzip members, then a real one --
took 65 CPU-seconds and got a 200. HTTP ingest now takes at most ``max_gzip_members`` members (400 beyond)
and inflates in linear time; run on a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import gzip
import json
import time
from typing import Iterator, Tuple

import httpx
import pytest
from fastapi import FastAPI

from tests.services.gateway.helpers import (
    ControlledQueue,
    Tokens,
    UvicornThread,
    drain,
    metric_event,
    new_gateway,
)
from trainguard_server.config import Settings
from trainguard_server.gateway.http import gunzip, ingest_router
from trainguard_server.gateway.ingest import InvalidRequest

EMPTY_MEMBER = gzip.compress(b"")


@pytest.fixture(scope="module")
def server() -> Iterator[Tuple[httpx.Client, Tokens, ControlledQueue]]:
    gateway, queue, tokens = new_gateway(max_gzip_members=4)
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv, httpx.Client(base_url=uv.url, timeout=60) as client:
        yield client, tokens, queue


def _post(client: httpx.Client, tokens: Tokens, body: bytes) -> httpx.Response:
    return client.post("/v1/ingest", content=body, headers={
        "Authorization": f"Bearer {tokens.ingest}", "Content-Type": "application/json",
        "Content-Encoding": "gzip"})


def test_thousands_of_empty_members_before_a_real_batch_are_refused(
        server: Tuple[httpx.Client, Tokens, ControlledQueue]) -> None:
    client, tokens, queue = server
    batch = gzip.compress(json.dumps({"events": [metric_event()]}).encode())
    r = _post(client, tokens, EMPTY_MEMBER * 5000 + batch)
    assert r.status_code == 400, r.text  # was 200: the batch behind the empty members was queued
    assert r.json() == {"detail": "gzip body has more than max_gzip_members=4 members; send one gzip stream"}
    assert drain(queue) == []
    # up to the limit, concatenated members are still one body (the gzip format allows them)
    two = gzip.compress(b'{"events": [') + gzip.compress(json.dumps(metric_event()).encode() + b"]}")
    r = _post(client, tokens, two)
    assert (r.status_code, r.json()["accepted"]) == (200, 1)
    assert len(drain(queue)) == 1


def test_a_full_size_member_bomb_is_refused_at_once_with_default_settings() -> None:
    """The probe's body: 8 MiB of ~419,000 empty members (the default max_batch_bytes), then a batch."""
    gateway, queue, tokens = new_gateway(max_batch_bytes=Settings().max_batch_bytes,
                                         max_gzip_members=Settings().max_gzip_members)
    batch = gzip.compress(json.dumps({"events": [metric_event()]}).encode())
    body = EMPTY_MEMBER * ((Settings().max_batch_bytes - len(batch)) // len(EMPTY_MEMBER)) + batch
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv, httpx.Client(base_url=uv.url, timeout=120) as client:
        started = time.monotonic()
        r = _post(client, tokens, body)
        elapsed = time.monotonic() - started
    assert r.status_code == 400, r.text
    assert "max_gzip_members=16" in r.json()["detail"]
    assert drain(queue) == []
    assert elapsed < 10, elapsed  # was tens of CPU-seconds (quadratic copying of the remaining members)


def test_gunzip_work_is_linear_in_the_member_count() -> None:
    """Even with the member limit lifted, 400,000 members inflate in one pass (no quadratic re-copying)."""
    body = EMPTY_MEMBER * 400_000 + gzip.compress(b"{}")
    started = time.process_time()
    assert gunzip(body, 1 << 20, max_members=10**6) == b"{}"
    assert time.process_time() - started < 10  # was ~25 s of copying
    with pytest.raises(InvalidRequest, match="max_gzip_members=3"):
        gunzip(body, 1 << 20, max_members=3)
