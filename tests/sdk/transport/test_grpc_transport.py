"""GrpcTransport against a real gRPC server (tests.support.receivers.GrpcReceiver) on 127.0.0.1."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")

import grpc

from tests.support.receivers import GrpcReceiver
from trainguard import wire
from trainguard.core import events as ev
from trainguard.transport.base import TransportError
from trainguard.transport.grpc import GrpcTransport, rpc_error_to_transport_error, split_target
from trainguard.v1 import ingest_pb2, ingest_pb2_grpc

TOKEN = "s3cret-token"
BASE = {"project": "p", "run_id": "r" * 32, "host": "h", "pid": 7, "rank": 1, "world_size": 2}
REPO = Path(__file__).resolve().parents[3]


def metric_events(n: int, values: Optional[Dict[str, float]] = None) -> List[Dict[str, Any]]:
    return [ev.envelope(BASE, "metrics", ev.metrics_payload(values or {"loss": 1.0 / (i + 1), "lr": 3e-4}),
                        step=i, time_unix_nano=1_700_000_000_000_000_000 + i) for i in range(n)]


@pytest.fixture
def rx() -> Iterator[GrpcReceiver]:
    with GrpcReceiver(token=TOKEN) as receiver:
        yield receiver


@pytest.fixture
def transport(rx: GrpcReceiver) -> Iterator[GrpcTransport]:
    t = GrpcTransport(rx.target, TOKEN)
    yield t
    t.close()


def send_error(t: GrpcTransport, events: List[Dict[str, Any]], timeout: float = 5.0) -> TransportError:
    with pytest.raises(TransportError) as info:
        t.send(events, timeout)
    return info.value


# ------------------------------------------------------------------------------------------------ happy

def test_send_ok(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    events = metric_events(3)
    result = transport.send(events, 5)
    assert (result.accepted, result.duplicates, result.rejected) == (3, 0, [])
    assert [e["event_id"] for e in rx.events] == [e["event_id"] for e in events]
    assert rx.events[2] == wire.envelope_to_dict(wire.envelope_from_dict(events[2]))
    assert rx.last_headers["authorization"] == f"Bearer {TOKEN}"
    assert rx.last_headers["user-agent"].startswith("trainguard-python/")


def test_resent_batch_is_counted_as_duplicates(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    events = metric_events(4)
    transport.send(events, 5)
    again = transport.send(events, 5)
    assert (again.accepted, again.duplicates) == (0, 4)
    assert len(rx.events) == 4 and set(rx.received_ids.values()) == {2}


def test_nan_and_infinities_survive(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    events = metric_events(1, {"loss": math.nan, "grad/global_norm": math.inf, "amp/min": -math.inf})
    transport.send(events, 5)
    points = {p["name"]: p["value"] for p in rx.events[0]["metrics"]["points"]}
    assert points == {"loss": "NaN", "grad/global_norm": "Infinity", "amp/min": "-Infinity"}


def test_channel_is_lazy_and_close_is_idempotent(rx: GrpcReceiver) -> None:
    t = GrpcTransport("127.0.0.1:1", TOKEN)  # nothing listens there: constructing must not connect
    assert t._channel is None
    t.close()
    t = GrpcTransport(f"grpc://{rx.target}", TOKEN)
    assert t._channel is None
    t.send(metric_events(1), 5)
    assert t._channel is not None
    t.close()
    t.close()
    assert t._channel is None
    assert t.send(metric_events(1), 5).accepted == 1  # a closed transport reconnects on the next send
    t.close()


def test_per_item_rejections_keep_batch_positions(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    good = metric_events(3)
    no_id = dict(good[0], event_id="")  # the server rejects it (event_id required)
    malformed = dict(good[1], event_id="bad-one", bogus=1)  # never leaves the client
    batch = [good[0], malformed, good[1], no_id, good[2]]
    result = transport.send(batch, 5)
    assert result.accepted == 3
    assert [(r["index"], r["event_id"], r["code"]) for r in result.rejected] == [
        (1, "bad-one", "invalid_field"), (3, "", "invalid_field")]
    assert 'unknown field "bogus"' in result.rejected[0]["message"]


def test_large_batches_are_split_and_oversize_events_rejected(rx: GrpcReceiver) -> None:
    t = GrpcTransport(rx.target, TOKEN, max_message_bytes=4096)
    events = [ev.envelope(BASE, "log", {"message": f"{i}:" + "x" * 300}, step=i, time_unix_nano=1)
              for i in range(40)]
    huge = ev.envelope(BASE, "log", {"message": "y" * 5000}, step=99, time_unix_nano=1)
    result = t.send([*events[:20], huge, *events[20:]], 5)
    t.close()
    assert result.accepted == 40 and rx.requests >= 4
    assert [(r["index"], r["code"]) for r in result.rejected] == [(20, "too_large")]
    assert [e["event_id"] for e in rx.events] == [e["event_id"] for e in events]


# ------------------------------------------------------------------------------------------- failures

def test_wrong_or_missing_token_is_final(rx: GrpcReceiver) -> None:
    for token in ("wrong", None):
        t = GrpcTransport(rx.target, token)
        err = send_error(t, metric_events(1))
        t.close()
        assert (err.retryable, err.status, err.retry_after) == (False, "UNAUTHENTICATED", None)
    assert rx.events == []


def test_throttle_is_retryable_with_retry_after(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    rx.mode, rx.retry_after_s = "throttle", 2.5
    err = send_error(transport, metric_events(1))
    assert (err.retryable, err.status, err.retry_after) == (True, "RESOURCE_EXHAUSTED", 2.5)
    rx.mode = "ok"
    assert transport.send(metric_events(1), 5).accepted == 1


def test_injected_server_errors(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    rx.mode = "error_500"
    err = send_error(transport, metric_events(1))
    assert (err.retryable, err.status) == (True, "INTERNAL")
    rx.mode = "error_400"
    err = send_error(transport, metric_events(1))
    assert (err.retryable, err.status) == (False, "INVALID_ARGUMENT")


def test_server_down_then_back(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    transport.send(metric_events(1), 5)
    port = rx.port
    rx.stop()
    started = time.monotonic()
    err = send_error(transport, metric_events(1), timeout=3)
    assert (err.retryable, err.status) == (True, "UNAVAILABLE")
    assert time.monotonic() - started < 2.5  # fails fast, does not wait for the deadline
    rx.start()
    assert rx.port == port
    deadline = time.monotonic() + 5
    while True:  # the channel reconnects within its (short) reconnect backoff
        try:
            result = transport.send(metric_events(1), 2)
            break
        except TransportError as exc:
            assert exc.retryable and time.monotonic() < deadline, exc
            time.sleep(0.1)
    assert result.accepted == 1 and len(rx.events) == 2  # events recorded before the outage are kept


def test_slow_server_beyond_timeout(rx: GrpcReceiver, transport: GrpcTransport) -> None:
    rx.delay_s = 3.0
    started = time.monotonic()
    err = send_error(transport, metric_events(1), timeout=0.3)
    assert (err.retryable, err.status) == (True, "DEADLINE_EXCEEDED")
    assert time.monotonic() - started < 1.5


def test_batch_over_the_server_limit_is_not_retried_forever() -> None:
    with GrpcReceiver(max_message_bytes=4096) as small:
        t = GrpcTransport(small.target, None)
        events = [ev.envelope(BASE, "log", {"message": "x" * 500}, step=i, time_unix_nano=1)
                  for i in range(20)]
        err = send_error(t, events)
        t.close()
    assert (err.retryable, err.status) == (False, "413")  # the worker splits a "413" batch


# ------------------------------------------------------------------------------------------- mapping

class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "boom", trailing: Any = (),
                 initial: Any = ()) -> None:
        self._code, self._details, self._trailing, self._initial = code, details, trailing, initial

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing

    def initial_metadata(self) -> Any:
        return self._initial


RETRYABLE = ["UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "UNKNOWN"]
FINAL = ["INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "UNIMPLEMENTED",
         "FAILED_PRECONDITION"]


@pytest.mark.parametrize("name", RETRYABLE + FINAL)
def test_status_code_mapping(name: str) -> None:
    err = rpc_error_to_transport_error(FakeRpcError(grpc.StatusCode[name], "details here"))
    assert err.retryable is (name in RETRYABLE)
    assert err.status == name and str(err) == f"grpc {name}: details here"


def test_retry_after_from_trailing_or_initial_metadata() -> None:
    def retry_after(**metadata: Any) -> Optional[float]:
        err = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, **metadata)
        return rpc_error_to_transport_error(err).retry_after

    assert retry_after(trailing=(("retry-after", "7"),)) == 7
    assert retry_after(initial=(("Retry-After", "0.5"),)) == 0.5
    assert retry_after(trailing=(("retry-after", "soon"),)) is None
    assert retry_after() is None
    final = rpc_error_to_transport_error(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED,
                                                      trailing=(("retry-after", "7"),)))
    assert final.retry_after is None


def test_split_target() -> None:
    assert split_target("localhost:4317", False) == ("localhost:4317", False)
    assert split_target("grpc://localhost:4317/", False) == ("localhost:4317", False)
    assert split_target("grpcs://ingest.example:443", False) == ("ingest.example:443", True)
    assert split_target("localhost:4317", True) == ("localhost:4317", True)


# ------------------------------------------------------------------------------ receiver's Stream RPC

def test_receiver_stream_rpc_summarises_the_stream(rx: GrpcReceiver) -> None:
    events = metric_events(5)
    requests = [wire.ingest_request_from_dicts(events[:3]),
                wire.ingest_request_from_dicts([events[3], dict(events[4], event_id=""), events[0]])]
    with grpc.insecure_channel(rx.target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        response = stub.Stream(iter(requests), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        with pytest.raises(grpc.RpcError) as info:
            stub.Stream(iter(requests), timeout=5)
    assert isinstance(response, ingest_pb2.IngestResponse)
    assert (response.accepted, response.duplicates) == (4, 1)
    assert [(r.index, r.code) for r in response.rejected] == [(4, "invalid_field")]
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ------------------------------------------------------------------------------------ process concerns

def _child_env() -> Dict[str, str]:
    src = Path(wire.__file__).parent.parent  # the trainguard under test
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_gets_its_own_channel() -> None:
    code = """
import os
from tests.support.receivers import GrpcReceiver
from trainguard.transport.grpc import GrpcTransport
from trainguard.core import events as ev
def batch(n):
    return [ev.envelope({"run_id": "r"}, "log", {"message": "m"}, step=i, time_unix_nano=1) for i in range(n)]
with GrpcReceiver() as rx:
    t = GrpcTransport(rx.target, None)
    assert t.send(batch(2), 5).accepted == 2
    pid = os.fork()
    if pid == 0:
        try:
            ok = t.send(batch(3), 5).accepted == 3
            t.close()
        finally:
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert t.send(batch(1), 5).accepted == 1  # the parent's channel still works
    assert len(rx.events) == 6
    t.close()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=_child_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_import_without_grpcio_says_what_to_install() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith("grpc."):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
import trainguard.transport
try:
    import trainguard.transport.grpc
except ImportError as exc:
    assert "pip install 'trainguard[grpc]'" in str(exc), exc
    print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=_child_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
