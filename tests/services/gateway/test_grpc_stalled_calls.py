"""gRPC ``Send`` calls whose message stops one byte short (sent by hand over HTTP/2: ``grpc_raw.py``) are held
by gRPC's core, before the servicer runs; nothing bounded them (security.md H34). Before stop 42 the servicer
was a unary handler (called once the message had arrived whole) and gRPC's bandwidth-delay probing raised
every stream's window to 32-64 MiB: 4 connections x 100 such calls without a token took ``trainguard serve``
from 78 MB to 3.2 GB. Now ``Send`` is served as client-streaming: the token is checked and ``max_batch_bytes``
reserved in the bounds on ingest bytes in flight before the message is read; a call waiting for room reads
nothing, and a stream not being read holds at most its 64 KiB window (probing off).

Black-box measure: the bytes the server's HTTP/2 flow control let the client send, which is what the server
agreed to hold. Real ``build_grpc_server`` on 127.0.0.1."""

from __future__ import annotations

import time
from typing import Any, Iterator, List

import grpc
import pytest

from tests.services.gateway.grpc_raw import StalledCalls
from tests.services.gateway.helpers import metric_event, new_gateway
from trainguard import wire
from trainguard.v1 import ingest_pb2_grpc
from trainguard_server.gateway.grpc import build_grpc_server

MiB = 2**20
MESSAGE = 8 * MiB - 64  # under max_batch_bytes
CALLS = 20
UNAUTHENTICATED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 16, 4, 8


@pytest.fixture
def served() -> Iterator[Any]:
    gateway, _queue, tokens = new_gateway(max_batch_bytes=8 * MiB, max_event_bytes=MiB,
                                          ingest_max_inflight_bytes=64 * MiB, project_max_inflight_bytes=32 * MiB,
                                          grpc_stream_idle_timeout_s=4.0)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, 8 * MiB)
    server.start()
    opened: List[StalledCalls] = []
    try:
        yield gateway, tokens, port, opened
    finally:
        for calls in opened:
            calls.close()
        server.stop(None).wait(10)


def _open(opened: List[StalledCalls], port: int, token: Any) -> StalledCalls:
    calls = StalledCalls("127.0.0.1", port, CALLS, MESSAGE, token=token)
    opened.append(calls)
    calls.pump(quiet_s=1.0, deadline_s=30)
    return calls


def _until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_stalled_sends_of_a_project_are_held_within_its_bound_and_another_project_is_served(served: Any) -> None:
    gateway, tokens, port, opened = served
    calls = _open(opened, port, tokens.other_project)
    # 4 calls read (32 MiB: the project's bound, reserved at max_batch_bytes each), 16 wait unread (64 KiB)
    assert calls.sent_bytes <= 32 * MiB + CALLS * 128 * 1024, calls.sent_bytes  # was 20 x 8 MiB = 160 MiB
    assert gateway.body_bytes is not None and gateway.body_bytes.held("other") == 32 * MiB
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # another project: served meanwhile
        reply = ingest_pb2_grpc.IngestServiceStub(channel).Send(
            wire.ingest_request_from_dicts([metric_event()]), timeout=20,
            metadata=(("authorization", f"Bearer {tokens.ingest}"),))
    assert reply.accepted == 1
    # a waiting call is refused after the receive wait (5 s), a stalled one after the idle timeout (4 s; then
    # waiting calls take its room and stall in turn): every call ends, and everything is given back
    _until(lambda: len(calls.status) == CALLS)
    codes = sorted(calls.status.values())
    assert set(codes) == {DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED} and codes.count(DEADLINE_EXCEEDED) >= 4, codes
    _until(lambda: gateway.body_bytes.held() == 0)


def test_sends_without_a_valid_token_are_refused_before_their_message_is_read(served: Any) -> None:
    gateway, tokens, port, opened = served
    calls = _open(opened, port, None)
    _until(lambda: len(calls.status) == CALLS)
    assert set(calls.status.values()) == {UNAUTHENTICATED}
    assert calls.sent_bytes <= CALLS * 128 * 1024, calls.sent_bytes  # was 160 MiB, read whole before the check
    revoked = _open(opened, port, tokens.revoked)
    _until(lambda: len(revoked.status) == CALLS)
    assert revoked.sent_bytes <= CALLS * 128 * 1024, revoked.sent_bytes
    assert gateway.body_bytes is not None and gateway.body_bytes.held() == 0


def test_a_closed_connection_gives_its_calls_reservations_back_at_once() -> None:
    gateway, _queue, tokens = new_gateway(max_batch_bytes=8 * MiB, max_event_bytes=MiB,
                                          ingest_max_inflight_bytes=64 * MiB, project_max_inflight_bytes=32 * MiB,
                                          grpc_stream_idle_timeout_s=120.0)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, 8 * MiB)
    server.start()
    try:
        calls = StalledCalls("127.0.0.1", port, CALLS, MESSAGE, token=tokens.other_project)
        calls.pump(quiet_s=1.0, deadline_s=30)
        assert gateway.body_bytes is not None and gateway.body_bytes.held("other") == 32 * MiB
        calls.close()
        _until(lambda: gateway.body_bytes.held() == 0, timeout=20)  # not after the 120 s idle timeout
    finally:
        server.stop(None).wait(10)


