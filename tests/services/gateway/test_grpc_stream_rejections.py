"""A gRPC ``Stream`` of invalid events: its rejections were kept without bound for the summary at half-close.
300 messages of 10,000 invalid events grew the server by ~260 MB, and the 170 MB summary could not be sent
(``RESOURCE_EXHAUSTED: Sent message larger than max``), so the client learned nothing of what was queued.
Now a stream whose rejections pass ``max_batch_events`` ends with ``INVALID_ARGUMENT`` naming the first
rejection and what the stream had queued; within the bound the summary is as before. Against ``trainguard
serve`` (EmbeddedServer: gRPC on 127.0.0.1), ``max_batch_events`` lowered to 100 to keep it small."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import grpc
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard import wire
from trainguard.v1 import ingest_pb2, ingest_pb2_grpc

LIMIT = 100


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data"), max_batch_events=LIMIT) as server:
        yield server


def _message(run_id: str, bad: int) -> ingest_pb2.IngestRequest:
    events: List[Dict[str, Any]] = [event(run_id)] + [{**event(run_id), "event_id": ""} for _ in range(bad)]
    return wire.ingest_request_from_dicts(events)


def _stream(live: LiveServer, messages: List[ingest_pb2.IngestRequest]) -> ingest_pb2.IngestResponse:
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        response: ingest_pb2.IngestResponse = stub.Stream(
            iter(messages), timeout=30, metadata=(("authorization", f"Bearer {live.ingest_token}"),))
        return response


def test_a_stream_rejecting_more_than_max_batch_events_ends_saying_what_it_queued(live: LiveServer) -> None:
    with pytest.raises(grpc.RpcError) as ended:
        _stream(live, [_message("stream-bad", 60) for _ in range(3)])  # was: all 180 kept for the summary
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ended.value.details() == (
        f"more than max_batch_events={LIMIT} events of this stream were rejected (the first: events[1].event_id: "
        f"required); fix what sends them (after 122 events of this stream; 2 of them were queued, re-sending "
        f"them is safe)")
    live.wait_for(lambda: live.get("/api/v1/runs/stream-bad").status_code == 200)


def test_a_stream_within_the_bound_answers_its_summary(live: LiveServer) -> None:
    response = _stream(live, [_message("stream-ok", 30) for _ in range(3)])
    assert response.accepted == 3 and len(response.rejected) == 90
    assert [r.index for r in response.rejected[:2]] == [1, 2] and response.rejected[30].index == 32
