"""Request bodies held at once by HTTP ingest: nothing bounded them but the open-files limit, and each is
decoded at about six times its size, so one project's clients sending big batches together took every
project's server memory (24 bodies of 7.9 MB: resident 136 MB -> 1.28 GB, 1.1 GB kept). Now a project holds
at most ``project_max_inflight_bytes`` (32 MiB) of bodies being read or decoded and the process
``ingest_max_inflight_bytes`` (64 MiB): past it a request is answered 429 + Retry-After, before its body is
read when its Content-Length already says it would not fit. Bytes count as they arrive (a client declaring
8 MiB and stalling holds only what it sent) and are given back when a request ends, however it ends. Another
project is admitted meanwhile. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1), raw sockets."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Iterator, List
from urllib.parse import urlparse

import pytest

from tests.services.gateway.embedded_server import (
    LiveServer,
    event,
    live_server,
    module_live_server,
    read_answer,
)
from trainguard_server.config import Settings
from trainguard_server.gateway.inflight import InflightBytes

MiB = 2**20
DEFAULT_PER_PROJECT = Settings.model_fields["project_max_inflight_bytes"].default


live = module_live_server()


def _head(token: str, length: int) -> bytes:
    return (f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _stalled_uploads(live: LiveServer, stack: ExitStack, token: str, n: int, sent: int,
                     declared: int = 8 * MiB) -> List[socket.socket]:
    """``n`` connections each declaring ``declared`` bytes and sending ``sent`` of them, then waiting."""
    url = urlparse(live.url)
    conns = []
    for _ in range(n):
        conn = stack.enter_context(socket.create_connection((url.hostname, url.port), timeout=20))
        conn.sendall(_head(token, declared) + b" " * sent)
        conns.append(conn)
    return conns


def _wait_held(live: LiveServer, at_least: int) -> None:
    inflight = _inflight(live)
    deadline = time.monotonic() + 20
    while inflight.held() < at_least:
        assert time.monotonic() < deadline, inflight.held()
        time.sleep(0.02)


def _inflight(live: LiveServer) -> InflightBytes:
    assert live.server.gateway is not None
    counts = live.server.gateway.body_bytes
    assert counts is not None
    return counts


def test_a_project_past_its_bound_is_refused_and_another_is_admitted(live: LiveServer) -> None:
    other = live.server.stores.projects.create_token("other", "ingest")
    body = json.dumps({"events": [event("inflight-b")]}).encode()
    with ExitStack() as stack:
        _stalled_uploads(live, stack, live.ingest_token, 4, 7 * MiB)  # 28 MiB held by the project
        _wait_held(live, 28 * MiB)
        url = urlparse(live.url)
        with socket.create_connection((url.hostname, url.port), timeout=20) as conn:
            conn.sendall(_head(live.ingest_token, 8 * MiB))  # would be 36 MiB: refused before the body
            answer = read_answer(conn)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]  # was: read the body, then 200
        assert b"retry-after: 1" in answer.lower()
        detail = json.loads(answer.partition(b"\r\n\r\n")[2])["detail"]
        assert detail.startswith(f"project 'default' has {28 * MiB} bytes of ingest requests being read or "
                                 f"decoded, at most {DEFAULT_PER_PROJECT} may "
                                 f"(TRAINGUARD_PROJECT_MAX_INFLIGHT_BYTES): nothing of this request was "
                                 f"queued"), detail
        # a small batch of the same project still fits; another project is admitted
        assert live.post_events([event("inflight-small")]).json()["accepted"] == 1
        r = live.client.post("/v1/ingest", content=body, headers={"Authorization": f"Bearer {other}",
                                                                  "Content-Type": "application/json"})
        assert r.json()["accepted"] == 1
    # the stalled uploads closed: every byte they held is given back
    deadline = time.monotonic() + 20
    while _inflight(live).held() > 0:
        assert time.monotonic() < deadline, _inflight(live).held()
        time.sleep(0.05)
    assert live.post_events([event("inflight-after")]).json()["accepted"] == 1


def test_the_counts_are_given_back(live: LiveServer) -> None:
    counts = InflightBytes(total=10, per_project=6)
    assert counts.take("a", 4) is None and counts.take("a", 2) is None
    assert "TRAINGUARD_PROJECT_MAX_INFLIGHT_BYTES" in (counts.take("a", 1) or "")
    assert counts.take("b", 4) is None
    assert "TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES" in (counts.take("b", 2) or "")  # full, b past its share 5
    assert counts.held() == 10
    counts.give_back("a", 6)
    counts.give_back("b", 4)
    assert counts.held() == 0 and counts.take("c", 100) is None  # alone: a body over a bound goes through


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # the stalled uploads of these tests are not ended by the pressure timeout (H30) while they run
    with live_server(tmp_path_factory.mktemp("small"), project_max_inflight_bytes=2 * MiB,
                     ingest_max_inflight_bytes=3 * MiB, http_body_pressure_timeout_s=120) as server:
        yield server


def test_a_gzip_body_counts_at_its_inflated_size(small: LiveServer) -> None:
    import gzip
    padded = [event("inflight-gz", run_name="x" * 60_000) for _ in range(40)]  # ~2.4 MB of JSON
    packed = gzip.compress(json.dumps({"events": padded}).encode())
    assert len(packed) < 64 * 1024
    with ExitStack() as stack:
        _stalled_uploads(small, stack, small.ingest_token, 1, MiB // 2)
        _wait_held(small, MiB // 2)
        r = small.client.post("/v1/ingest", content=packed, headers={
            "Authorization": f"Bearer {small.ingest_token}", "Content-Type": "application/json",
            "Content-Encoding": "gzip"})
        assert r.status_code == 429, r.text  # was 200: 60 KB on the wire, 2.4 MB decoded
        assert "TRAINGUARD_PROJECT_MAX_INFLIGHT_BYTES" in r.json()["detail"]
    deadline = time.monotonic() + 20
    while _inflight(small).held() > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = small.client.post("/v1/ingest", content=packed, headers={
        "Authorization": f"Bearer {small.ingest_token}", "Content-Type": "application/json",
        "Content-Encoding": "gzip"})
    assert r.json()["accepted"] == 40  # alone it goes through, whatever its size


def test_two_projects_filling_the_total_do_not_starve_a_third(small: LiveServer) -> None:
    """hA's open item (stop 40): two projects stalling bodies up to the process total made every other
    project's ingest 429 until the body timeout. Now a project holding nothing is admitted one body, and one
    under its share of the total (total / projects holding bytes) more; the two holders are refused past it."""
    other = small.server.stores.projects.create_token("other", "ingest")
    third = small.server.stores.projects.create_token("third", "ingest")
    body = json.dumps({"events": [event("t")]}).encode()
    with ExitStack() as stack:
        half = 3 * MiB // 2  # each declares half (a declared 8 MiB would not fit) and stalls one byte short
        _stalled_uploads(small, stack, small.ingest_token, 1, half - 1, half)
        _stalled_uploads(small, stack, other, 1, half - 1, half)
        _wait_held(small, 3 * MiB - 2)  # the total is full
        r = small.client.post("/v1/ingest", content=body, headers={
            "Authorization": f"Bearer {third}", "Content-Type": "application/json"})
        assert (r.status_code, r.json().get("accepted")) == (200, 1), r.text  # was 429 (total full)
        # a second body of the third project, while its first is held: under its share (3 MiB / 3)
        url = urlparse(small.url)
        conn = stack.enter_context(socket.create_connection((url.hostname, url.port), timeout=20))
        conn.sendall(_head(third, 4096) + b" " * 100)  # holds 100 bytes, stalls
        _wait_held(small, 3 * MiB - 2 + 100)
        r = small.client.post("/v1/ingest", content=body, headers={
            "Authorization": f"Bearer {third}", "Content-Type": "application/json"})
        assert (r.status_code, r.json().get("accepted")) == (200, 1), r.text
        # the two holders are over their share: refused, naming the total and the share
        r = small.client.post("/v1/ingest", content=body, headers={
            "Authorization": f"Bearer {other}", "Content-Type": "application/json"})
        assert r.status_code == 429, r.text
        detail = r.json()["detail"]
        assert "TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES" in detail and "share" in detail, detail


def test_grpc_of_a_third_project_is_admitted_while_two_fill_the_total(small: LiveServer) -> None:
    import grpc

    from trainguard import wire
    from trainguard.v1 import ingest_pb2_grpc

    other = small.server.stores.projects.create_token("other", "ingest")
    third = small.server.stores.projects.create_token("third", "ingest")
    request = wire.ingest_request_from_dicts([event("grpc-third", run_name="x" * 60_000) for _ in range(5)])
    with ExitStack() as stack, grpc.insecure_channel(small.grpc_target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        half = 3 * MiB // 2
        _stalled_uploads(small, stack, small.ingest_token, 1, half - 1, half)
        _stalled_uploads(small, stack, other, 1, half - 1, half)
        _wait_held(small, 3 * MiB - 2)
        reply = stub.Send(request, timeout=20, metadata=(("authorization", f"Bearer {third}"),))
        assert reply.accepted == 5  # was RESOURCE_EXHAUSTED (TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES)
        with pytest.raises(grpc.RpcError) as refused:  # a holder over its share still is
            stub.Send(request, timeout=20, metadata=(("authorization", f"Bearer {other}"),))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_fair_share_units() -> None:
    counts = InflightBytes(total=10, per_project=20, max_request=5)
    assert counts.take("a", 5) is None and counts.take("a", 5, 5) is None  # one request of a: 10, the total
    assert counts.take("b", 5) is None  # b holds nothing: admitted one body though the total is full
    counts.give_back("b", 5)
    assert "TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES" in (counts.take("b", 6) or "")  # one body: max_request
    assert counts.take("b", 3) is None and counts.take("b", 2) is None  # a second body: 5 <= 10 / 2 projects
    assert "share" in (counts.take("b", 1) or "")  # 6 > its share 5
    assert "share" in (counts.take("a", 1) or "")  # a holds 10 > its share 5
    assert counts.take("c", 4) is None  # a third holding nothing
    assert counts.held() == 19  # within total + projects x max_request
