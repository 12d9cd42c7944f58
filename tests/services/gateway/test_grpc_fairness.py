"""Issue 18, finding 3: idle gRPC streams must not starve other clients. A real server of
``build_grpc_server`` on 127.0.0.1 with the default ``grpc_workers`` (8); the hostile client opens many
``Stream`` calls that never send a message. Before the fix, 8 of them held all 8 worker threads and every
other client's ``Send`` waited until its deadline."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, List, Tuple

import grpc
import pytest

from tests.services.gateway.helpers import PROJECT, drain, metric_event, new_gateway
from trainguard import wire
from trainguard.v1 import ingest_pb2, ingest_pb2_grpc
from trainguard_server.gateway.grpc import build_grpc_server
from trainguard_server.gateway.ingest import Gateway

CALL_TIMEOUT_S = 10.0  # a generous deadline: an answer is expected, how fast is not measured here


def connect(target: str) -> grpc.Channel:
    """A channel with its own connection (grpc shares one per target in a process otherwise), as a
    separate client process would have."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


class IdleStreams:
    """``count`` Stream calls on one channel whose request iterators block until :meth:`release`."""

    def __init__(self, target: str, token: str, count: int, first: List[Any] | None = None) -> None:
        self.release_event = threading.Event()
        self.channel = connect(target)
        stub = ingest_pb2_grpc.IngestServiceStub(self.channel)
        md = (("authorization", f"Bearer {token}"),)
        self.calls = [stub.Stream.future(self._requests(first), metadata=md, timeout=60) for _ in range(count)]

    def _requests(self, first: List[Any] | None) -> Iterator[ingest_pb2.IngestRequest]:
        if first:
            yield wire.ingest_request_from_dicts(first)
        self.release_event.wait(60)  # idle: no message, no half-close

    def release(self) -> None:
        self.release_event.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def serve(**settings: Any) -> Tuple[Any, Gateway, Any, Any, str]:
    gateway, queue, tokens = new_gateway(**settings)
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, gateway.settings.max_batch_bytes)
    server.start()
    return server, gateway, queue, tokens, f"127.0.0.1:{port}"


@pytest.fixture
def stop_later() -> Iterator[List[Any]]:
    started: List[Any] = []
    yield started
    for item in reversed(started):
        if isinstance(item, IdleStreams):
            item.release()
        else:
            item.stop(None).wait(5)


