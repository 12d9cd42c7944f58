"""Helpers shared by the routers: pagination limits, pages bounded by bytes, store ValueErrors as 400,
NaN-safe floats."""

from __future__ import annotations

import json
from typing import Any, Callable, List, Optional, Tuple, TypeVar

from fastapi import HTTPException, Query

from trainguard.core.events import wire_float

from ...storage.base import Page

T = TypeVar("T")

MAX_LIMIT = 500
LimitQuery = Query(50, ge=1, le=MAX_LIMIT, description=f"page size, 1..{MAX_LIMIT}")
CursorQuery = Query(None, max_length=512, description="opaque cursor from the previous page")


#: events read from the store at first for a byte-bounded page (:func:`pages_within`): the most a page
#: can pass its byte bound by, in events
FIRST_CHUNK = 8


def pages_within(fetch: Callable[[int, Optional[str]], Page[T]], limit: int, cursor: Optional[str],
                 max_bytes: int, size: Callable[[T], int]) -> Tuple[List[T], Optional[str]]:
    """Up to ``limit`` items from the store's ``fetch(n, cursor)`` pages, stopping once their ``size``
    passes ``max_bytes`` (0: no bound); the items and the cursor after the last one (None at the end).

    A page of events was ``limit`` events whatever their size (each up to ``max_event_bytes``): one request
    could build a 155 MB answer. The store is read in chunks, the first :data:`FIRST_CHUNK` events and the
    next ones sized from the bytes an event took so far, and the page ends with the chunk that passes the
    bound, on that chunk's own cursor, so following the cursors gives every item once. Small items take one
    or two store reads for a full page."""
    items: List[T] = []
    used = 0
    chunk = min(limit, FIRST_CHUNK) if max_bytes else limit
    while True:
        page = fetch(chunk, cursor)
        items += page.items
        cursor = page.next_cursor
        if max_bytes:
            used += sum(size(item) for item in page.items)
        if cursor is None or len(items) >= limit or not page.items or (max_bytes and used >= max_bytes):
            return items, cursor
        per_item = max(1, used // len(items))
        chunk = max(1, min(limit - len(items), (max_bytes - used) // per_item + 1))


def event_bytes(event: Any) -> int:
    """About what a stored event takes in an answer: its text and its payload as JSON."""
    return len(event.text) + len(json.dumps(event.payload, default=str))


def bad_request_on_value_error(call: Callable[[], T]) -> T:
    """Run a store call; a ValueError (bad cursor, bad query syntax) becomes a 400 with its message."""
    try:
        return call()
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def not_found(what: str, ident: str) -> HTTPException:
    return HTTPException(404, f"{what} {ident!r} not found")


def wf(value: Any) -> Any:
    """A float as the wire writes it (NaN/Inf as strings); anything else unchanged."""
    return wire_float(value) if isinstance(value, float) else value
