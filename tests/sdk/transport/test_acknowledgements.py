"""Issue 18, finding 5: a 200 is not an acknowledgement unless its body says the gateway took the batch.

The gateway acknowledges ``n`` events with ``{"accepted": a, "duplicates": d, "rejected": [{index, ...}]}``
(HTTP JSON; gRPC: ``IngestResponse``) where ``a + d + len(rejected) == n`` and every rejected index is a
position in the request. Anything else -- an HTML page, random bytes, JSON with the wrong counts -- means
the batch was not really accepted: the SDK keeps it (spool) and retries, and counts it as spooled, never
as sent. The real gateway's answers (HTTP and gRPC) pass the same check. Real servers on 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

import trainguard
from tests.sdk.transport.hostile import BASE, AckBody, GarbageServer, clean_sdk  # noqa: F401 (fixture)
from trainguard.core import events as ev
from trainguard.core.events import decode_events
from trainguard.transport.base import TransportError
from trainguard.transport.http import HttpTransport

QUIET = {"flush_interval": 0.05, "backoff_initial": 0.05, "backoff_max": 0.2, "heartbeat_interval": 0,
         "capture_exit": False, "capture_uncaught": False, "send_timeout": 5.0}
pytestmark = pytest.mark.usefixtures("clean_sdk")


def _events(n: int) -> List[Dict[str, Any]]:
    return [ev.envelope(BASE, "metrics", ev.metrics_payload({"loss": 1.0}), step=i,
                        time_unix_nano=1_700_000_000_000_000_000 + i) for i in range(n)]


def _ack(accepted: Any, duplicates: Any = 0, rejected: Any = ()) -> bytes:
    return json.dumps({"accepted": accepted, "duplicates": duplicates, "rejected": list(rejected)}).encode()


def _rejection(index: Any) -> Dict[str, Any]:
    return {"index": index, "event_id": "x", "code": "invalid_field", "message": "m"}


HTML = (b"<!DOCTYPE html><html><head><title>Sign in to the Wi-Fi</title></head>"
        b"<body><form method=post>...</form></body></html>")
RANDOM = bytes.fromhex("8f1ac3e07a5591d2b64e0f3396c1a7d85e2b04f9c6137a8d21e5f0b94c6d83aa")
NOT_ACKS: Dict[str, AckBody] = {
    "html": HTML,
    "random_bytes": RANDOM,
    "empty": b"",
    "empty_object": b"{}",
    "json_array": b"[]",
    "one_short": lambda n: _ack(n - 1),
    "one_too_many": lambda n: _ack(n + 1),
    "counts_as_strings": lambda n: _ack(str(n)),
    "counts_as_floats": lambda n: _ack(float(n)),
    "negative_duplicates": lambda n: _ack(n + 1, duplicates=-1),
    "no_rejected_field": lambda n: json.dumps({"accepted": n, "duplicates": 0}).encode(),
    "rejected_index_out_of_range": lambda n: _ack(n - 1, rejected=[_rejection(n)]),
    "rejected_index_twice": lambda n: _ack(n - 2, rejected=[_rejection(0), _rejection(0)]),
    "rejected_not_objects": lambda n: _ack(n - 1, rejected=["nope"]),
}


@pytest.mark.parametrize("case", sorted(NOT_ACKS))
def test_an_http_200_that_is_not_an_acknowledgement_is_a_retryable_failure(case: str) -> None:
    with GarbageServer(NOT_ACKS[case], "text/html" if case == "html" else "application/json") as server:
        transport = HttpTransport(server.url, None, "ua")
        try:
            with pytest.raises(TransportError) as info:
                transport.send(_events(5), 5)
        finally:
            transport.close()
        assert server.requests == 1
    assert info.value.retryable and info.value.status == "bad_ack", info.value


def test_the_sdk_spools_and_counts_what_a_garbage_200_answered(tmp_path: Path) -> None:
    with GarbageServer(HTML, "text/html") as server:
        trainguard.init(endpoint=server.url, project="p", spool_dir=str(tmp_path), **QUIET)
        client = trainguard.get_client()
        assert client is not None
        for step in range(300):
            trainguard.log(step=step, loss=1.0)
        assert trainguard.flush(2) is False  # nothing was acknowledged
        assert server.requests >= 1
        trainguard.shutdown(timeout=3)
    spooled = [e for p in sorted(tmp_path.rglob("*.json")) for e in decode_events(p.read_bytes())]
    assert client.stats.sent == 0, client.stats.snapshot()
    assert client.stats.spooled == len(spooled) == 301, client.stats.snapshot()
    assert [int(e["step"]) for e in spooled if "metrics" in e] == list(range(300))
    assert client.accounting() == {"logged": 301, "sent": 0, "spooled": 301, "dropped": 0, "queued": 0}


# ---------------------------------------------------------------------------------------------- gRPC

def _grpc_server(answer: Callable[[Any], Any]) -> Any:
    """A real gRPC server whose IngestService.Send answers ``answer(request)`` (raw bytes or a message)."""
    from concurrent import futures

    import grpc

    from trainguard.v1 import ingest_pb2

    def send(request: Any, context: Any) -> bytes:
        out = answer(request)
        return out if isinstance(out, bytes) else out.SerializeToString()

    handler = grpc.method_handlers_generic_handler("trainguard.v1.IngestService", {
        "Send": grpc.unary_unary_rpc_method_handler(send, request_deserializer=ingest_pb2.IngestRequest.FromString,
                                                    response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _grpc_not_acks() -> Dict[str, Callable[[Any], Any]]:
    from trainguard.v1 import ingest_pb2

    def response(**fields: Any) -> Callable[[Any], Any]:
        def make(request: Any) -> Any:
            n = len(request.events)
            values = {k: (v(n) if callable(v) else v) for k, v in fields.items()}
            return ingest_pb2.IngestResponse(**values)
        return make

    return {
        "one_short": response(accepted=lambda n: n - 1),
        "one_too_many": response(accepted=lambda n: n + 1),
        "nothing_said": response(),  # an empty message: all zeros
        "rejected_index_out_of_range": response(accepted=lambda n: n - 1,
                                                rejected=lambda n: [ingest_pb2.Rejection(index=n)]),
        "negative_accepted": response(accepted=-1, duplicates=lambda n: n + 1),
        "random_bytes": lambda request: RANDOM,
    }


@pytest.mark.parametrize("case", ["one_short", "one_too_many", "nothing_said", "rejected_index_out_of_range",
                                  "negative_accepted", "random_bytes"])
def test_a_grpc_answer_that_does_not_acknowledge_the_batch_is_a_retryable_failure(case: str) -> None:
    pytest.importorskip("grpc")
    from trainguard.transport.grpc import GrpcTransport

    server, port = _grpc_server(_grpc_not_acks()[case])
    transport = GrpcTransport(f"127.0.0.1:{port}", None)
    try:
        with pytest.raises(TransportError) as info:
            transport.send(_events(5), 5)
    finally:
        transport.close()
        server.stop(None).wait(5)
    assert info.value.retryable, info.value
    if case != "random_bytes":  # bytes that do not parse fail inside gRPC already (INTERNAL)
        assert info.value.status == "bad_ack", info.value


# ------------------------------------------------------------------- the real gateway passes the check

def _mixed_batch() -> List[Dict[str, Any]]:
    """Two new events, one the gateway rejects (another project), and the first one again."""
    from tests.services.gateway.helpers import metric_event

    first, second = metric_event(0), metric_event(1)
    return [first, second, metric_event(2, project="other"), dict(first)]


def test_the_real_gateways_http_and_grpc_acknowledgements_pass_the_check() -> None:
    pytest.importorskip("grpc")
    from fastapi import FastAPI

    from tests.services.gateway.helpers import UvicornThread, new_gateway
    from trainguard.transport.grpc import GrpcTransport
    from trainguard_server.gateway.grpc import build_grpc_server
    from trainguard_server.gateway.http import ingest_router

    gateway, _queue, tokens = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    grpc_server, port = build_grpc_server(gateway, "127.0.0.1", 0, gateway.settings.max_batch_bytes, workers=2)
    grpc_server.start()
    try:
        with UvicornThread(app) as uv:
            for transport in (HttpTransport(uv.url, tokens.ingest, "ua"),
                              GrpcTransport(f"127.0.0.1:{port}", tokens.ingest)):
                try:
                    result = transport.send(_mixed_batch(), 5)
                finally:
                    transport.close()
                assert (result.accepted, result.duplicates) == (2, 1), transport.name
                assert [(r["index"], r["code"]) for r in result.rejected] == [(2, "wrong_project")]
    finally:
        grpc_server.stop(None).wait(5)


def test_the_sdk_counts_what_the_real_gateway_acknowledged_as_sent(tmp_path: Path) -> None:
    from fastapi import FastAPI

    from tests.services.gateway.helpers import (
        PROJECT,
        UvicornThread,
        drain,
        gateway_settings,
        new_projects,
        new_queue,
    )
    from trainguard_server.gateway.http import ingest_router
    from trainguard_server.gateway.ingest import Gateway

    projects, tokens = new_projects()
    queue = new_queue()
    gateway = Gateway(queue, projects, gateway_settings(), clock=time.time_ns)  # the SDK stamps real time
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv:
        trainguard.init(endpoint=uv.url, project=PROJECT, token=tokens.ingest, spool_dir=str(tmp_path),
                        max_batch_events=100, **QUIET)
        client = trainguard.get_client()
        assert client is not None
        for step in range(250):
            trainguard.log(step=step, loss=1.0 / (step + 1))
        assert trainguard.flush(10)
        trainguard.shutdown(timeout=3)
    assert client.accounting() == {"logged": 251, "sent": 251, "spooled": 0, "dropped": 0, "queued": 0}
    assert len(drain(queue)) == 251  # what the gateway queued is what the SDK counts as sent