def test_concurrent_sends_past_the_reserved_room_wait_for_it_and_are_all_accepted() -> None:
    """The reservation waits rather than refuses: 24 concurrent Sends of one project whose bound holds two
    reservations (2 x max_batch_bytes) are all accepted, none RESOURCE_EXHAUSTED (a refusing design would answer
    most of them retry-after, and the SDK would wait 1 s per batch)."""
    from concurrent.futures import ThreadPoolExecutor

    gateway, _queue, tokens = new_gateway(max_batch_bytes=MiB, max_event_bytes=MiB, max_batch_events=500,
                                          ingest_max_inflight_bytes=4 * MiB, project_max_inflight_bytes=2 * MiB)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, MiB)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            send = ingest_pb2_grpc.IngestServiceStub(channel).Send

            def one(k: int) -> int:
                request = wire.ingest_request_from_dicts([metric_event(step=k * 100 + i) for i in range(50)])
                reply = send(request, timeout=30, metadata=(("authorization", f"Bearer {tokens.ingest}"),))
                return int(reply.accepted)

            with ThreadPoolExecutor(24) as pool:
                assert list(pool.map(one, range(24))) == [50] * 24
        assert gateway.body_bytes is not None and gateway.body_bytes.held() == 0
    finally:
        server.stop(None).wait(10)


def test_a_send_finding_no_room_is_refused_after_grpc_receive_wait_s() -> None:
    gateway, _queue, tokens = new_gateway(max_batch_bytes=8 * MiB, max_event_bytes=MiB,
                                          ingest_max_inflight_bytes=64 * MiB, project_max_inflight_bytes=8 * MiB,
                                          grpc_stream_idle_timeout_s=60.0, grpc_receive_wait_s=0.5)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, 8 * MiB)
    server.start()
    stalled = StalledCalls("127.0.0.1", port, 1, MESSAGE, token=tokens.ingest)  # holds the project's 8 MiB
    try:
        stalled.pump(quiet_s=1.0, deadline_s=30)
        assert gateway.body_bytes is not None and gateway.body_bytes.held() == 8 * MiB
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                ingest_pb2_grpc.IngestServiceStub(channel).Send(
                    wire.ingest_request_from_dicts([metric_event()]), timeout=30,
                    metadata=(("authorization", f"Bearer {tokens.ingest}"),))
            waited = time.monotonic() - started
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "TRAINGUARD_GRPC_RECEIVE_WAIT_S" in (refused.value.details() or "")
        assert "TRAINGUARD_PROJECT_MAX_INFLIGHT_BYTES" in (refused.value.details() or "")
        assert 0.4 <= waited < 20, waited  # it waited (0.5 s), then was refused; not the 60 s idle timeout
    finally:
        stalled.close()
        server.stop(None).wait(10)


def test_a_send_with_no_message_is_invalid_argument(served: Any) -> None:
    gateway, tokens, port, opened = served
    calls = StalledCalls("127.0.0.1", port, 3, 0, token=tokens.ingest, no_message=True)
    opened.append(calls)
    _until(lambda: len(calls.status) == 3, timeout=20)
    assert set(calls.status.values()) == {3}, calls.status  # INVALID_ARGUMENT "Send carried no message"
    assert gateway.body_bytes is not None and gateway.body_bytes.held() == 0


def test_stalled_streams_of_a_project_are_held_within_its_bound_and_another_project_is_served(
        served: Any) -> None:
    """``Stream`` calls (16: ``grpc_max_streams_per_token``) each sending 8 MB less one byte of a message, then
    nothing (security.md H36). Before stop 43 a Stream's next message was read before it was counted: all 16
    were received, 128 MiB per token held for the idle timeout outside every bound (3 such tokens: 384 MiB)."""
    gateway, tokens, port, opened = served
    calls = StalledCalls("127.0.0.1", port, 16, MESSAGE, method="/trainguard.v1.IngestService/Stream",
                         token=tokens.other_project)
    opened.append(calls)
    calls.pump(quiet_s=1.0, deadline_s=30)
    # 3 streams read (the Streams' share: the project's 32 MiB less one max_batch_bytes, so its Sends and HTTP
    # bodies still find room), 13 wait unread (64 KiB each)
    assert calls.sent_bytes <= 24 * MiB + 16 * 128 * 1024, calls.sent_bytes  # was 16 x 8 MiB = 128 MiB
    assert gateway.body_bytes is not None and gateway.body_bytes.held("other") == 24 * MiB
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # another project: served meanwhile
        reply = ingest_pb2_grpc.IngestServiceStub(channel).Send(
            wire.ingest_request_from_dicts([metric_event()]), timeout=20,
            metadata=(("authorization", f"Bearer {tokens.ingest}"),))
    assert reply.accepted == 1
    calls.close()
    _until(lambda: gateway.body_bytes.held() == 0)
