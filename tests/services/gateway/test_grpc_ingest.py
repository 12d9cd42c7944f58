"""gRPC ingest (``trainguard.v1.IngestService``) on a real grpc server on 127.0.0.1, driven by the SDK's own
GrpcTransport and by raw stubs. Every bad input asserts the exact status code and details, and every test
ends by checking that the same server still acknowledges a good batch."""

from __future__ import annotations

import email.utils
import gzip
import math
import sqlite3
from concurrent import futures
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import pytest

from tests.services.gateway.helpers import (
    NOW_NS,
    RUN,
    ControlledQueue,
    Tokens,
    drain,
    exception_event,
    frame,
    metric_event,
    new_gateway,
)
from trainguard import wire
from trainguard.transport.base import TransportError
from trainguard.transport.grpc import GrpcTransport
from trainguard.v1 import events_pb2, ingest_pb2, ingest_pb2_grpc
from trainguard_server.gateway.grpc import IngestServicer, build_grpc_server
from trainguard_server.gateway.ingest import Gateway

LIMIT = 256 * 1024  # gateway_settings().max_batch_bytes


class Server:
    def __init__(self, gateway: Gateway, queue: ControlledQueue, tokens: Tokens, target: str) -> None:
        self.gateway, self.queue, self.tokens, self.target = gateway, queue, tokens, target
        # the client may send more than the server takes: the server's limit is what is tested
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 2**20)])
        self.stub = ingest_pb2_grpc.IngestServiceStub(self.channel)
        self.raw_send = self.channel.unary_unary("/trainguard.v1.IngestService/Send", request_serializer=None,
                                                 response_deserializer=ingest_pb2.IngestResponse.FromString)

    def md(self, token: str = "ingest") -> Tuple[Tuple[str, str], ...]:
        return (("authorization", f"Bearer {getattr(self.tokens, token)}"),)

    def send(self, events: Sequence[Any], token: str = "ingest") -> ingest_pb2.IngestResponse:
        return self.stub.Send(wire.ingest_request_from_dicts(events), metadata=self.md(token), timeout=10)

    def queued(self) -> List[Tuple[str, events_pb2.Envelope]]:
        return drain(self.queue)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    gateway, queue, tokens = new_gateway()
    grpc_server, port = build_grpc_server(gateway, "127.0.0.1", 0, gateway.settings.max_batch_bytes, workers=4)
    grpc_server.start()
    srv = Server(gateway, queue, tokens, f"127.0.0.1:{port}")
    yield srv
    srv.channel.close()
    grpc_server.stop(None).wait(5)


@pytest.fixture
def srv(server: Server) -> Iterator[Server]:
    """The shared server with an empty queue; afterwards it must still acknowledge a good batch."""
    server.queue.full, server.queue.broken, server.queue.full_after = False, None, None
    server.queued()
    yield server
    server.queue.full, server.queue.broken, server.queue.full_after = False, None, None
    server.queued()
    event = metric_event()
    response = server.send([event])
    assert (response.accepted, response.duplicates, list(response.rejected)) == (1, 0, [])
    assert [e.event_id for _, e in server.queued()] == [event["event_id"]]


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value  # type: ignore[return-value]


def trailing(err: Any) -> Dict[str, str]:
    """The call's trailing metadata but its ``date`` (every answer carries one: checked here)."""
    metadata = {k: v for k, v in (err.trailing_metadata() or ())}
    assert email.utils.parsedate_to_datetime(metadata.pop("date")).tzinfo is not None, metadata
    return metadata


def rejected(response: ingest_pb2.IngestResponse) -> List[Dict[str, Any]]:
    return [{"index": r.index, "event_id": r.event_id, "code": r.code, "message": r.message}
            for r in response.rejected]


# ------------------------------------------------------------------------------------------ happy paths

