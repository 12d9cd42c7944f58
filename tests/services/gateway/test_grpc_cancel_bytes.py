"""A gRPC call that ends (cancelled by its client, past its deadline) while a worker thread still decodes
its message keeps that message's bytes in the bound on ingest bytes in flight until the worker is done with
it. Before (stop 41), the coroutine's ``finally`` gave them back at the cancellation while the worker went on
decoding: a client cancelling its calls right after sending could hold ``grpc_workers`` messages (and the
queue of work behind them) uncounted. Real ``build_grpc_server`` on 127.0.0.1; the gateway's ``ingest_batch``
is held on an event to stand for a slow decode."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import grpc
import pytest

from tests.services.gateway.helpers import metric_event, new_gateway
from trainguard import wire
from trainguard.v1 import ingest_pb2_grpc
from trainguard_server.gateway.grpc import build_grpc_server
from trainguard_server.gateway.ingest import Gateway


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class _Slow:
    """Wraps ``gateway.ingest_batch``: each call blocks until :attr:`release` is set."""

    def __init__(self, gateway: Gateway) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self._inner = gateway.ingest_batch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        self.release.wait(20)
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.finished.set()


@pytest.fixture
def slow_server() -> Iterator[Any]:
    gateway, _queue, tokens = new_gateway(ingest_max_inflight_bytes=64 * 2**20,
                                          project_max_inflight_bytes=32 * 2**20)
    slow = _Slow(gateway)
    gateway.ingest_batch = slow  # type: ignore[method-assign]
    server, port = build_grpc_server(gateway, "127.0.0.1", 0, gateway.settings.max_batch_bytes)
    server.start()
    try:
        yield gateway, slow, tokens, f"127.0.0.1:{port}"
    finally:
        slow.release.set()
        server.stop(None).wait(5)


def _held(gateway: Gateway) -> int:
    assert gateway.body_bytes is not None
    return gateway.body_bytes.held()


def test_a_cancelled_send_keeps_its_bytes_while_its_worker_decodes(slow_server: Any) -> None:
    gateway, slow, tokens, target = slow_server
    message = wire.ingest_request_from_dicts([metric_event(step) for step in range(20)]).SerializeToString()
    with grpc.insecure_channel(target) as channel:
        send = channel.unary_unary("/trainguard.v1.IngestService/Send")
        call = send.future(message, metadata=(("authorization", f"Bearer {tokens.ingest}"),), timeout=20)
        assert slow.started.wait(10)
        assert _held(gateway) == len(message)
        call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
    time.sleep(0.3)  # the server has seen the cancellation
    assert not slow.finished.is_set()
    assert _held(gateway) == len(message)  # was 0: given back while the worker still decoded
    slow.release.set()
    _wait(lambda: _held(gateway) == 0)


def test_a_cancelled_stream_keeps_its_bytes_while_its_worker_decodes(slow_server: Any) -> None:
    gateway, slow, tokens, target = slow_server
    request = wire.ingest_request_from_dicts([metric_event(step) for step in range(20)])
    size = len(request.SerializeToString())
    gate = threading.Event()

    def messages() -> Iterator[Any]:
        yield request
        gate.wait(20)

    with grpc.insecure_channel(target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        call = stub.Stream.future(messages(), metadata=(("authorization", f"Bearer {tokens.ingest}"),),
                                  timeout=20)
        assert slow.started.wait(10)
        assert _held(gateway) == size
        call.cancel()
        gate.set()
    time.sleep(0.3)
    assert not slow.finished.is_set()
    assert _held(gateway) == size  # was 0
    slow.release.set()
    _wait(lambda: _held(gateway) == 0)


def test_bytes_of_an_answered_send_are_given_back(slow_server: Any) -> None:
    gateway, slow, tokens, target = slow_server
    slow.release.set()
    with grpc.insecure_channel(target) as channel:
        reply = ingest_pb2_grpc.IngestServiceStub(channel).Send(
            wire.ingest_request_from_dicts([metric_event()]), timeout=10,
            metadata=(("authorization", f"Bearer {tokens.ingest}"),))
    assert reply.accepted == 1
    _wait(lambda: _held(gateway) == 0)
