"""Tiny real ingest servers for the SDK transport tests (the real gateway comes later).

:class:`HttpReceiver` serves ``POST /v1/ingest`` (stdlib ``ThreadingHTTPServer``) and :class:`GrpcReceiver`
serves ``trainguard.v1.IngestService`` (``Send`` and ``Stream``), both on 127.0.0.1 with an ephemeral port.
Shared semantics, the same as the gateway's (docs/wire-format.md):

* auth: when ``token`` is set, ``Authorization: Bearer <token>`` is required (HTTP 401 / UNAUTHENTICATED);
* every event must parse with :func:`trainguard.wire.envelope_from_dict` (HTTP: otherwise the whole batch is
  400 with the reason; gRPC requests are typed already); an event without ``event_id`` is rejected per item
  (``code="invalid_field"``), the others are still stored;
* de-duplication by ``event_id``: ``.events`` holds each event once, in arrival order (HTTP: the dicts as
  sent; gRPC: :func:`trainguard.wire.envelope_to_dict` of the message, so default values are omitted);
  ``.received_ids`` counts every arrival, duplicates included;
* fault injection, settable at any time from the test thread: ``.mode`` = ``"ok"`` | ``"error_500"``
  (HTTP 500 / INTERNAL) | ``"error_400"`` (HTTP 400 / INVALID_ARGUMENT) | ``"throttle"`` (HTTP 429 with
  ``Retry-After: <retry_after_s>`` / RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata);
  ``.delay_s`` sleeps before answering (cut short by :meth:`stop`);
* lifecycle: :meth:`start`, :meth:`stop` (drops open connections, so clients really see the server go),
  :meth:`restart`; a stopped receiver starts again on the same port with its records intact. Both are
  context managers (``with HttpReceiver() as rx: ...``).
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections import Counter
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Set, Tuple

from trainguard import wire
from trainguard.core.events import decode_events
from trainguard.v1 import ingest_pb2

MODES = ("ok", "error_500", "error_400", "throttle")
INGEST_PATH = "/v1/ingest"


class _Receiver:
    """Recording, de-duplication, auth and fault-injection state shared by both receivers."""

    def __init__(self, token: Optional[str] = None, *, port: int = 0) -> None:
        self.token = token
        self.port = port
        self.mode = "ok"
        self.delay_s = 0.0
        self.retry_after_s = 1.0
        self._lock = threading.Condition()
        self._events: List[Dict[str, Any]] = []
        self._ids: Set[str] = set()
        self._received: Counter[str] = Counter()
        self._requests = 0
        self._last_headers: Dict[str, str] = {}
        self._stopping = threading.Event()

    # --------------------------------------------------------------------------------- what arrived
    @property
    def events(self) -> List[Dict[str, Any]]:
        """Stored events (each event_id once), in arrival order; a copy."""
        with self._lock:
            return list(self._events)

    @property
    def received_ids(self) -> Counter[str]:
        """How many times each event_id arrived, duplicates included; a copy."""
        with self._lock:
            return Counter(self._received)

    @property
    def requests(self) -> int:
        """Requests (HTTP POSTs / RPCs) seen, whatever their outcome."""
        with self._lock:
            return self._requests

    @property
    def last_headers(self) -> Dict[str, str]:
        """Headers (HTTP, lower-cased names) or invocation metadata (gRPC) of the latest request."""
        with self._lock:
            return dict(self._last_headers)

    def wait_for(self, count: int, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` events are stored; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._events) >= count, timeout)

    def reset(self) -> None:
        """Forget everything recorded (not the port, token or fault settings)."""
        with self._lock:
            self._events.clear()
            self._ids.clear()
            self._received.clear()
            self._requests = 0

    # ----------------------------------------------------------------------------- request handling
    def _note_request(self, headers: Dict[str, str]) -> None:
        with self._lock:
            self._requests += 1
            self._last_headers = headers

    def _pause(self) -> None:
        if self.delay_s > 0:
            self._stopping.wait(self.delay_s)

    def _authorized(self, authorization: Optional[str]) -> bool:
        return not self.token or authorization == f"Bearer {self.token}"

    def _ingest(self, events: List[Dict[str, Any]], offset: int = 0
                ) -> Tuple[int, int, List[Dict[str, Any]]]:
        accepted = duplicates = 0
        rejected: List[Dict[str, Any]] = []
        with self._lock:
            for i, event in enumerate(events):
                event_id = event.get("event_id")
                if not isinstance(event_id, str) or not event_id:
                    rejected.append({"index": offset + i, "event_id": "", "code": "invalid_field",
                                     "message": "Envelope.event_id: required"})
                    continue
                self._received[event_id] += 1
                if event_id in self._ids:
                    duplicates += 1
                    continue
                self._ids.add(event_id)
                self._events.append(event)
                accepted += 1
            self._lock.notify_all()
        return accepted, duplicates, rejected

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        """Stop, then start again on the same port; recorded events are kept."""
        self.stop()
        self.start()

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ============================================================================================== HTTP

class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    receiver: HttpReceiver
    connections: Set[socket.socket]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: a client that went away, or a connection cut by stop(), is not a test failure."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the SDK's HttpTransport
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.server.connections.add(self.connection)

    def finish(self) -> None:
        self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json",
               headers: Optional[Dict[str, str]] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: Optional[Dict[str, str]] = None) -> None:
        self._reply(status, json.dumps({"error": message}).encode(), headers=headers)

    def do_GET(self) -> None:
        self._error(405, "use POST")

    def do_POST(self) -> None:
        rx = self.server.receiver
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        rx._note_request({k.lower(): v for k, v in self.headers.items()})
        rx._pause()
        if self.path.split("?", 1)[0] != INGEST_PATH:
            return self._error(404, f"unknown path {self.path}")
        if not rx._authorized(self.headers.get("Authorization")):
            return self._error(401, "invalid or missing bearer token")
        if rx.mode == "throttle":
            return self._error(429, "throttled", {"Retry-After": f"{rx.retry_after_s:g}"})
        if rx.mode == "error_500":
            return self._error(500, "injected failure")
        if rx.mode == "error_400":
            return self._error(400, "injected rejection")
        if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
            try:
                body = gzip.decompress(body)
            except (OSError, EOFError) as exc:
                return self._error(400, f"bad gzip body: {exc}")
        as_proto = (self.headers.get("Content-Type") or "").split(";")[0].strip() == "application/x-protobuf"
        try:
            events = _parse_body(body, as_proto)
        except ValueError as exc:
            return self._error(400, str(exc))
        accepted, duplicates, rejected = rx._ingest(events)
        if as_proto:
            response = ingest_pb2.IngestResponse(accepted=accepted, duplicates=duplicates,
                                                      rejected=rejected)
            return self._reply(200, response.SerializeToString(), "application/x-protobuf")
        self._reply(200, json.dumps({"accepted": accepted, "duplicates": duplicates,
                                     "rejected": rejected}).encode())


def _parse_body(body: bytes, as_proto: bool) -> List[Dict[str, Any]]:
    """The events of an ingest body; ValueError (with the reason) when any of them is malformed."""
    if as_proto:
        try:
            request = ingest_pb2.IngestRequest.FromString(body)
        except Exception as exc:  # DecodeError
            raise ValueError(f"body is not a serialized IngestRequest: {exc}") from None
        return wire.ingest_request_to_dicts(request)
    events = decode_events(body)
    for i, event in enumerate(events):
        try:
            wire.envelope_from_dict(event)
        except wire.WireError as exc:
            raise ValueError(f"events[{i}]: {exc}") from None
    return events


class HttpReceiver(_Receiver):
    """``POST /v1/ingest`` on 127.0.0.1; ``.url`` is the endpoint to give the SDK (``http://127.0.0.1:P``)."""

    def __init__(self, token: Optional[str] = None, *, port: int = 0) -> None:
        super().__init__(token, port=port)
        self._server: Optional[_HttpServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ingest_url(self) -> str:
        return self.url + INGEST_PATH

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("HttpReceiver already started")
        self._stopping.clear()
        server = _HttpServer(("127.0.0.1", self.port), _Handler)
        server.receiver = self
        server.connections = set()
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"http-receiver-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        for conn in list(server.connections):  # kept-alive client connections: make the outage real
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._thread is not None:
            self._thread.join(5)


# ============================================================================================== gRPC

class GrpcReceiver(_Receiver):
    """``trainguard.v1.IngestService`` on 127.0.0.1; ``.target`` is ``127.0.0.1:P``."""

    def __init__(self, token: Optional[str] = None, *, port: int = 0,
                 max_message_bytes: int = 16 * 1024 * 1024) -> None:
        super().__init__(token, port=port)
        self.max_message_bytes = max_message_bytes
        self._server: Any = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"grpc://{self.target}"

    def start(self) -> None:
        import grpc

        from trainguard.v1 import ingest_pb2_grpc

        if self._server is not None:
            raise RuntimeError("GrpcReceiver already started")
        self._stopping.clear()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpc-receiver"),
            options=[("grpc.so_reuseport", 0),  # a restart must really own the port again
                     ("grpc.max_receive_message_length", self.max_message_bytes),
                     ("grpc.max_send_message_length", self.max_message_bytes)])
        ingest_pb2_grpc.add_IngestServiceServicer_to_server(_Servicer(self), server)
        port = 0
        for _ in range(50):  # a just-closed port can take a moment to be bindable again
            try:
                port = server.add_insecure_port(f"127.0.0.1:{self.port}")
            except RuntimeError:
                port = 0
            if port:
                break
            time.sleep(0.02)
        if not port:
            raise OSError(f"GrpcReceiver: cannot bind 127.0.0.1:{self.port}")
        self.port = port
        server.start()
        self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.stop(grace=None).wait(5)


def _metadata(context: Any) -> Dict[str, str]:
    return {k: v if isinstance(v, str) else repr(v) for k, v in context.invocation_metadata()}


class _Servicer:
    """IngestService handlers over a :class:`GrpcReceiver`'s state."""

    def __init__(self, rx: GrpcReceiver) -> None:
        self.rx = rx

    def _gate(self, context: Any) -> None:
        import grpc

        rx = self.rx
        metadata = _metadata(context)
        rx._note_request(metadata)
        rx._pause()
        if not rx._authorized(metadata.get("authorization")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing bearer token")
        if rx.mode == "throttle":
            context.set_trailing_metadata((("retry-after", f"{rx.retry_after_s:g}"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "throttled")
        if rx.mode == "error_500":
            context.abort(grpc.StatusCode.INTERNAL, "injected failure")
        if rx.mode == "error_400":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "injected rejection")

    def Send(self, request: Any, context: Any) -> Any:
        self._gate(context)
        accepted, duplicates, rejected = self.rx._ingest(wire.ingest_request_to_dicts(request))
        return ingest_pb2.IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)

    def Stream(self, request_iterator: Any, context: Any) -> Any:
        self._gate(context)
        accepted = duplicates = offset = 0
        rejected: List[Dict[str, Any]] = []
        for request in request_iterator:  # Rejection.index counts across the whole stream
            a, d, r = self.rx._ingest(wire.ingest_request_to_dicts(request), offset)
            accepted, duplicates, offset = accepted + a, duplicates + d, offset + len(request.events)
            rejected += r
        return ingest_pb2.IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)