def test_sdk_grpc_transport_end_to_end(srv: Server) -> None:
    transport = GrpcTransport(srv.target, srv.tokens.ingest)  # gzip-compressed, like the SDK always sends
    try:
        events = [metric_event(i) for i in range(50)]
        result = transport.send(events, 5)
        assert (result.accepted, result.duplicates, result.rejected) == (50, 0, [])
        queued = srv.queued()
        assert [(k, e.event_id) for k, e in queued] == [(RUN, d["event_id"]) for d in events]
        assert wire.envelope_to_dict(queued[7][1]) == wire.envelope_to_dict(wire.envelope_from_dict(events[7]))
        bad = metric_event(3, run_id="")
        result = transport.send([metric_event(1), bad], 5)
        assert (result.accepted, result.rejected) == (1, [
            {"index": 1, "event_id": bad["event_id"], "code": "missing_field", "message": "events[1].run_id: required"}])
    finally:
        transport.close()


def test_received_bytes_are_queued_as_sent(srv: Server) -> None:
    request = wire.ingest_request_from_dicts([metric_event(i) for i in range(5)])
    srv.stub.Send(request, metadata=srv.md(), timeout=10)
    records = srv.queue.consume(10, 0)
    srv.queue.commit(records)
    assert [r.value for r in records] == [request.SerializeToString()]


def test_non_finite_values(srv: Server) -> None:
    event = metric_event()
    event["metrics"]["points"] = [{"name": "loss", "value": math.nan}, {"name": "gn", "value": math.inf},
                                  {"name": "m", "value": -math.inf}]
    assert srv.send([event]).accepted == 1
    points = srv.queued()[0][1].metrics.points
    assert math.isnan(points[0].value) and (points[1].value, points[2].value) == (math.inf, -math.inf)


def test_stream_indexes_and_deduplicates_across_messages(srv: Server) -> None:
    first = [metric_event(i) for i in range(3)]
    second = [metric_event(10), dict(first[1]), metric_event(12, project="other")]
    requests = [wire.ingest_request_from_dicts(first), wire.ingest_request_from_dicts(second)]
    response = srv.stub.Stream(iter(requests), metadata=srv.md(), timeout=10)
    assert (response.accepted, response.duplicates) == (4, 1)
    assert rejected(response) == [{"index": 5, "event_id": second[2]["event_id"], "code": "wrong_project",
                                   "message": "events[5].project: \"other\" does not match the token's "
                                              "project \"llm\""}]
    assert [e.step for _, e in srv.queued()] == [0, 1, 2, 10]


