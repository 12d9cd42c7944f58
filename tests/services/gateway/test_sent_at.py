"""The gateway's clock correction from a request's ``x-trainguard-sent-at`` (gateway/sent_at.py), over a real
uvicorn (HTTP) and a real grpc.aio server. The gateway's clock is pinned at NOW_NS; each request says it was
sent by a clock an hour behind or ahead, the way a job on a host with a wrong clock sends its FIRST batch,
before any answer told the SDK the offset (before: that batch was stored an hour old, or refused)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Tuple

import grpc
import httpx
import pytest
from fastapi import FastAPI

from tests.services.gateway.helpers import (
    NOW_NS,
    ControlledQueue,
    Tokens,
    UvicornThread,
    drain,
    metric_event,
    new_gateway,
)
from trainguard import wire
from trainguard.v1 import events_pb2, ingest_pb2_grpc
from trainguard_server.gateway.grpc import build_grpc_server
from trainguard_server.gateway.http import ingest_router
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.gateway.sent_at import SENT_AT_HEADER, clock_offset, shift_times

HOUR = 3600 * 10**9


# ------------------------------------------------------------------------------------------------ units

@pytest.mark.parametrize(("values", "expected"), [
    ([], 0),                                            # older senders: nothing
    ([str(NOW_NS - 29 * 10**9)], 0),                    # under the threshold: left alone
    ([str(NOW_NS - HOUR)], HOUR),                       # an hour behind: shifted forward
    ([str(NOW_NS + HOUR + 400_000_000)], -HOUR),        # ahead, rounded to whole seconds
    ([f" {NOW_NS - 45 * 10**9} "], 45 * 10**9),         # blanks around the number are fine
])
def test_clock_offset(values: List[str], expected: int) -> None:
    assert clock_offset(values, NOW_NS, 30.0) == expected


def test_clock_offset_zero_threshold_never_shifts_but_still_checks_the_value() -> None:
    assert clock_offset([str(NOW_NS - HOUR)], NOW_NS, 0.0) == 0
    with pytest.raises(ValueError, match="is not a time in unix nanoseconds"):
        clock_offset(["soon"], NOW_NS, 0.0)


@pytest.mark.parametrize(("values", "message"), [
    (["-5"], "'-5' is not a time in unix nanoseconds"),
    (["1.7e18"], "'1.7e18' is not a time in unix nanoseconds"),
    (["9" * 20], "is not a time in unix nanoseconds"),
    (["\uff11\uff12\uff13"], "is not a time in unix nanoseconds"),  # fullwidth digits
    (["1", "2"], "x-trainguard-sent-at given 2 times: send it once"),
])
def test_clock_offset_refuses_malformed_values(values: List[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        clock_offset(values, NOW_NS, 30.0)


def test_shift_times_moves_only_set_times_and_keeps_int64() -> None:
    events = [events_pb2.Envelope(time_unix_nano=NOW_NS - HOUR), events_pb2.Envelope(time_unix_nano=0),
              events_pb2.Envelope(time_unix_nano=2**63 - 10)]
    assert shift_times(events, HOUR) == [0]  # 0 is filled in later; the third would overflow int64
    assert [e.time_unix_nano for e in events] == [NOW_NS, 0, 2**63 - 10]
    assert shift_times(events, 0) == []


# ------------------------------------------------------------------------------------------------- HTTP

class HttpServer:
    def __init__(self, gateway: Gateway, queue: ControlledQueue, tokens: Tokens, url: str) -> None:
        self.gateway, self.queue, self.tokens = gateway, queue, tokens
        self.client = httpx.Client(base_url=url, timeout=10)

    def post(self, events: List[Dict[str, Any]], headers: Dict[str, str]) -> httpx.Response:
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {self.tokens.ingest}", **headers}
        return self.client.post("/v1/ingest", content=json.dumps({"events": events}).encode(), headers=h)


@pytest.fixture(scope="module")
def http() -> Iterator[HttpServer]:
    gateway, queue, tokens = new_gateway(clock_skew_correct_s=30.0)
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv:
        srv = HttpServer(gateway, queue, tokens, uv.url)
        yield srv
        srv.client.close()


def _stamped(skew_ns: int, n: int = 3) -> List[Dict[str, Any]]:
    """What a job whose clock is ``skew_ns`` off sends: its events stamped by that clock."""
    return [metric_event(step, time_unix_nano=NOW_NS + skew_ns - 1000 + step) for step in range(n)]


@pytest.mark.parametrize("skew", [-HOUR, HOUR, -35 * 86400 * 10**9])
def test_http_first_batch_of_a_wrong_clock_is_stored_at_the_servers_time(http: HttpServer, skew: int) -> None:
    drain(http.queue)
    events = _stamped(skew)
    r = http.post(events, {SENT_AT_HEADER: str(NOW_NS + skew)})
    # before: an hour behind stored an hour old; an hour ahead or 35 days behind refused out_of_range
    assert (r.status_code, r.json()) == (200, {"accepted": 3, "duplicates": 0, "rejected": []})
    queued = [e for _, e in drain(http.queue)]
    assert [e.event_id for e in queued] == [e["event_id"] for e in events]
    assert [e.time_unix_nano for e in queued] == [NOW_NS - 1000 + k for k in range(3)]


def test_http_without_the_header_nothing_is_shifted(http: HttpServer) -> None:
    drain(http.queue)
    events = _stamped(-HOUR)
    r = http.post(events, {})
    assert r.json()["accepted"] == 3
    assert [e.time_unix_nano for _, e in drain(http.queue)] == [e["time_unix_nano"] for e in events]


def test_http_malformed_header_is_a_400_and_queues_nothing(http: HttpServer) -> None:
    drain(http.queue)
    r = http.post(_stamped(0), {SENT_AT_HEADER: "yesterday"})
    assert r.status_code == 400
    assert r.json() == {"detail": "x-trainguard-sent-at: 'yesterday' is not a time in unix nanoseconds "
                                  "(one unsigned integer)"}
    assert drain(http.queue) == []
    good = _stamped(0, 1)
    assert http.post(good, {SENT_AT_HEADER: str(NOW_NS)}).json()["accepted"] == 1  # the server goes on


# ------------------------------------------------------------------------------------------------- gRPC

@pytest.fixture(scope="module")
def grpc_server() -> Iterator[Tuple[Gateway, ControlledQueue, Tokens, Any]]:
    gateway, queue, tokens = new_gateway(clock_skew_correct_s=30.0)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, gateway.settings.max_batch_bytes, workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield gateway, queue, tokens, ingest_pb2_grpc.IngestServiceStub(channel)
    channel.close()
    server.stop(None).wait(5)


def test_grpc_send_and_stream_are_corrected_from_the_calls_metadata(
        grpc_server: Tuple[Gateway, ControlledQueue, Tokens, Any]) -> None:
    _, queue, tokens, stub = grpc_server
    drain(queue)
    md = (("authorization", f"Bearer {tokens.ingest}"), (SENT_AT_HEADER, str(NOW_NS - HOUR)))
    sent = _stamped(-HOUR)
    assert stub.Send(wire.ingest_request_from_dicts(sent), metadata=md, timeout=10).accepted == 3
    streamed = _stamped(-HOUR, 2)
    messages = iter([wire.ingest_request_from_dicts(streamed[:1]), wire.ingest_request_from_dicts(streamed[1:])])
    assert stub.Stream(messages, metadata=md, timeout=10).accepted == 2
    times = [e.time_unix_nano for _, e in drain(queue)]
    assert times == [NOW_NS - 1000 + k for k in range(3)] + [NOW_NS - 1000 + k for k in range(2)]


def test_grpc_malformed_metadata_is_invalid_argument(grpc_server: Tuple[Gateway, ControlledQueue, Tokens, Any]
                                                     ) -> None:
    _, queue, tokens, stub = grpc_server
    drain(queue)
    md = (("authorization", f"Bearer {tokens.ingest}"), (SENT_AT_HEADER, "12:00"))
    with pytest.raises(grpc.RpcError) as info:
        stub.Send(wire.ingest_request_from_dicts(_stamped(0)), metadata=md, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert info.value.details() == ("x-trainguard-sent-at: '12:00' is not a time in unix "  # type: ignore[attr-defined]
                                    "nanoseconds (one unsigned integer)")
    assert drain(queue) == []


# ----------------------------------------------------------------------------- past int64 (hA2, stop 40)

_PAST_INT64 = "9999999999999999999"  # 19 digits, > 2**63 - 1: before, accepted and silently ignored
_PAST_INT64_MESSAGE = ("x-trainguard-sent-at: '9999999999999999999' is past the int64 range of unix "
                       "nanoseconds (at most 9223372036854775807)")


@pytest.mark.parametrize("min_skew_s", [30.0, 0.0])
def test_clock_offset_refuses_a_time_past_int64(min_skew_s: float) -> None:
    with pytest.raises(ValueError) as info:
        clock_offset([_PAST_INT64], NOW_NS, min_skew_s)
    assert str(info.value) == _PAST_INT64_MESSAGE
    assert clock_offset([str(2**63 - 1)], NOW_NS, 0.0) == 0  # the largest int64 is still a time


def test_http_sent_at_past_int64_is_a_precise_400(http: HttpServer) -> None:
    drain(http.queue)
    r = http.post(_stamped(0), {SENT_AT_HEADER: _PAST_INT64})
    assert (r.status_code, r.json()) == (400, {"detail": _PAST_INT64_MESSAGE})
    assert drain(http.queue) == []


def test_grpc_sent_at_past_int64_is_invalid_argument(grpc_server: Tuple[Gateway, ControlledQueue, Tokens, Any]
                                                     ) -> None:
    _, queue, tokens, stub = grpc_server
    drain(queue)
    md = (("authorization", f"Bearer {tokens.ingest}"), (SENT_AT_HEADER, _PAST_INT64))
    with pytest.raises(grpc.RpcError) as info:
        stub.Send(wire.ingest_request_from_dicts(_stamped(0)), metadata=md, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert info.value.details() == _PAST_INT64_MESSAGE  # type: ignore[attr-defined]
    assert drain(queue) == []