def wait_until(predicate: Callable[[], bool], timeout: float = CALL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def send(target: str, token: str, events: List[Any]) -> ingest_pb2.IngestResponse:
    with connect(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        return stub.Send(wire.ingest_request_from_dicts(events), metadata=(("authorization", f"Bearer {token}"),),
                         timeout=CALL_TIMEOUT_S)


def test_many_idle_streams_do_not_block_another_clients_send(stop_later: List[Any]) -> None:
    server, gateway, queue, tokens, target = serve(grpc_max_streams_per_token=64)
    stop_later.append(server)
    assert gateway.settings.grpc_workers == 8
    # 4 x the worker threads of idle streams, from two tokens of the same project, on two connections
    second = gateway.projects.create_token(PROJECT, "ingest")
    stop_later.append(IdleStreams(target, tokens.ingest, 16, first=[metric_event(20)]))
    stop_later.append(IdleStreams(target, second, 16, first=[metric_event(21)]))
    wait_until(lambda: queue.depth() == 32)  # every idle stream is open on the server, not only in the client
    event = metric_event(1)
    response = send(target, tokens.other_project, [metric_event(2, project="other")])
    assert (response.accepted, list(response.rejected)) == (1, [])
    response = send(target, tokens.ingest, [event])
    assert (response.accepted, list(response.rejected)) == (1, [])
    assert [e.event_id for _, e in drain(queue)][-1] == event["event_id"]
    # and a whole Stream of another client still completes while the idle ones stay open
    with connect(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        requests = [wire.ingest_request_from_dicts([metric_event(i)]) for i in range(3)]
        summary = stub.Stream(iter(requests), metadata=(("authorization", f"Bearer {tokens.other_project}"),),
                              timeout=CALL_TIMEOUT_S)
    assert summary.accepted == 0 and len(summary.rejected) == 3  # other project's token: wrong_project
    assert {r.code for r in summary.rejected} == {"wrong_project"}


def test_streams_per_token_are_bounded(stop_later: List[Any]) -> None:
    server, gateway, queue, tokens, target = serve(grpc_max_streams_per_token=3, retry_after_s=2.0)
    stop_later.append(server)
    stop_later.append(IdleStreams(target, tokens.ingest, 3, first=[metric_event(10)]))
    # each idle stream has sent its first message, so the server holds all 3 open (before: the 4th call could
    # reach the server before one of the 3 futures had, and was served -- CI at cd33fb85 saw it once)
    wait_until(lambda: queue.depth() == 3)
    with connect(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        md = (("authorization", f"Bearer {tokens.ingest}"),)
        with pytest.raises(grpc.RpcError) as info:
            stub.Stream(iter([wire.ingest_request_from_dicts([metric_event(0)])]), metadata=md,
                        timeout=CALL_TIMEOUT_S)
        err: Any = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == ("too many open streams for this token (3, grpc_max_streams_per_token): end "
                                 "one, or use Send")
        metadata = dict(err.trailing_metadata() or ())
        assert metadata.pop("date", "").endswith(" GMT") and metadata == {"retry-after": "2"}, metadata
        # Send with the same token is not a stream: still served
        assert stub.Send(wire.ingest_request_from_dicts([metric_event(1)]), metadata=md,
                         timeout=CALL_TIMEOUT_S).accepted == 1
    # another token of the same project still gets a stream
    other = gateway.projects.create_token(PROJECT, "ingest")
    with connect(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        summary = stub.Stream(iter([wire.ingest_request_from_dicts([metric_event(2)])]),
                              metadata=(("authorization", f"Bearer {other}"),), timeout=CALL_TIMEOUT_S)
        assert summary.accepted == 1


def test_a_released_stream_frees_its_slot(stop_later: List[Any]) -> None:
    server, _, _, tokens, target = serve(grpc_max_streams_per_token=2)
    stop_later.append(server)
    idle = IdleStreams(target, tokens.ingest, 2)
    stop_later.append(idle)
    idle.release_event.set()  # the iterators end: both calls half-close and get their summaries
    assert [call.result(CALL_TIMEOUT_S).accepted for call in idle.calls] == [0, 0]
    with connect(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        md = (("authorization", f"Bearer {tokens.ingest}"),)
        summaries = [stub.Stream(iter([wire.ingest_request_from_dicts([metric_event(i)])]), metadata=md,
                                 timeout=CALL_TIMEOUT_S) for i in range(3)]
    assert [s.accepted for s in summaries] == [1, 1, 1]


def test_an_idle_stream_is_ended_and_keeps_what_it_sent(stop_later: List[Any]) -> None:
    server, _, queue, tokens, target = serve(grpc_stream_idle_timeout_s=0.5)
    stop_later.append(server)
    first = metric_event(7)
    idle = IdleStreams(target, tokens.ingest, 1, first=[first])
    stop_later.append(idle)
    with pytest.raises(grpc.RpcError) as info:
        idle.calls[0].result(CALL_TIMEOUT_S)  # before the fix: still open at the deadline (FutureTimeoutError)
    err: Any = info.value
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details() == ("stream idle for more than grpc_stream_idle_timeout_s=0.5 s (after 1 events of "
                             "this stream; 1 of them were queued, re-sending them is safe)")
    assert [e.event_id for _, e in drain(queue)] == [first["event_id"]]


def test_calls_per_connection_are_bounded(stop_later: List[Any]) -> None:
    """HTTP/2 MAX_CONCURRENT_STREAMS: a fifth call on a connection holding four idle streams waits (the
    client queues it); other connections are served."""
    server, _, queue, tokens, target = serve(grpc_max_streams_per_connection=4)
    stop_later.append(server)
    idle = IdleStreams(target, tokens.ingest, 4, first=[metric_event(9)])
    stop_later.append(idle)
    wait_until(lambda: queue.depth() == 4)  # each idle stream has sent its first message: all 4 are open
    stub = ingest_pb2_grpc.IngestServiceStub(idle.channel)
    queued = stub.Send.future(wire.ingest_request_from_dicts([metric_event(0)]),
                              metadata=(("authorization", f"Bearer {tokens.ingest}"),), timeout=60)
    assert send(target, tokens.ingest, [metric_event(1)]).accepted == 1  # a second connection: served
    assert not queued.done()  # still waiting for a stream slot on the first connection
    idle.calls[0].cancel()  # a slot frees: the queued call goes through
    assert queued.result(CALL_TIMEOUT_S).accepted == 1