def test_servicer_also_works_with_the_generated_registration(srv: Server) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    ingest_pb2_grpc.add_IngestServiceServicer_to_server(IngestServicer(srv.gateway), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ingest_pb2_grpc.IngestServiceStub(channel)
            request = wire.ingest_request_from_dicts([metric_event(0), metric_event(1, project="")])
            assert stub.Send(request, metadata=srv.md(), timeout=10).accepted == 2
    finally:
        server.stop(None).wait(5)
    assert [e.project for _, e in srv.queued()] == ["llm", "llm"]


# ------------------------------------------------------------------------------------- per-item results

def test_mixed_batch_queues_the_good_events(srv: Server) -> None:
    good = [metric_event(i) for i in range(3)]
    no_id = metric_event(10, event_id="")
    no_payload = metric_event(11)
    del no_payload["metrics"]
    future = metric_event(12, time_unix_nano=NOW_NS + 600 * 10**9)
    past = metric_event(13, time_unix_nano=NOW_NS - 90_000 * 10**9)
    frames = exception_event(frames=65)
    response = srv.send([good[0], no_id, no_payload, good[1], future, past, dict(good[0]), frames, good[2]])
    assert (response.accepted, response.duplicates) == (3, 1)
    assert rejected(response) == [
        {"index": 1, "event_id": "", "code": "missing_field", "message": "events[1].event_id: required"},
        {"index": 2, "event_id": no_payload["event_id"], "code": "missing_field",
         "message": "events[2].payload: required (one of metrics, exception, lifecycle, heartbeat, log, memory)"},
        {"index": 4, "event_id": future["event_id"], "code": "out_of_range",
         "message": f"events[4].time_unix_nano: {NOW_NS + 600 * 10**9} is 600 s ahead of the server clock "
                    f"(max_future_skew_s=300)"},
        {"index": 5, "event_id": past["event_id"], "code": "out_of_range",
         "message": f"events[5].time_unix_nano: {NOW_NS - 90_000 * 10**9} is 90000 s before the server clock "
                    f"(max_past_age_s=86400)"},
        {"index": 7, "event_id": frames["event_id"], "code": "too_large",
         "message": "events[7].exception.frames: 65 frames exceeds max_frames=64"},
    ]
    assert [e.event_id for _, e in srv.queued()] == [d["event_id"] for d in good]


def test_unknown_payload_and_corrupt_envelope(srv: Server) -> None:
    newer = wire.envelope_from_dict(metric_event(1))
    newer.ClearField("metrics")
    newer_bytes = newer.SerializeToString() + b"\xd2\x01\x00"  # payload field 26 from a newer schema
    good = wire.envelope_from_dict(metric_event(0)).SerializeToString()
    body = frame(good) + frame(newer_bytes) + frame(b"\x0a\x02\xc3\x28")
    response = srv.raw_send(body, metadata=srv.md(), timeout=10)
    assert response.accepted == 1
    assert rejected(response) == [
        {"index": 1, "event_id": newer.event_id, "code": "unknown_payload",
         "message": "events[1]: unknown payload (field number 26); this backend knows metrics, exception, "
                    "lifecycle, heartbeat, log, memory"},
        {"index": 2, "event_id": "", "code": "invalid_field",
         "message": "events[2]: malformed protobuf: String field had bad UTF-8"}]
    assert [e.step for _, e in srv.queued()] == [0]


# ------------------------------------------------------------------------------------ whole-request errors

@pytest.mark.parametrize(("token", "details"), [
    (None, "missing bearer token (send 'Authorization: Bearer <ingest token>')"),
    ("Bearer nope", "invalid or revoked token"),
    ("Token abc", "authorization scheme 'Token' is not supported; use 'Bearer <ingest token>'"),
    ("revoked", "invalid or revoked token"),
])
def test_unauthenticated(srv: Server, token: Optional[str], details: str) -> None:
    if token == "revoked":
        md: Tuple[Tuple[str, str], ...] = srv.md("revoked")
    else:
        md = (("authorization", token),) if token else ()
    request = wire.ingest_request_from_dicts([metric_event()])
    err = rpc_error(srv.stub.Send, request, metadata=md, timeout=10)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
    err = rpc_error(srv.stub.Stream, iter([request]), metadata=md, timeout=10)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
    assert srv.queued() == []


def test_read_token_is_permission_denied(srv: Server) -> None:
    transport = GrpcTransport(srv.target, srv.tokens.read)
    try:
        with pytest.raises(TransportError) as info:
            transport.send([metric_event()], 5)
    finally:
        transport.close()
    assert (info.value.status, info.value.retryable) == ("PERMISSION_DENIED", False)
    assert str(info.value) == "grpc PERMISSION_DENIED: token is not an ingest token"
    assert srv.queued() == []


def test_malformed_protobuf_is_invalid_argument(srv: Server) -> None:
    err = rpc_error(srv.raw_send, b"\x0a\x10abc", metadata=srv.md(), timeout=10)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed protobuf: body is not a serialized trainguard.v1.IngestRequest (Wire format was corrupt)")


def test_oversized_message_is_refused_by_grpc_and_the_sdk_splits(srv: Server) -> None:
    request = wire.ingest_request_from_dicts([metric_event(i) for i in range(1500)])
    size = request.ByteSize()
    assert size > LIMIT
    err = rpc_error(srv.stub.Send, request, metadata=srv.md(), timeout=10)
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"SERVER: Received message larger than max ({size} vs. {LIMIT})")
    # the SDK reads this as "413: split the batch", not as throttling to retry
    transport = GrpcTransport(srv.target, srv.tokens.ingest, max_message_bytes=16 * 2**20, compression=False)
    try:
        with pytest.raises(TransportError) as info:
            transport.send([metric_event(i) for i in range(1500)], 5)
    finally:
        transport.close()
    assert (info.value.status, info.value.retryable) == ("413", False)
    assert srv.queued() == []


