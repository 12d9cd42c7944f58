"""A host clock that is wrong, corrected at the gateway from the request's own send time.

Contract: a request may carry ``x-trainguard-sent-at`` (HTTP header or gRPC metadata; the SDK's transports
and the agent send it): the unix time in ns at which its sender sent it, read from the clock that stamped the
request's events. The gateway compares it with its own receive time; when the two differ by at least
``clock_skew_correct_s`` (setting, default 30 s; 0: never), every event time of the request
(``time_unix_nano`` > 0) is shifted by that difference, rounded to whole seconds, before validation. So a job
on a host an hour behind is stored at the server's time from its very first batch (the SDK's own correction,
learned from the ``Date`` of the answers in ``trainguard/transport/clock.py``, starts with the second), and
one an hour ahead is not refused ``out_of_range``. The SDK sends the header in the clock of the times it
sends (after its own correction), so the two never add up.

* Absent: nothing shifted (older SDKs, other senders).
* Present but not one unsigned decimal integer of at most 19 digits, past int64 (``9999999999999999999``:
  before, accepted and ignored), or given twice: ``ValueError`` naming the header, which
  :meth:`~.ingest.Gateway.clock_offset` turns into ``InvalidRequest`` (HTTP 400 / gRPC INVALID_ARGUMENT);
  nothing of the request is queued.
* A shift that would take a time out of int64 leaves that time as it was (validation then judges it).
* Time in flight counts in the difference: below the threshold unless a request waited that long on the way.
  A sender can only move its own events' times, which it sets anyway.
Sentry's relay corrects clock drift from its envelopes' ``sent_at`` the same way.
"""

from __future__ import annotations

from typing import Any, List, Sequence

from trainguard.transport.clock import SENT_AT_HEADER

__all__ = ["SENT_AT_HEADER", "clock_offset", "shift_times"]

_NS = 1_000_000_000
_INT64_MAX = 2**63 - 1


def clock_offset(values: Sequence[str], received_ns: int, min_skew_s: float) -> int:
    """The offset (ns, whole seconds) to add to the event times of a request received at ``received_ns``
    whose ``x-trainguard-sent-at`` values are ``values``; 0 when absent or under ``min_skew_s``."""
    if not values:
        return 0
    if len(values) > 1:
        raise ValueError(f"{SENT_AT_HEADER} given {len(values)} times: send it once")
    text = values[0].strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        raise ValueError(f"{SENT_AT_HEADER}: {values[0][:40]!r} is not a time in unix nanoseconds "
                             "(one unsigned integer)")
    sent_ns = int(text)
    if sent_ns > _INT64_MAX:
        raise ValueError(f"{SENT_AT_HEADER}: {text!r} is past the int64 range of unix nanoseconds "
                         f"(at most {_INT64_MAX})")
    if min_skew_s <= 0:
        return 0
    skew = received_ns - sent_ns
    if abs(skew) < min_skew_s * _NS:
        return 0
    return round(skew / _NS) * _NS


def shift_times(events: Sequence[Any], offset_ns: int) -> List[int]:
    """Add ``offset_ns`` to each envelope's ``time_unix_nano`` (> 0) in place; the positions changed."""
    changed: List[int] = []
    if not offset_ns:
        return changed
    for k, event in enumerate(events):
        t = event.time_unix_nano
        if t > 0 and 0 < t + offset_ns <= _INT64_MAX:
            event.time_unix_nano = t + offset_ns
            changed.append(k)
    return changed

