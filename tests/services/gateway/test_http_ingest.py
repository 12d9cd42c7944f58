"""HTTP ingest (``POST /v1/ingest``) on a real uvicorn server on 127.0.0.1, driven by real clients: the SDK's
own HttpTransport and httpx. Every bad input asserts the exact status and message, and every test ends by
checking that the same server still acknowledges a good batch."""

from __future__ import annotations

import gzip
import json
import math
import sqlite3
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest
from fastapi import FastAPI

from tests.services.gateway.helpers import (
    NOW_NS,
    PROJECT,
    RUN,
    ControlledQueue,
    Tokens,
    UvicornThread,
    drain,
    exception_event,
    frame,
    metric_event,
    new_gateway,
)
from trainguard import wire
from trainguard.transport.base import TransportError
from trainguard.transport.http import HttpTransport
from trainguard.v1 import events_pb2, ingest_pb2
from trainguard_server.gateway.http import gunzip, ingest_router
from trainguard_server.gateway.ingest import Gateway, InvalidRequest, RequestTooLarge

JSON = "application/json"
PROTO = "application/x-protobuf"


class Server:
    def __init__(self, gateway: Gateway, queue: ControlledQueue, tokens: Tokens, url: str) -> None:
        self.gateway, self.queue, self.tokens, self.url = gateway, queue, tokens, url
        self.client = httpx.Client(base_url=url, timeout=10)

    def post(self, body: bytes, *, token: Any = "ingest", content_type: str = JSON,
             headers: Dict[str, str] | None = None) -> httpx.Response:
        h = {"Content-Type": content_type}
        if token is not None:
            h["Authorization"] = f"Bearer {getattr(self.tokens, token)}"
        h.update(headers or {})
        return self.client.post("/v1/ingest", content=body, headers=h)

    def post_events(self, events: List[Any], **kw: Any) -> httpx.Response:
        return self.post(json.dumps({"events": events}).encode(), **kw)

    def queued(self) -> List[Tuple[str, events_pb2.Envelope]]:
        return drain(self.queue)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    gateway, queue, tokens = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv:
        srv = Server(gateway, queue, tokens, uv.url)
        yield srv
        srv.client.close()


@pytest.fixture
def srv(server: Server) -> Iterator[Server]:
    """The shared server with an empty queue; afterwards it must still acknowledge a good batch."""
    server.queue.full, server.queue.broken = False, None
    server.queued()
    yield server
    server.queue.full, server.queue.broken = False, None
    server.queued()
    event = metric_event()
    r = server.post_events([event])
    assert (r.status_code, r.json()) == (200, {"accepted": 1, "duplicates": 0, "rejected": []})
    assert [e.event_id for _, e in server.queued()] == [event["event_id"]]


def detail(r: httpx.Response) -> str:
    assert r.headers["content-type"] == JSON
    body = r.json()
    assert list(body) == ["detail"]
    return str(body["detail"])


# ------------------------------------------------------------------------------------------ happy paths

def test_sdk_http_transport_against_real_uvicorn(srv: Server) -> None:
    transport = HttpTransport(srv.url, srv.tokens.ingest, "trainguard-python/test")
    try:
        events = [metric_event(i) for i in range(5)]
        result = transport.send(events, 5)
        assert (result.accepted, result.duplicates, result.rejected) == (5, 0, [])
        queued = srv.queued()
        assert [(k, e.event_id) for k, e in queued] == [(RUN, d["event_id"]) for d in events]
        assert wire.envelope_to_dict(queued[0][1]) == wire.envelope_to_dict(wire.envelope_from_dict(events[0]))
        # a per-item rejection comes back through the SDK's result as well
        bad = metric_event(9, project="other")
        result = transport.send([metric_event(7), bad], 5)
        assert (result.accepted, result.rejected) == (1, [{
            "index": 1, "event_id": bad["event_id"], "code": "wrong_project",
            "message": "events[1].project: \"other\" does not match the token's project \"llm\""}])
    finally:
        transport.close()


def test_sdk_http_transport_sees_backpressure_with_retry_after(srv: Server) -> None:
    srv.queue.full = True
    transport = HttpTransport(srv.url, srv.tokens.ingest, "ua")
    try:
        with pytest.raises(TransportError) as info:
            transport.send([metric_event()], 5)
    finally:
        transport.close()
    err = info.value
    assert (err.retryable, err.retry_after, err.status) == (True, 2.0, "429")
    assert str(err) == ("HTTP 429: ingest queue is full (depth 50000 over max_queue_depth=50000); "
                        "retry after 2 s")
    assert srv.queued() == []


