"""Offline transport: append each envelope as one JSON line to a local file (``file:///path.jsonl``).

The file can later be replayed into a backend (``trainguard replay``) or read by tests.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import IO, Any, Dict, List, Optional, Sequence

from ..core.events import encode_event
from .base import SendResult, Transport, TransportError


def path_from_file_url(endpoint: str) -> str:
    """``file:///abs/path.jsonl`` or ``file://relative.jsonl`` → a filesystem path."""
    parsed = urllib.parse.urlsplit(endpoint)
    path = urllib.parse.unquote(parsed.netloc + parsed.path)
    if not path:
        raise ValueError(f"file endpoint without a path: {endpoint!r}")
    return path


class FileTransport(Transport):
    """Appends JSON lines; a failing disk is a retryable error (the worker keeps the batch in memory)."""

    name = "file"

    def __init__(self, endpoint: str) -> None:
        self.path = path_from_file_url(endpoint)
        self._fh: Optional[IO[bytes]] = None

    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        lines: List[bytes] = [encode_event(event) + b"\n" for event in events]
        try:
            if self._fh is None:
                directory = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(directory, exist_ok=True)
                self._fh = open(self.path, "ab")
            self._fh.write(b"".join(lines))
            self._fh.flush()
        except OSError as exc:
            self.close()
            raise TransportError(f"cannot write {self.path}: {exc}", retryable=True,
                                 status="io") from None
        return SendResult(accepted=len(lines))

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None


class MemoryTransport(Transport):
    """Keeps every batch in a list (tests, and ``debug=True``)."""

    name = "memory"

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []

    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        self.events.extend(events)
        return SendResult(accepted=len(events))
