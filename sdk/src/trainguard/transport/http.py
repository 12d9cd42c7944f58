"""JSON over HTTP/1.1 with a kept-alive connection (stdlib only).

``POST <endpoint>/v1/ingest`` with ``{"events": [...]}``; the server answers 200 with per-item results, and
only a 200 whose body acknowledges every event sent counts as delivered (:func:`parse_ack`; anything else
is a retryable ``"bad_ack"``).
Status mapping: 408, 429, 5xx and connection errors are retryable (429/503 honour Retry-After); 413 is not
retryable for this batch but the worker splits it; other 4xx are final.

Time bounds (a backend that hangs costs a bounded wait on the worker, then the batch is spooled):
``connect_timeout`` bounds establishing the connection (status ``"connect_timeout"``); ``read_timeout``
bounds each wait for the server while sending or reading its answer (status ``"timeout"``); both default to
(at most) the request's ``timeout``. The ``timeout`` given to :meth:`HttpTransport.send` bounds the whole
exchange, enforced by a
:class:`~.watchdog.SocketWatchdog` even against an answer trickled a byte at a time (status ``"timeout"``).
:meth:`HttpTransport.abort` cuts a request short from another thread (status ``"aborted"``). The answer's
body is read up to ``max_response_bytes``; more is not an ingest answer (status ``"bad_response"``). All of
these are retryable.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.events import encode_batch
from .base import SendResult, Transport, TransportError, check_ack, parse_retry_after
from .clock import CLOCK_SKEW_CORRECT_S, SENT_AT_HEADER, ServerClock, send_corrected, sent_at
from .watchdog import SocketWatchdog

INGEST_PATH = "/v1/ingest"
DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
"""The longest answer read: an acknowledgement with a rejection for each of 500 events is ~150 KB."""
# errors that mean "the server closed our idle kept-alive connection", not "the server is down"
_STALE_CONNECTION = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class _StaleConnection(Exception):
    """A reused kept-alive connection turned out closed by the server: worth one fresh try."""


class HttpTransport(Transport):
    """Sends JSON batches to ``endpoint`` (``http://host:port[/prefix]`` or ``https://...``)."""

    name = "http"

    def __init__(self, endpoint: str, token: Optional[str], user_agent: str, *,
                 connect_timeout: Optional[float] = None, read_timeout: Optional[float] = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 clock_skew_s: float = CLOCK_SKEW_CORRECT_S) -> None:
        """``connect_timeout`` / ``read_timeout``: seconds (None: up to the request's whole timeout); the SDK
        passes its ``connect_timeout`` / ``read_timeout`` options. ``clock_skew_s``: a host clock this far
        off the backend's (its answers' ``Date``) is corrected in the events sent (see clock.py; 0: never)."""
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be positive, got {max_response_bytes!r}")
        self._secure = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._secure else 80)
        self._path = parsed.path.rstrip("/") + INGEST_PATH
        self._headers = {"Content-Type": "application/json", "User-Agent": user_agent,
                         "Connection": "keep-alive"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_response_bytes = int(max_response_bytes)
        self._conn: Optional[http.client.HTTPConnection] = None
        self._watchdog = SocketWatchdog("trainguard-http-deadline")
        self._aborted = False
        self.clock = ServerClock(clock_skew_s)

    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        """Deliver ``events``; returns once the 200's body acknowledges every one of them (see
        :func:`parse_ack`), raises TransportError otherwise. Event times are corrected by the host clock's
        offset to the backend's once known (clock.py); when an answer first shows that offset, the events it
        refused as ``out_of_range`` are sent again, corrected, within the same ``timeout``."""
        return send_corrected(self.clock, events, timeout, lambda batch, left, offset: parse_ack(
            self.exchange(encode_batch(batch), left, clock_offset_ns=offset), len(batch)))

    def exchange(self, body: bytes, timeout: float, content_type: str = "application/json", *,
                 clock_offset_ns: int = 0) -> bytes:
        """POST ``body`` (of ``content_type``; the agent relays protobuf bodies) within ``timeout`` seconds
        and return the 200 response's body; raises TransportError as described in the module doc.
        ``clock_offset_ns``: how far the body's event times were shifted from this host's clock (its
        ``x-trainguard-sent-at`` header is in the same clock; clock.py)."""
        deadline = time.monotonic() + max(0.0, timeout)
        self._aborted = False
        try:
            status, data, retry_after = self._attempt(body, deadline, content_type, clock_offset_ns,
                                                      reused=self._conn is not None)
        except _StaleConnection:
            # a kept-alive connection the server closed (restart, idle timeout): one fresh try
            status, data, retry_after = self._attempt(body, deadline, content_type, clock_offset_ns,
                                                      reused=False)
        if status == 200:
            return data
        message = _error_message(data)
        if status in (408, 429) or status >= 500:
            raise TransportError(f"HTTP {status}: {message}", retryable=True, retry_after=retry_after,
                                 status=str(status))
        raise TransportError(f"HTTP {status}: {message}", retryable=False, status=str(status))

    def abort(self) -> None:
        self._aborted = True
        self._watchdog.fire("aborted")

    def _attempt(self, body: bytes, deadline: float, content_type: str, clock_offset_ns: int, *,
                 reused: bool) -> Tuple[int, bytes, Optional[float]]:
        """One request on the kept-alive connection (opened first if needed), within ``deadline``."""
        conn = self._connection(deadline)
        sock = conn.sock
        assert sock is not None
        headers = dict(self._headers, **{SENT_AT_HEADER: sent_at(clock_offset_ns)})
        if content_type != "application/json":
            headers["Content-Type"] = content_type
        try:
            with self._watchdog.guard(sock, deadline):
                if self._aborted:
                    raise TransportError("request aborted", retryable=True, status="aborted")
                per_wait = max(0.001, deadline - time.monotonic())
                sock.settimeout(per_wait if self.read_timeout is None else min(self.read_timeout, per_wait))
                conn.request("POST", self._path, body=body, headers=headers)
                response = conn.getresponse()
                self.clock.observe(response.getheader("Date"), time.time_ns())
                data, complete = _read_bounded(response, self.max_response_bytes)
                status = response.status
                retry_after = parse_retry_after(response.getheader("Retry-After"))
        except _STALE_CONNECTION as exc:
            self._drop_connection()
            self._raise_if_cut_short(deadline)
            if reused:
                raise _StaleConnection() from None
            raise TransportError(f"connection dropped ({type(exc).__name__})", retryable=True,
                                 status="connection") from None
        except socket.timeout:
            self._drop_connection()
            self._raise_if_cut_short(deadline)
            raise TransportError(f"the backend did not answer within read_timeout={self.read_timeout} s",
                                 retryable=True, status="timeout") from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            self._raise_if_cut_short(deadline)
            raise TransportError(f"{type(exc).__name__}: {exc}", retryable=True,
                                 status="connection") from None
        except TransportError:
            self._drop_connection()
            raise
        if self._watchdog.fired:  # what was read ended at our own shutdown of the socket: not an answer
            self._drop_connection()
            self._raise_if_cut_short(deadline)
        if not complete or response.will_close:
            self._drop_connection()  # unread bytes, or the server said so: not reusable
        if not complete and status == 200:
            raise TransportError(f"the backend's 200 answer is longer than {self.max_response_bytes} bytes: "
                                 f"not an ingest acknowledgement", retryable=True, status="bad_response")
        return status, data, retry_after

    def _raise_if_cut_short(self, deadline: float) -> None:
        """The TransportError for an exchange the watchdog ended (deadline or abort), if it did."""
        if self._watchdog.fired == "aborted" or self._aborted:
            raise TransportError("request aborted", retryable=True, status="aborted") from None
        if self._watchdog.fired == "timeout" or time.monotonic() >= deadline:
            raise TransportError("the request took longer than its send timeout", retryable=True,
                                 status="timeout") from None

    def _connection(self, deadline: float) -> http.client.HTTPConnection:
        """The kept-alive connection, or a new one connected within ``connect_timeout`` (and the deadline)."""
        if self._conn is not None and self._conn.sock is not None:
            return self._conn
        self._drop_connection()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._aborted:
            raise TransportError("no time left to connect", retryable=True, status="timeout")
        connect_timeout = remaining if self.connect_timeout is None else min(self.connect_timeout, remaining)
        cls = http.client.HTTPSConnection if self._secure else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=connect_timeout)
        try:
            conn.connect()
        except socket.timeout:
            conn.close()
            raise TransportError(f"no connection to {self._host}:{self._port} within "
                                 f"{connect_timeout:g} s (connect_timeout)", retryable=True,
                                 status="connect_timeout") from None
        except OSError as exc:
            conn.close()
            raise TransportError(f"{type(exc).__name__}: {exc}", retryable=True,
                                 status="connection") from None
        self._conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def close(self) -> None:
        self._drop_connection()
        self._watchdog.stop()