def test_sdk_http_transport_splits_on_413(srv: Server) -> None:
    transport = HttpTransport(srv.url, srv.tokens.ingest, "ua")
    try:
        with pytest.raises(TransportError) as info:
            transport.send([metric_event(i) for i in range(201)], 5)
        assert (info.value.retryable, info.value.status) == (False, "413")
        assert str(info.value) == "HTTP 413: request has 201 events, larger than max_batch_events=200; split the batch"
    finally:
        transport.close()


def test_protobuf_request_gets_a_protobuf_response(srv: Server) -> None:
    events = [metric_event(i) for i in range(3)]
    request = wire.ingest_request_from_dicts(events)
    r = srv.post(request.SerializeToString(), content_type=PROTO)
    assert (r.status_code, r.headers["content-type"]) == (200, PROTO)
    response = ingest_pb2.IngestResponse.FromString(r.content)
    assert (response.accepted, response.duplicates, list(response.rejected)) == (3, 0, [])
    assert [e for _, e in srv.queued()] == list(request.events)  # queued exactly as sent


def test_gzip_body_is_accepted(srv: Server) -> None:
    events = [metric_event(i) for i in range(10)]
    r = srv.post(gzip.compress(json.dumps({"events": events}).encode()), headers={"Content-Encoding": "gzip"})
    assert r.json()["accepted"] == 10
    assert len(srv.queued()) == 10


def test_non_finite_values_are_accepted_and_queued_as_such(srv: Server) -> None:
    event = metric_event()
    event["metrics"]["points"] = [{"name": "loss", "value": "NaN"}, {"name": "gn", "value": "Infinity"},
                                  {"name": "m", "value": "-Infinity"}]
    assert srv.post_events([event]).json()["accepted"] == 1
    points = srv.queued()[0][1].metrics.points
    assert math.isnan(points[0].value) and points[1].value == math.inf and points[2].value == -math.inf


def test_empty_project_and_time_are_filled_in(srv: Server) -> None:
    event = metric_event(project="", time_unix_nano=0)
    assert srv.post_events([event]).json()["accepted"] == 1
    queued = srv.queued()[0][1]
    assert (queued.project, queued.time_unix_nano) == (PROJECT, NOW_NS)


def test_events_of_several_runs_are_queued_per_run_in_order(srv: Server) -> None:
    events = [metric_event(i, run_id=f"run-{i % 2}") for i in range(6)]
    assert srv.post_events(events).json()["accepted"] == 6
    queued = srv.queued()
    assert [(k, e.step) for k, e in queued] == [("run-0", 0), ("run-0", 2), ("run-0", 4),
                                                 ("run-1", 1), ("run-1", 3), ("run-1", 5)]


def test_empty_batch(srv: Server) -> None:
    r = srv.post(b'{"events": []}')
    assert (r.status_code, r.json()) == (200, {"accepted": 0, "duplicates": 0, "rejected": []})


# ------------------------------------------------------------------------------------- per-item results

def test_mixed_batch_queues_the_good_events(srv: Server) -> None:
    good = [metric_event(i) for i in range(4)]
    no_id = metric_event(10, event_id="")
    no_run = metric_event(11, run_id="")
    no_payload = metric_event(12)
    del no_payload["metrics"]
    unknown = metric_event(13)
    unknown["metrics"]["points"][1]["vaule"] = 1.0
    future = metric_event(14, time_unix_nano=NOW_NS + 3600 * 10**9)
    past = metric_event(15, time_unix_nano=NOW_NS - 2 * 86400 * 10**9)
    wrong = metric_event(16, project="other")
    batch = [good[0], no_id, no_run, good[1], no_payload, unknown, future, good[2], past, wrong, good[3]]
    r = srv.post_events(batch)
    assert r.status_code == 200
    assert r.json() == {"accepted": 4, "duplicates": 0, "rejected": [
        {"index": 1, "event_id": "", "code": "missing_field", "message": "events[1].event_id: required"},
        {"index": 2, "event_id": no_run["event_id"], "code": "missing_field", "message": "events[2].run_id: required"},
        {"index": 4, "event_id": no_payload["event_id"], "code": "missing_field",
         "message": "events[4].payload: required (one of metrics, exception, lifecycle, heartbeat, log, memory)"},
        {"index": 5, "event_id": unknown["event_id"], "code": "invalid_field",
         "message": 'events[5].metrics.points[1]: unknown field "vaule" (trainguard.v1.Metric has: name, value, step)'},
        {"index": 6, "event_id": future["event_id"], "code": "out_of_range",
         "message": f"events[6].time_unix_nano: {NOW_NS + 3600 * 10**9} is 3600 s ahead of the server clock "
                    f"(max_future_skew_s=300)"},
        {"index": 8, "event_id": past["event_id"], "code": "out_of_range",
         "message": f"events[8].time_unix_nano: {NOW_NS - 2 * 86400 * 10**9} is 172800 s before the server "
                    f"clock (max_past_age_s=86400)"},
        {"index": 9, "event_id": wrong["event_id"], "code": "wrong_project",
         "message": "events[9].project: \"other\" does not match the token's project \"llm\""},
    ]}
    assert [e.event_id for _, e in srv.queued()] == [d["event_id"] for d in good]
    stats = srv.gateway.stats.snapshot()
    assert stats["rejected"]["out_of_range"] >= 2 and stats["rejected"]["wrong_project"] >= 1


