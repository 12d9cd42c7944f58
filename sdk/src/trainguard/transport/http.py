"""JSON over HTTP/1.1 with a kept-alive connection (stdlib only).

``POST <endpoint>/v1/ingest`` with ``{"events": [...]}``; the server answers 200 with per-item results.
Status mapping: 408, 429, 5xx and connection errors are retryable (429/503 honour Retry-After); 413 is not
retryable for this batch but the worker splits it; other 4xx are final.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any, Dict, Optional, Sequence, Tuple

from ..core.events import encode_batch
from .base import SendResult, Transport, TransportError, parse_retry_after

INGEST_PATH = "/v1/ingest"
# errors that mean "the server closed our idle kept-alive connection", not "the server is down"
_STALE_CONNECTION = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class HttpTransport(Transport):
    """Sends JSON batches to ``endpoint`` (``http://host:port[/prefix]`` or ``https://...``)."""

    name = "http"

    def __init__(self, endpoint: str, token: Optional[str], user_agent: str) -> None:
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        self._secure = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._secure else 80)
        self._path = parsed.path.rstrip("/") + INGEST_PATH
        self._headers = {"Content-Type": "application/json", "User-Agent": user_agent,
                         "Connection": "keep-alive"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: Optional[http.client.HTTPConnection] = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._secure else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn

    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        return _parse_result(self.exchange(encode_batch(events), timeout))

    def exchange(self, body: bytes, timeout: float, content_type: str = "application/json") -> bytes:
        """POST ``body`` (of ``content_type``; the agent relays protobuf bodies) and return the 200
        response's body; raises TransportError as described in the module doc."""
        reused = self._conn is not None
        try:
            status, data, retry_after = self._post(body, timeout, content_type)
        except _STALE_CONNECTION:
            self.close()
            if not reused:
                raise TransportError("connection dropped", retryable=True, status="connection") from None
            # a kept-alive connection the server closed (restart, idle timeout): one fresh try
            try:
                status, data, retry_after = self._post(body, timeout, content_type)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise TransportError(f"{type(exc).__name__}: {exc}", retryable=True,
                                     status="connection") from None
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise TransportError(f"{type(exc).__name__}: {exc}", retryable=True,
                                 status="connection") from None
        if status == 200:
            return data
        message = _error_message(data)
        if status in (408, 429) or status >= 500:
            raise TransportError(f"HTTP {status}: {message}", retryable=True, retry_after=retry_after,
                                 status=str(status))
        raise TransportError(f"HTTP {status}: {message}", retryable=False, status=str(status))

    def _post(self, body: bytes, timeout: float, content_type: str) -> Tuple[int, bytes, Optional[float]]:
        conn = self._connection(timeout)
        headers = self._headers if content_type == "application/json" else \
            dict(self._headers, **{"Content-Type": content_type})
        conn.request("POST", self._path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, data, parse_retry_after(response.getheader("Retry-After"))

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None


def _parse_result(data: bytes) -> SendResult:
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    rejected = doc.get("rejected") or []
    return SendResult(accepted=int(doc.get("accepted", 0) or 0),
                      duplicates=int(doc.get("duplicates", 0) or 0),
                      rejected=[r for r in rejected if isinstance(r, dict)])


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
