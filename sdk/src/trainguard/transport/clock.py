"""The backend's clock, as the ``Date`` of its answers tells it, for hosts whose clock is wrong.

A job on a host whose clock is off (a container without NTP, a VM resumed from a snapshot) stamps its events
with that clock. The backend refuses events more than ``max_future_skew_s`` (300 s) ahead of its own clock or
older than ``max_past_age_s`` (30 days), every one of them, and stores those within the window at the wrong
time (a run an hour behind is an hour old the moment it starts). :class:`ServerClock` learns the offset from
the answers' ``Date`` (the HTTP header; a gRPC answer's ``date`` trailing metadata, same format: whole
seconds); once the host's clock is at least ``min_skew_s`` off, every
event's ``time_unix_nano`` is shifted by that offset when sent (what the spool holds keeps the host's time and
is shifted when replayed). Skews below ``min_skew_s`` are left alone: they are within the backend's window
and a ``Date`` of one-second resolution cannot tell them better.
"""

from __future__ import annotations

import email.utils
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..guard import warn_once
from .base import SendResult, TransportError

CLOCK_SKEW_CORRECT_S = 30.0
"""A host clock at least this many seconds off the backend's is corrected (0: never)."""

SENT_AT_HEADER = "x-trainguard-sent-at"
"""Request header (HTTP) / metadata key (gRPC): when the request was sent, unix ns, by the clock that stamped
its events. The gateway shifts the event times of a request whose ``sent-at`` is far off its own clock, so
even the first batch, sent before any answer told the offset, is stored at the server's time
(``trainguard_server/gateway/sent_at.py``)."""


def sent_at(offset_ns: int = 0) -> str:
    """The ``x-trainguard-sent-at`` value for a request sent now whose event times were shifted by
    ``offset_ns`` (:meth:`ServerClock.apply`; 0 for times as this host stamped them)."""
    return str(time.time_ns() + offset_ns)


class ServerClock:
    """The offset (ns) to add to this host's event times to get the backend's; 0 until learned or when the
    host's clock is within ``min_skew_s`` of the backend's."""

    def __init__(self, min_skew_s: float = CLOCK_SKEW_CORRECT_S) -> None:
        self.min_skew_ns = int(min_skew_s * 1e9)
        self.offset_ns = 0
        self.known = False  # an answer with a Date was seen
        self._lock = threading.Lock()

    def observe(self, date_header: Optional[str], local_ns: int) -> None:
        """Learn from an answer's ``Date`` header received at this host's ``local_ns``; never raises."""
        if not date_header or self.min_skew_ns <= 0:
            return
        try:
            server = email.utils.parsedate_to_datetime(date_header)
            server_ns = int(server.timestamp()) * 1_000_000_000 + 500_000_000  # the middle of its second
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        skew = server_ns - local_ns
        new = round(skew / 1e9) * 1_000_000_000 if abs(skew) >= self.min_skew_ns else 0
        with self._lock:
            self.known = True
            if abs(new - self.offset_ns) < self.min_skew_ns:
                return
            self.offset_ns = new
        if new:
            side = "behind" if new > 0 else "ahead of"
            warn_once(f"clock:{new}", f"this host's clock is {abs(new) // 1_000_000_000} s {side} the "
                      "backend's (the Date of its answers): event times are corrected by that much when sent "
                      "(fix the host's clock: NTP)")

    def apply(self, events: Sequence[Dict[str, Any]],
              offset: Optional[int] = None) -> Sequence[Dict[str, Any]]:
        """``events`` with ``time_unix_nano`` shifted by ``offset`` (default: the offset now; copies: the
        originals are untouched)."""
        if offset is None:
            offset = self.offset_ns
        if not offset:
            return events
        out: List[Dict[str, Any]] = []
        for event in events:
            t = event.get("time_unix_nano")
            out.append(dict(event, time_unix_nano=t + offset) if type(t) is int and t > 0 else event)
        return out


def send_corrected(clock: ServerClock, events: Sequence[Dict[str, Any]], timeout: float,
                   send_once: Callable[[Sequence[Dict[str, Any]], float, int], SendResult]) -> SendResult:
    """``send_once(events, timeout, offset_ns)`` with event times corrected by ``clock`` (``offset_ns``: by
    how much, for the request's ``x-trainguard-sent-at``, which must be in the same clock); when that answer
    first showed the offset (``send_once`` calls :meth:`ServerClock.observe`), the events it refused as
    ``out_of_range`` are sent again, corrected, within what is left of ``timeout`` -- their indexes and any
    second refusals mapped back to ``events``. A failure of that second send leaves them counted as refused
    (the rest of the batch was acknowledged); a failure of the first raises as ``send_once`` does."""
    deadline = time.monotonic() + max(0.0, timeout)
    before = clock.offset_ns
    result = send_once(clock.apply(events, before), timeout, before)
    if clock.offset_ns == before or not result.rejected:
        return result
    stale = [r for r in result.rejected if r.get("code") == "out_of_range"
             and type(r.get("index")) is int and 0 <= r["index"] < len(events)]
    if not stale:
        return result
    again = [events[r["index"]] for r in stale]
    try:
        offset = clock.offset_ns
        second = send_once(clock.apply(again, offset), max(0.0, deadline - time.monotonic()), offset)
    except TransportError:
        return result
    kept = [r for r in result.rejected if r not in stale]
    kept += [dict(r, index=stale[r["index"]]["index"]) for r in second.rejected
             if type(r.get("index")) is int and 0 <= r["index"] < len(stale)]
    return SendResult(accepted=result.accepted + second.accepted,
                      duplicates=result.duplicates + second.duplicates, rejected=kept)
