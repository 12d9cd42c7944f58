"""Helpers shared by the routers: pagination limits, store ValueErrors as 400, NaN-safe floats."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from fastapi import HTTPException, Query

from trainguard.core.events import wire_float

T = TypeVar("T")

MAX_LIMIT = 500
LimitQuery = Query(50, ge=1, le=MAX_LIMIT, description=f"page size, 1..{MAX_LIMIT}")
CursorQuery = Query(None, max_length=512, description="opaque cursor from the previous page")


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
