"""Decode a JSON ``{"events": [...]}`` body event by event, for the bodies ``json.loads`` gives up on.

``json.loads`` recurses once per nesting level and raises ``RecursionError`` near 1,000 levels, whatever
the nesting is. :func:`split_events_json` is the fallback :func:`~.ingest.batch_from_json` takes then: it
walks the top-level object and the ``events`` array itself and decodes each element with the C decoder on
its own, so one element nested too deeply costs only itself: it comes back as a :class:`TooDeep` (the field
it sits under, its depth, its ``event_id`` when one was readable) instead of failing the whole request. The
walk over such an element is iterative (no recursion at any depth) and linear in its size.

Contract: the same values ``json.loads(text)["events"]`` would give for every element that decodes, in
order; ``ValueError`` (a message for the client) for what is not ``{"events": [...]}`` JSON -- an unknown
top-level field, ``events`` given twice, a non-object top level, a syntax error, an unterminated element, or
what the decoder's hooks refuse in an element that decodes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

__all__ = ["TooDeep", "split_events_json"]

_WS = re.compile(r"[ \t\n\r]*")
# a JSON string (escapes included) or one bracket; everything else inside a value needs no tracking
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN, _CLOSE = "[{", "]}"


@dataclass(frozen=True)
class TooDeep:
    """An element nested too deeply to decode: ``field`` is the top-level key of the (object) element under
    which the nesting is deepest ("" when the element itself is an array), ``depth`` that nesting,
    ``event_id`` the element's ``event_id`` when it is a plain string read before the deep part."""

    field: str
    depth: int
    event_id: str


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def _string(token: str) -> str:
    try:
        value = json.loads(token)
    except ValueError as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    return str(value)


def _walk_deep(text: str, pos: int) -> Tuple[TooDeep, int]:
    """Scan the container value starting at ``pos`` without recursion: (what it is, the index after it)."""
    depth = max_depth = 0
    key = deepest_key = event_id = ""
    in_object = text[pos] == "{"
    for match in _TOKEN.finditer(text, pos):
        token = match.group()
        if token[0] == '"':
            if depth == 1 and in_object:  # the element's own fields: key, then (maybe) a string value
                after = _skip_ws(text, match.end())
                if text[after:after + 1] == ":":
                    key = _string(token)
                elif key == "event_id":
                    event_id = _string(token)
        elif token in _OPEN:
            depth += 1
            if depth > max_depth:
                max_depth = depth
                if depth > 1:
                    deepest_key = key
        else:
            depth -= 1
            if depth == 0:
                return TooDeep(deepest_key, max_depth, event_id), match.end()
    raise ValueError("malformed JSON: unterminated array or object")


def _expect(text: str, pos: int, char: str, what: str) -> int:
    pos = _skip_ws(text, pos)
    if text[pos:pos + 1] != char:
        raise ValueError(f"malformed JSON: expected {what} at char {pos}")
    return pos + 1


def _events_array(text: str, pos: int, decoder: json.JSONDecoder) -> Tuple[List[Any], int]:
    pos = _skip_ws(text, pos)
    if text[pos:pos + 1] != "[":
        raise ValueError("IngestRequest.events: expected an array")
    items: List[Any] = []
    pos = _skip_ws(text, pos + 1)
    if text[pos:pos + 1] == "]":
        return items, pos + 1
    while True:
        pos = _skip_ws(text, pos)
        try:
            value, pos = decoder.raw_decode(text, pos)
        except RecursionError:
            if text[pos:pos + 1] not in ("[", "{"):  # pragma: no cover - only containers nest
                raise ValueError(f"malformed JSON at char {pos}") from None
            value, pos = _walk_deep(text, pos)
        except ValueError as exc:  # JSONDecodeError, or the decoder's hooks (a NaN token, a duplicate key)
            raise ValueError(f"malformed JSON: {exc}") from None
        items.append(value)
        pos = _skip_ws(text, pos)
        if text[pos:pos + 1] == "]":
            return items, pos + 1
        pos = _expect(text, pos, ",", "',' or ']' in the events array")


def split_events_json(text: str, decoder: json.JSONDecoder) -> List[Any]:
    """The elements of ``text``'s ``events`` array: decoded values, or :class:`TooDeep` for those nested too
    deeply (see the module doc)."""
    pos = _skip_ws(text, 0)
    if text[pos:pos + 1] != "{":
        raise ValueError('IngestRequest: expected an object with an "events" array, nested too deeply to '
                         'decode')
    events: Optional[List[Any]] = None
    pos = _skip_ws(text, pos + 1)
    if text[pos:pos + 1] != "}":
        while True:
            pos = _skip_ws(text, pos)
            try:
                key, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise ValueError(f"malformed JSON: {exc}") from None
            if not isinstance(key, str):
                raise ValueError(f"malformed JSON: expected a field name at char {pos}")
            if key != "events":
                raise ValueError(f"IngestRequest: unknown field {json.dumps(key)} "
                                 f"(trainguard.v1.IngestRequest has: events)")
            if events is not None:
                raise ValueError('malformed JSON: duplicate key "events" in one object (each field may be '
                                 'given once)')
            pos = _expect(text, pos, ":", "':'")
            events, pos = _events_array(text, pos, decoder)
            pos = _skip_ws(text, pos)
            if text[pos:pos + 1] == "}":
                break
            pos = _expect(text, pos, ",", "',' or '}'")
    if _skip_ws(text, pos + 1) != len(text):
        raise ValueError(f"malformed JSON: extra data at char {_skip_ws(text, pos + 1)}")
    if events is None:
        raise ValueError("IngestRequest.events: required (an array of envelopes)")
    return events