def _read_bounded(response: http.client.HTTPResponse, limit: int) -> Tuple[bytes, bool]:
    """Up to ``limit`` bytes of ``response``'s body, and whether that was all of it."""
    chunks: List[bytes] = []
    total = 0
    while total <= limit:
        chunk = response.read(min(64 * 1024, limit + 1 - total))
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)[:limit], False


def parse_ack(data: bytes, count: int) -> SendResult:
    """The gateway's JSON acknowledgement of a request of ``count`` events:
    ``{"accepted": a, "duplicates": d, "rejected": [{"index", "event_id", "code", "message"}, ...]}``.

    Raises a retryable TransportError (status ``"bad_ack"``) for anything else: not JSON (an HTML page,
    random bytes, nothing), fields missing or of the wrong type, or counts that do not add up to ``count``
    (:func:`~.base.check_ack`).
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise TransportError(f"the backend answered 200 with {len(data)} bytes that are not JSON: "
                             f"{data[:80]!r}", retryable=True, status="bad_ack") from None
    fields = ("accepted", "duplicates", "rejected")
    if not isinstance(doc, dict) or any(name not in doc for name in fields) \
            or not isinstance(doc["rejected"], list):
        raise TransportError(f"the backend answered 200 without an acknowledgement's fields {fields}: "
                             f"{data[:80]!r}", retryable=True, status="bad_ack")
    rejected: List[Dict[str, Any]] = []
    for item in doc["rejected"]:
        if not (isinstance(item, dict) and isinstance(item.get("code", ""), str)
                and isinstance(item.get("message", ""), str)):
            raise TransportError(f"the backend's 200 lists a rejection that is not one: {item!r:.80}",
                                 retryable=True, status="bad_ack")
        rejected.append(item)
    check_ack(doc["accepted"], doc["duplicates"], [item.get("index") for item in rejected], count)
    return SendResult(accepted=doc["accepted"], duplicates=doc["duplicates"], rejected=rejected)


def _error_message(data: bytes) -> str:
    try:
        doc = json.loads(data)
        if isinstance(doc, dict):
            detail = doc.get("detail", doc.get("message", doc.get("error")))
            if detail is not None:
                return str(detail)[:500]
    except ValueError:
        pass
    return data[:500].decode("utf-8", "replace")
