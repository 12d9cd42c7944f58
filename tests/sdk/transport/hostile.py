"""Hostile backends for the SDK's delivery tests: real sockets on 127.0.0.1, no mocks.

* :class:`HangingServer` accepts connections, reads (and throws away) whatever arrives and never answers: a
  backend whose application is stuck, or a proxy that lost its upstream. HTTP and gRPC clients both see a
  connection that works and an answer that never comes.
* :class:`FullBacklogServer` listens with its accept queue already full, so a new connection is never
  established: the SYN is dropped and ``connect()`` waits (a host that black-holes packets).
* :class:`TricklingServer` answers the first line of a 200 and then one header byte every ``interval_s``,
  forever: every single read gets a byte in time, only a deadline on the whole exchange ends it.
* :class:`GarbageServer` answers every ``POST`` with a 200 whose body is not a true acknowledgement (an
  HTML page, random bytes, JSON with the wrong counts, ...): a misrouted proxy, a captive portal.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, List, Optional, Union

import pytest

import trainguard
from trainguard.guard import reset_warnings

BASE = {"project": "p", "run_id": "r" * 32, "host": "h", "pid": 7, "rank": 0, "world_size": 1}
"""The identity of the envelopes these tests send."""


@pytest.fixture
def clean_sdk() -> Iterator[None]:
    """The SDK's once-only warnings reset before a test, and its global client shut down after it."""
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


class _SocketServer:
    """A listening socket served by one thread; ``url`` / ``target`` are what the SDK is given."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._connections = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self._lock:
            return self._connections

    def _count(self) -> None:
        with self._lock:
            self._connections += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=type(self).__name__, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._listener.close()

    def _serve(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HangingServer(_SocketServer):
    """Accepts, reads everything, never writes a byte."""

    def __init__(self) -> None:
        super().__init__()
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.bytes_received = 0

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        open_: List[socket.socket] = []
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        try:
                            conn, _ = self._listener.accept()
                        except OSError:
                            continue
                        conn.setblocking(False)
                        open_.append(conn)
                        sel.register(conn, selectors.EVENT_READ)
                        self._count()
                        continue
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        self.bytes_received += len(data)
                    else:  # the client gave up: forget it
                        sel.unregister(sock)
                        sock.close()
                        open_.remove(sock)
        finally:
            for conn in open_:
                conn.close()
            sel.close()


class FullBacklogServer(_SocketServer):
    """A listener whose accept queue is full (never accepted): new connections never complete."""

    def __init__(self) -> None:
        super().__init__()
        self._listener.listen(0)
        self._fillers: List[socket.socket] = []

    def start(self) -> None:
        for _ in range(4):  # a backlog of 0 still queues one connection; fill it, and then some
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self._fillers.append(filler)

    def stop(self) -> None:
        for filler in self._fillers:
            filler.close()
        self._listener.close()


class TricklingServer(_SocketServer):
    """Answers ``HTTP/1.1 200 OK`` and then one header byte every ``interval_s`` seconds, forever."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__()
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self.interval_s = interval_s

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self._count()
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self._stop.wait(self.interval_s):
                conn.sendall(b"a")
        except OSError:
            pass
        finally:
            conn.close()


AckBody = Union[bytes, Callable[[int], bytes]]
"""A fixed body, or one made from the number of events in the request."""


class GarbageServer:
    """``POST`` anything: 200 with ``body`` (``content_type``); ``.requests`` counts the posts."""

    def __init__(self, body: AckBody, content_type: str = "application/json") -> None:
        self.body = body
        self.content_type = content_type
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests += 1
                try:
                    count = len(json.loads(raw)["events"])
                except (ValueError, KeyError, TypeError):
                    count = 0
                body = owner.body(count) if callable(owner.body) else owner.body
                self.send_response(200)
                self.send_header("Content-Type", owner.content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="garbage-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> GarbageServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