def test_wrong_type_is_rejected_per_item_with_its_path(srv: Server) -> None:
    bad = metric_event(1)
    bad["metrics"]["points"][0]["value"] = "nan"
    r = srv.post_events([metric_event(0), bad, None])
    assert r.json() == {"accepted": 1, "duplicates": 0, "rejected": [
        {"index": 1, "event_id": bad["event_id"], "code": "invalid_field",
         "message": 'events[1].metrics.points[0].value: expected a double, got "nan" '
                    '(use "NaN", "Infinity" or "-Infinity")'},
        {"index": 2, "event_id": "", "code": "invalid_field", "message": "events[2]: expected an object, got null"},
    ]}
    assert len(srv.queued()) == 1


def test_duplicate_ids_in_one_request_are_queued_once(srv: Server) -> None:
    a, b = metric_event(0), metric_event(1)
    r = srv.post_events([a, b, dict(a, step=5), b])
    assert r.json() == {"accepted": 2, "duplicates": 2, "rejected": []}
    assert [(e.event_id, e.step) for _, e in srv.queued()] == [(a["event_id"], 0), (b["event_id"], 1)]


def test_oversized_event_and_too_many_frames(srv: Server) -> None:
    huge = metric_event(0)
    huge["metrics"]["points"] = [{"name": f"m{i:05d}", "value": 1.0} for i in range(5000)]
    deep = exception_event(frames=65)
    r = srv.post_events([huge, deep, metric_event(2)])
    size = wire.envelope_from_dict(huge).ByteSize()
    assert r.json()["rejected"] == [
        {"index": 0, "event_id": huge["event_id"], "code": "too_large",
         "message": f"events[0]: {size} bytes exceeds max_event_bytes=65536"},
        {"index": 1, "event_id": deep["event_id"], "code": "too_large",
         "message": "events[1].exception.frames: 65 frames exceeds max_frames=64"}]
    assert [e.step for _, e in srv.queued()] == [2]


def test_protobuf_with_one_corrupt_envelope_keeps_the_others(srv: Server) -> None:
    good = wire.ingest_request_from_dicts([metric_event(0), metric_event(1)])
    parts = [e.SerializeToString() for e in good.events]
    corrupt = b"\x0a\x02\xc3\x28"  # event_id with invalid UTF-8
    body = b"".join(frame(p) for p in [parts[0], corrupt, parts[1]])
    r = srv.post(body, content_type=PROTO)
    response = ingest_pb2.IngestResponse.FromString(r.content)
    assert response.accepted == 2
    assert [(x.index, x.code, x.message) for x in response.rejected] == [
        (1, "invalid_field", "events[1]: malformed protobuf: String field had bad UTF-8")]
    assert [e.step for _, e in srv.queued()] == [0, 1]


# ------------------------------------------------------------------------------------ whole-request errors

