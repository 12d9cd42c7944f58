"""Issue 18 fuzz (found by tests/fuzz/test_fuzz_grpc_decode.py): an envelope holding protobuf groups nested
exactly 100 deep parses on its own but not inside an IngestRequest (one level more than upb's nesting limit
of 100). ``batch_from_protobuf`` checked each envelope alone, kept it, and then failed to parse the request
it rebuilt: a ``DecodeError`` escaped -- gRPC answered INTERNAL, HTTP protobuf ingest 500, and the valid
events of the batch were lost. Now such an envelope is rejected on its own (``invalid_field``) and the
others are queued, in process, over gRPC and over HTTP (real servers on 127.0.0.1)."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import grpc
import httpx
import pytest
from fastapi import FastAPI
from google.protobuf.message import DecodeError

from tests.services.gateway.helpers import (
    ControlledQueue,
    Tokens,
    UvicornThread,
    drain,
    frame,
    metric_event,
    new_gateway,
)
from trainguard import wire
from trainguard.v1 import events_pb2, ingest_pb2
from trainguard_server.gateway.grpc import build_grpc_server
from trainguard_server.gateway.http import ingest_router
from trainguard_server.gateway.ingest import Gateway, batch_from_protobuf


def _groups(depth: int, field: int = 99) -> bytes:
    """An unknown field ``field`` (start-group wire type) holding groups nested ``depth`` deep."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)
    return varint(field << 3 | 3) * depth + varint(field << 3 | 4) * depth


def _body(depth: int) -> Tuple[bytes, List[str]]:
    """A serialized IngestRequest: good, deep (a valid metrics envelope plus the nested groups), good."""
    good = [metric_event(0), metric_event(1)]
    deep = wire.envelope_from_dict(metric_event(2)).SerializeToString() + _groups(depth)
    parts = [wire.envelope_from_dict(good[0]).SerializeToString(), deep,
             wire.envelope_from_dict(good[1]).SerializeToString()]
    return b"".join(frame(p) for p in parts), [e["event_id"] for e in good]


def test_the_limit_case_parses_alone_but_not_in_a_request() -> None:
    """The premise: 100 levels pass Envelope alone, not IngestRequest (upb's limit counts the wrapper)."""
    events_pb2.Envelope.FromString(_groups(100))
    with pytest.raises(DecodeError):
        ingest_pb2.IngestRequest.FromString(frame(_groups(100)))


@pytest.mark.parametrize("depth", [99, 100, 101, 300])
def test_batch_from_protobuf_rejects_only_the_deep_envelope(depth: int) -> None:
    raw, good_ids = _body(depth)
    batch = batch_from_protobuf(raw)  # depth 100 raised DecodeError here
    assert batch.count == 3
    if depth < 100:  # nesting protobuf can hold: the envelope is valid (unknown fields are ignored)
        assert not batch.rejected and len(batch.request.events) == 3
        return
    assert [e.event_id for e in batch.request.events] == good_ids
    assert batch.indices == [0, 2]
    [rejected] = batch.rejected
    assert (rejected.index, rejected.code) == (1, "invalid_field")
    assert rejected.message.startswith("events[1]: malformed protobuf")


@pytest.fixture(scope="module")
def gateway() -> Iterator[Tuple[Gateway, ControlledQueue, Tokens]]:
    yield new_gateway()


def test_grpc_send_keeps_the_valid_events(gateway: Tuple[Gateway, ControlledQueue, Tokens]) -> None:
    gw, queue, tokens = gateway
    server, port = build_grpc_server(gw, "127.0.0.1", 0, gw.settings.max_batch_bytes, workers=2)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            send = channel.unary_unary("/trainguard.v1.IngestService/Send", request_serializer=None,
                                       response_deserializer=ingest_pb2.IngestResponse.FromString)
            raw, good_ids = _body(100)
            response = send(raw, metadata=(("authorization", f"Bearer {tokens.ingest}"),), timeout=10)
    finally:
        server.stop(None).wait(5)
    assert response.accepted == 2  # was INTERNAL "internal error: DecodeError ..."
    assert [(r.index, r.code) for r in response.rejected] == [(1, "invalid_field")]
    assert [e.event_id for _, e in drain(queue)] == good_ids


def test_http_protobuf_ingest_keeps_the_valid_events(gateway: Tuple[Gateway, ControlledQueue, Tokens]) -> None:
    gw, queue, tokens = gateway
    app = FastAPI()
    app.include_router(ingest_router(gw))
    raw, good_ids = _body(100)
    with UvicornThread(app) as uv, httpx.Client(base_url=uv.url, timeout=30) as client:
        r = client.post("/v1/ingest", content=raw, headers={"Authorization": f"Bearer {tokens.ingest}",
                                                             "Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text  # was 500
    response = ingest_pb2.IngestResponse.FromString(r.content)
    assert response.accepted == 2
    assert [(x.index, x.code) for x in response.rejected] == [(1, "invalid_field")]
    assert [e.event_id for _, e in drain(queue)] == good_ids
