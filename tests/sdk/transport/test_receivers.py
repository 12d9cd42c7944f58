"""The test receivers themselves (tests.support.receivers): HTTP semantics, fault injection, restarts."""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

pytest.importorskip("google.protobuf")

from tests.support.receivers import HttpReceiver
from trainguard import wire
from trainguard.core import events as ev
from trainguard.transport.base import TransportError
from trainguard.transport.http import HttpTransport
from trainguard.v1 import ingest_pb2

TOKEN = "tok"


def events(n: int) -> List[Dict[str, Any]]:
    return [ev.envelope({"run_id": "r"}, "metrics", ev.metrics_payload({"loss": float("nan"), "lr": 0.1}),
                        step=i, time_unix_nano=1) for i in range(n)]


def post(rx: HttpReceiver, body: bytes, headers: Dict[str, str], path: str = "/v1/ingest"
         ) -> Tuple[int, Dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=5)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.fixture
def rx() -> Iterator[HttpReceiver]:
    with HttpReceiver(token=TOKEN) as receiver:
        yield receiver


def test_http_transport_round_trip_and_dedup(rx: HttpReceiver) -> None:
    t = HttpTransport(rx.url, TOKEN, "test/1")
    batch = events(3)
    assert t.send(batch, 5).accepted == 3
    again = t.send(batch, 5)
    t.close()
    assert (again.accepted, again.duplicates) == (0, 3)
    assert rx.events == batch  # HTTP keeps the dicts exactly as sent
    assert rx.received_ids == {e["event_id"]: 2 for e in batch}
    assert rx.last_headers["authorization"] == f"Bearer {TOKEN}"


def test_auth_modes_and_faults(rx: HttpReceiver) -> None:
    assert post(rx, ev.encode_batch(events(1)), {"Content-Type": "application/json"})[0] == 401
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    rx.mode, rx.retry_after_s = "throttle", 3
    status, headers, _ = post(rx, ev.encode_batch(events(1)), auth)
    assert (status, headers["retry-after"]) == (429, "3")
    rx.mode = "error_500"
    assert post(rx, ev.encode_batch(events(1)), auth)[0] == 500
    rx.mode = "error_400"
    assert post(rx, ev.encode_batch(events(1)), auth)[0] == 400
    rx.mode = "ok"
    assert post(rx, ev.encode_batch(events(1)), auth, path="/nope")[0] == 404
    t = HttpTransport(rx.url, TOKEN, "test/1")
    rx.mode = "throttle"
    with pytest.raises(TransportError) as info:
        t.send(events(1), 5)
    assert info.value.retryable and info.value.retry_after == 3
    t.close()
    assert rx.events == []


def test_a_malformed_event_rejects_the_whole_batch_with_the_reason(rx: HttpReceiver) -> None:
    batch = events(2)
    batch[1]["metrics"]["points"][0]["value"] = "nan"
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    status, _, body = post(rx, ev.encode_batch(batch), auth)
    assert status == 400
    assert json.loads(body)["error"] == ('events[1]: Envelope.metrics.points[0].value: expected a double, '
                                         'got "nan" (use "NaN", "Infinity" or "-Infinity")')
    assert post(rx, b"{not json", auth)[0] == 400
    assert rx.events == []


def test_missing_event_id_is_rejected_per_item(rx: HttpReceiver) -> None:
    batch = events(2)
    batch[0]["event_id"] = ""
    t = HttpTransport(rx.url, TOKEN, "test/1")
    result = t.send(batch, 5)
    t.close()
    assert result.accepted == 1
    assert result.rejected == [{"index": 0, "event_id": "", "code": "invalid_field",
                                "message": "Envelope.event_id: required"}]


def test_protobuf_and_gzip_bodies(rx: HttpReceiver) -> None:
    batch = events(2)
    body = wire.ingest_request_from_dicts(batch).SerializeToString()
    status, headers, data = post(rx, gzip.compress(body), {"Content-Type": "application/x-protobuf",
                                                           "Content-Encoding": "gzip",
                                                           "Authorization": f"Bearer {TOKEN}"})
    assert (status, headers["content-type"]) == (200, "application/x-protobuf")
    response = ingest_pb2.IngestResponse.FromString(data)
    assert response.accepted == 2
    assert rx.events == [wire.envelope_to_dict(wire.envelope_from_dict(e)) for e in batch]


def test_stop_drops_kept_alive_connections_and_restart_keeps_port_and_events(rx: HttpReceiver) -> None:
    t = HttpTransport(rx.url, TOKEN, "test/1")
    assert t.send(events(1), 5).accepted == 1  # opens a keep-alive connection
    port = rx.port
    rx.stop()
    with pytest.raises(TransportError) as info:
        t.send(events(1), 2)
    assert info.value.retryable
    rx.start()
    assert rx.port == port
    assert t.send(events(1), 5).accepted == 1
    rx.restart()
    try:  # the transport's kept-alive socket died with the old server: one retryable failure is allowed
        result = t.send(events(1), 5)
    except TransportError as exc:
        assert exc.retryable
        result = t.send(events(1), 5)
    t.close()
    assert result.accepted == 1
    assert len(rx.events) == 3 and rx.requests == 3


def test_delay_and_wait_for(rx: HttpReceiver) -> None:
    rx.delay_s = 5.0
    t = HttpTransport(rx.url, TOKEN, "test/1")
    started = time.monotonic()
    with pytest.raises(TransportError):
        t.send(events(1), 0.3)
    assert time.monotonic() - started < 2
    rx.delay_s = 0
    t.close()
    sender = threading.Thread(target=lambda: HttpTransport(rx.url, TOKEN, "t").send(events(2), 5))
    sender.start()
    assert rx.wait_for(2, timeout=5)
    sender.join()
    rx.stop()  # the delayed handler from above is cut short, stop() does not wait 5 s
    assert time.monotonic() - started < 4