@pytest.mark.parametrize(("body", "message"), [
    (b'{"events": [', "malformed JSON: Expecting value: line 1 column 13 (char 12)"),
    (b"\xff\xfe{}", "malformed JSON: body is not valid UTF-8 (invalid start byte at byte 0)"),
    (b'{"events": [{"metrics": {"points": [{"name": "x", "value": NaN}]}}]}',
     'malformed JSON: bare NaN is not valid JSON (write the string "NaN")'),
    (b"[]", 'IngestRequest: expected an object with an "events" array, got an array'),
    (b"{}", "IngestRequest.events: required (an array of envelopes)"),
    (b'{"events": {}}', "IngestRequest.events: expected an array, got an object"),
    (b'{"events": [], "evnets": []}',
     'IngestRequest: unknown field "evnets" (trainguard.v1.IngestRequest has: events)'),
])
def test_malformed_json(srv: Server, body: bytes, message: str) -> None:
    r = srv.post(body)
    assert (r.status_code, detail(r)) == (400, message)
    assert srv.queued() == []


def test_malformed_protobuf(srv: Server) -> None:
    r = srv.post(b"\x0a\x10abc", content_type=PROTO)
    assert (r.status_code, detail(r)) == (
        400, "malformed protobuf: body is not a serialized trainguard.v1.IngestRequest (Wire format was corrupt)")


@pytest.mark.parametrize(("headers", "message"), [
    ({"Content-Type": "text/plain"},
     "Content-Type 'text/plain' is not supported; use application/json or application/x-protobuf"),
    ({"Content-Type": ""}, "Content-Type missing is not supported; use application/json or application/x-protobuf"),
    ({"Content-Encoding": "br"}, "Content-Encoding 'br' is not supported; use gzip or none"),
])
def test_unsupported_media(srv: Server, headers: Dict[str, str], message: str) -> None:
    r = srv.post(json.dumps({"events": [metric_event()]}).encode(), headers=headers)
    assert (r.status_code, detail(r)) == (415, message)
    assert srv.queued() == []


def test_json_content_type_with_charset_is_fine(srv: Server) -> None:
    r = srv.post_events([metric_event()], content_type="application/json; charset=utf-8")
    assert r.json()["accepted"] == 1
    srv.queued()


def test_oversized_body_by_content_length(srv: Server) -> None:
    body = json.dumps({"events": [metric_event(i) for i in range(700)]}).encode()
    assert len(body) > 256 * 1024
    r = srv.post(body)
    assert (r.status_code, detail(r)) == (
        413, f"body of {len(body)} bytes is larger than max_batch_bytes=262144; split the batch")
    assert srv.queued() == []


