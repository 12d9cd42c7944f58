"""Timestamps as training jobs write them, to unix nanoseconds (pure; the local time zone is the only input
besides the text).

Contract:

* :func:`number_to_ns`: a unix time in seconds, milliseconds, microseconds or nanoseconds (told apart by
  magnitude: >= 1e17 ns, >= 1e14 µs, >= 1e11 ms, else s). Numbers below :data:`MIN_UNIX_SECONDS` (1e8 s,
  March 1973) are not timestamps -- a ``time`` field holding a step duration stays a metric -- and give None,
  as do NaN, infinities and booleans.
* :func:`parse_time_value`: a JSON value (number, numeric string or ISO 8601 string) to ns, else None.
* :func:`parse_iso` / :func:`leading_timestamp`: ``2024-05-01T12:00:00Z``, ``2024-05-01 12:00:00,123``
  (Python ``logging``), ``...+02:00`` offsets, fractions up to nanoseconds, optionally in brackets. Text
  without an offset is **local time** (as ``logging`` prints it; set ``TZ`` to read it otherwise).
  :func:`leading_timestamp` also reads glog / c10 records (``E1129 08:12:43.061727 ...`` and
  ``[E1129 08:12:43.061727749 ProcessGroupNCCL.cpp:632]``, and c10's unpadded month: ``[E626 ...]`` is
  June 26), which carry no year: ``year`` supplies it (:func:`leading_stamp_year` says the year a dated line
  states, which the log reader hands to the glog lines after it). Given ``near`` (the log's stamp before it,
  or its first dated line's), a yearless stamp takes instead the year among ``year`` and the ones either side
  that puts it nearest ``near``: a glog line after ``2024-12-31 23:59:58`` stamped ``E0101 00:00:03`` is of
  2025 (a paste crossing a new year), one before ``2025-01-01 00:00:02`` stamped ``E1231`` of 2024.
* :func:`leading_stamp`: the same with the stamp's **precision** in ns -- ``10 ** (9 - digits)`` for the
  fraction digits written (1 s without a fraction, 1 ms for ``logging``'s ``,123``, 1 µs for glog, at
  least 1 ns): the line was written some time in ``[stamp, stamp + precision)``.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Tuple

MIN_UNIX_SECONDS = 1e8

_ISO_RE = re.compile(
    r"(?P<date>\d{4})-(?P<mon>\d{2})-(?P<day>\d{2})[T ](?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})"
    r"(?:[.,](?P<frac>\d{1,9})\d*)?\s?(?P<tz>Z|[+-]\d{2}:?\d{2})?"
)
_LEADING_ISO_RE = re.compile(r"^\s*\[?\s*" + _ISO_RE.pattern)
_GLOG_RE = re.compile(
    r"^\s*\[?[IWEF](?P<mon>1[0-2]|0?[1-9])(?P<day>[0-3]\d) (?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})"
    r"(?:\.(?P<frac>\d{1,9})\d*)?"
)


def number_to_ns(value: float) -> Optional[int]:
    """``value`` as a unix time in ns (unit by magnitude), or None when it cannot be one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value >= 1e17:
        return int(value)
    if value >= 1e14:
        return int(value * 1_000)
    if value >= 1e11:
        return int(value * 1_000_000)
    if value >= MIN_UNIX_SECONDS:
        return round(value * 1e6) * 1_000  # microsecond precision: floats hold no more
    return None


def parse_time_value(value: Any) -> Optional[int]:
    """A metrics record's time field (number, numeric string, ISO 8601 string) in unix ns, or None."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return number_to_ns(float(text))
        except ValueError:
            return parse_iso(text)
    return number_to_ns(value)


def _fraction_ns(frac: Optional[str]) -> int:
    return int((frac or "0").ljust(9, "0")[:9])


def _precision_ns(frac: Optional[str]) -> int:
    return 10 ** (9 - min(9, len(frac or "")))


def _to_ns(match: re.Match[str], year: int) -> Optional[int]:
    groups = match.groupdict()
    try:
        naive = datetime(year, int(groups["mon"]), int(groups["day"]), int(groups["h"]), int(groups["m"]),
                         int(groups["s"]))
    except ValueError:
        return None
    tz = groups.get("tz")
    if tz:
        if tz == "Z":
            offset = timezone.utc
        else:
            sign = -1 if tz[0] == "-" else 1
            digits = tz[1:].replace(":", "")
            offset = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
        stamp = naive.replace(tzinfo=offset)
    else:
        stamp = naive.astimezone()  # naive = local time, as logging prints it
    return int(stamp.timestamp()) * 1_000_000_000 + _fraction_ns(groups.get("frac"))


def parse_iso(text: str) -> Optional[int]:
    """An ISO 8601 date-time anywhere at the start of ``text`` (see the module doc), in ns; else None."""
    match = _ISO_RE.match(text.strip())
    if match is None:
        return None
    return _to_ns(match, int(match.group("date")))


def leading_stamp(line: str, year: int) -> Optional[Tuple[int, int]]:
    """(the timestamp a log line starts with, in ns; its precision, in ns) -- ISO 8601 or glog (``year`` for
    glog); else None."""
    found = leading_stamp_year(line, year)
    return None if found is None else found[:2]


NEAR_YEAR_NS = 182 * 86_400 * 10**9
"""A yearless stamp read in ``year`` within this of ``near`` (half a year, less a day) is nearest in that
year: the same date a year either side lies at least 183 days away."""


def _glog_near(match: re.Match[str], year: int, near: int) -> Tuple[Optional[int], Optional[int]]:
    """(the yearless stamp in the year of ``year - 1, year, year + 1`` that puts it nearest ``near``, that
    year when it is not ``year`` else None)."""
    stamp = _to_ns(match, year)
    if stamp is not None and abs(stamp - near) <= NEAR_YEAR_NS:
        return stamp, None  # the common case: one datetime
    best: Optional[Tuple[int, int]] = None
    for candidate in (year - 1, year, year + 1):
        found = stamp if candidate == year else _to_ns(match, candidate)  # Feb 29 exists in leap years only
        if found is not None and (best is None or abs(found - near) < abs(best[0] - near)):
            best = (found, candidate)
    if best is None:
        return None, None
    return best[0], (None if best[1] == year else best[1])


def leading_stamp_year(line: str, year: int,
                       near: Optional[int] = None) -> Optional[Tuple[int, int, Optional[int]]]:
    """:func:`leading_stamp` and the year the line's ISO date states (None for a yearless glog stamp, read
    with ``year``); None when the line starts with no timestamp. ``near`` (ns): a yearless stamp takes the
    year of ``year - 1, year, year + 1`` nearest it (see the module doc), said as the third item when it is
    not ``year`` (the year the glog lines after it are read with)."""
    head = line[:64]
    match = _LEADING_ISO_RE.match(head)
    stated: Optional[int] = None
    if match is not None:
        stated = int(match.group("date"))
        stamp = _to_ns(match, stated)
    else:
        match = _GLOG_RE.match(head)
        if match is None:
            return None
        if near is None:
            stamp = _to_ns(match, year)
        else:
            stamp, stated = _glog_near(match, year, near)
    return None if stamp is None else (stamp, _precision_ns(match.group("frac")), stated)


def leading_timestamp(line: str, year: int) -> Optional[int]:
    """The timestamp a log line starts with (ISO 8601 or glog; ``year`` for glog), in ns; else None."""
    found = leading_stamp(line, year)
    return None if found is None else found[0]