def test_gzip_bomb_is_refused_after_decompression(srv: Server) -> None:
    event = wire.envelope_from_dict(metric_event())
    event.run_name = "x" * (LIMIT * 4)  # compresses to a few KiB
    body = ingest_pb2.IngestRequest(events=[event]).SerializeToString()
    assert len(gzip.compress(body)) < LIMIT
    err = rpc_error(srv.raw_send, body, metadata=srv.md(), timeout=10, compression=grpc.Compression.Gzip)
    # gRPC core inflates at most max_receive_message_length bytes and says so (without the numbers);
    # "larger than max" is what the SDK reads as "413: split the batch"
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "Decompressed message larger than max")
    assert srv.queued() == []


def test_too_many_events(srv: Server) -> None:
    err = rpc_error(srv.send, [metric_event(i) for i in range(201)])
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "request has 201 events, larger than max_batch_events=200; split the batch")
    assert srv.queued() == []


def test_backpressure_resource_exhausted_with_retry_after(srv: Server) -> None:
    srv.queue.full = True
    err = rpc_error(srv.send, [metric_event(i) for i in range(5)])
    assert (err.code(), err.details(), trailing(err)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "ingest queue is full (depth 50000 over max_queue_depth=50000); retry after 2 s", {"retry-after": "2"})
    transport = GrpcTransport(srv.target, srv.tokens.ingest)
    try:
        with pytest.raises(TransportError) as info:
            transport.send([metric_event()], 5)
    finally:
        transport.close()
    assert (info.value.status, info.value.retryable, info.value.retry_after) == ("RESOURCE_EXHAUSTED", True, 2.0)
    srv.queue.full = False
    assert srv.queued() == []


def test_queue_failure_is_unavailable_with_retry_after(srv: Server) -> None:
    srv.queue.broken = sqlite3.OperationalError("database or disk is full")
    err = rpc_error(srv.send, [metric_event()])
    assert (err.code(), err.details(), trailing(err)) == (
        grpc.StatusCode.UNAVAILABLE, "ingest queue unavailable: OperationalError: database or disk is full",
        {"retry-after": "3"})
    srv.queue.broken = None
    assert srv.queued() == []


def test_backpressure_mid_stream_keeps_what_was_queued(srv: Server) -> None:
    first = [metric_event(i) for i in range(3)]

    requests = [wire.ingest_request_from_dicts(first), wire.ingest_request_from_dicts([metric_event(9)])]
    srv.queue.full_after = srv.queue.publishes + 1
    err = rpc_error(srv.stub.Stream, iter(requests), metadata=srv.md(), timeout=10)
    srv.queue.full, srv.queue.full_after = False, None
    assert (err.code(), err.details(), trailing(err)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "ingest queue is full (depth 50000 over max_queue_depth=50000); retry after 2 s (after 3 events of this "
        "stream; 3 of them were queued, re-sending them is safe)", {"retry-after": "2"})
    assert [e.step for _, e in srv.queued()] == [0, 1, 2]


def test_malformed_message_mid_stream(srv: Server) -> None:
    raw_stream = srv.channel.stream_unary("/trainguard.v1.IngestService/Stream", request_serializer=None,
                                          response_deserializer=ingest_pb2.IngestResponse.FromString)
    good = wire.ingest_request_from_dicts([metric_event(0)]).SerializeToString()
    err = rpc_error(raw_stream, iter([good, b"\x0a\x10abc"]), metadata=srv.md(), timeout=10)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed protobuf: body is not a serialized trainguard.v1.IngestRequest (Wire format was corrupt) "
        "(after 1 events of this stream; 1 of them were queued, re-sending them is safe)")
    assert [e.step for _, e in srv.queued()] == [0]


def test_binding_a_taken_port_fails_clearly(srv: Server) -> None:
    port = int(srv.target.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"^cannot bind gRPC ingest to 127.0.0.1:{port}$"):
        build_grpc_server(srv.gateway, "127.0.0.1", port, LIMIT)