def test_oversized_chunked_body(srv: Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"events": ['
        for _ in range(40):
            yield b" " * 10_000
        yield b"]}"
    r = srv.client.post("/v1/ingest", content=chunks(),
                        headers={"Content-Type": JSON, "Authorization": f"Bearer {srv.tokens.ingest}"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert (r.status_code, detail(r)) == (413, "body is larger than max_batch_bytes=262144; split the batch")


def test_small_chunked_body_is_fine(srv: Server) -> None:
    body = json.dumps({"events": [metric_event()]}).encode()
    r = srv.client.post("/v1/ingest", content=iter([body[:10], body[10:]]),
                        headers={"Content-Type": JSON, "Authorization": f"Bearer {srv.tokens.ingest}"})
    assert r.json()["accepted"] == 1
    srv.queued()


def test_too_many_events(srv: Server) -> None:
    events = [metric_event(i) for i in range(201)]
    for body, content_type in [(json.dumps({"events": events}).encode(), JSON),
                               (wire.ingest_request_from_dicts(events).SerializeToString(), PROTO)]:
        r = srv.post(body, content_type=content_type)
        assert (r.status_code, detail(r)) == (
            413, "request has 201 events, larger than max_batch_events=200; split the batch")
    assert srv.queued() == []


def test_gzip_bomb(srv: Server) -> None:
    bomb = gzip.compress(b'{"events": [' + b" " * (50 * 2**20) + b"]}")
    assert len(bomb) < 256 * 1024
    r = srv.post(bomb, headers={"Content-Encoding": "gzip"})
    assert (r.status_code, detail(r)) == (
        413, "gzip body inflates to more than max_batch_bytes=262144 bytes; split the batch")


@pytest.mark.parametrize(("body", "message"), [
    (b"not gzip at all", "malformed gzip body: Error -3 while decompressing data: incorrect header check"),
    (gzip.compress(b'{"events": []}')[:-10], "malformed gzip body: truncated"),
])
def test_malformed_gzip(srv: Server, body: bytes, message: str) -> None:
    r = srv.post(body, headers={"Content-Encoding": "gzip"})
    assert (r.status_code, detail(r)) == (400, message)


def test_gunzip_unit() -> None:
    two = gzip.compress(b"ab") + gzip.compress(b"cd")
    assert gunzip(two, 4) == b"abcd"  # concatenated members
    with pytest.raises(RequestTooLarge):
        gunzip(two, 3)
    with pytest.raises(InvalidRequest, match="incorrect header check"):
        gunzip(gzip.compress(b"ab") + b"junk", 10)


# ------------------------------------------------------------------------------------------------- auth

@pytest.mark.parametrize(("authorization", "message"), [
    (None, "missing bearer token (send 'Authorization: Bearer <ingest token>')"),
    ("Bearer tg_ingest_0000000000000000_" + "0" * 48, "invalid or revoked token"),
    ("Bearer nonsense", "invalid or revoked token"),
    ("Bearer", "empty bearer token"),
    ("Basic dXNlcjpwYXNz", "authorization scheme 'Basic' is not supported; use 'Bearer <ingest token>'"),
])
def test_bad_token(srv: Server, authorization: str | None, message: str) -> None:
    headers = {"Content-Type": JSON}
    if authorization is not None:
        headers["Authorization"] = authorization
    r = srv.client.post("/v1/ingest", content=json.dumps({"events": [metric_event()]}), headers=headers)
    assert (r.status_code, detail(r), r.headers["www-authenticate"]) == (401, message, "Bearer")
    assert srv.queued() == []


def test_expired_token(srv: Server) -> None:
    token = srv.gateway.projects.create_token("alpha", "ingest", expires_ns=1_700_000_000 * 10**9)
    r = srv.client.post("/v1/ingest", content=json.dumps({"events": [metric_event()]}),
                        headers={"Content-Type": JSON, "Authorization": f"Bearer {token}"})
    assert (r.status_code, detail(r)) == (401, "token expired at 2023-11-14T22:13:20Z: create a new one")
    assert srv.queued() == []


def test_revoked_token(srv: Server) -> None:
    r = srv.post_events([metric_event()], token="revoked")
    assert (r.status_code, detail(r), r.headers["www-authenticate"]) == (401, "invalid or revoked token", "Bearer")
    assert srv.queued() == []


def test_read_token(srv: Server) -> None:
    r = srv.post_events([metric_event()], token="read")
    assert (r.status_code, detail(r)) == (403, "token is not an ingest token")
    assert "www-authenticate" not in r.headers
    assert srv.queued() == []


def test_another_projects_token_cannot_write_into_this_project(srv: Server) -> None:
    event = metric_event()  # project "llm"
    r = srv.post_events([event], token="other_project")
    assert r.json()["rejected"] == [{"index": 0, "event_id": event["event_id"], "code": "wrong_project",
                                     "message": "events[0].project: \"llm\" does not match the token's "
                                                "project \"other\""}]
    assert srv.queued() == []


# ------------------------------------------------------------------------------------------ backpressure

def test_backpressure_429_and_nothing_queued(srv: Server) -> None:
    srv.queue.full = True
    before = srv.gateway.stats.snapshot()
    r = srv.post_events([metric_event(i) for i in range(5)])
    assert (r.status_code, detail(r), r.headers["retry-after"]) == (
        429, "ingest queue is full (depth 50000 over max_queue_depth=50000); retry after 2 s", "2")
    srv.queue.full = False
    assert srv.queued() == []
    after = srv.gateway.stats.snapshot()
    assert after["backpressure"] == before["backpressure"] + 1 and after["accepted"] == before["accepted"]


def test_queue_failure_is_503_with_retry_after(srv: Server) -> None:
    srv.queue.broken = sqlite3.OperationalError("database or disk is full")
    r = srv.post_events([metric_event()])
    assert (r.status_code, detail(r), r.headers["retry-after"]) == (
        503, "ingest queue unavailable: OperationalError: database or disk is full", "3")
    srv.queue.broken = None
    assert srv.queued() == []


def test_other_paths_and_methods(srv: Server) -> None:
    assert srv.client.post("/v1/ingestx", content=b"{}").status_code == 404
    assert srv.client.get("/v1/ingest").status_code == 405


def test_openapi_documents_the_endpoint() -> None:
    gateway, _, _ = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    operation = app.openapi()["paths"]["/v1/ingest"]["post"]
    assert set(operation["requestBody"]["content"]) == {JSON, PROTO}
    assert {"200", "400", "401", "403", "413", "415", "429", "503"} <= set(operation["responses"])
