"""A chunked body past ``max_batch_bytes`` is a 413 (split it) even while the process bound on ingest bytes in
flight would refuse its chunk: the size is checked before the chunk is taken (found by the stop-40 review: on a
busy server such an upload got a retryable 429 the client would resend unchanged, forever)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, List

import pytest

from trainguard_server.gateway.http import Backpressure, RequestTooLarge, _Held, _read_body
from trainguard_server.gateway.inflight import InflightBytes


class _Streamed:
    """What _read_body reads of a Starlette request: its body as chunks."""

    def __init__(self, chunks: List[bytes]) -> None:
        self.chunks = chunks

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def _read(chunks: List[bytes], limit: int, inflight: InflightBytes) -> bytes:
    held = _Held(inflight, "b", 1.0)
    try:
        return asyncio.run(_read_body(_Streamed(chunks), limit, held))  # type: ignore[arg-type]
    finally:
        held.release()


def _busy() -> InflightBytes:
    """A process bound of 1,000 bytes: project 'a' holds 900, and 'b' 500 in another request (admitted as its
    one body): any more bytes of 'b' pass its share (half the bound: two projects hold bytes)."""
    inflight = InflightBytes(total=1_000, per_project=0)
    assert inflight.take("a", 900) is None
    assert inflight.take("b", 500) is None
    return inflight


def test_a_body_past_the_size_limit_is_413_even_when_the_server_is_busy() -> None:
    with pytest.raises(RequestTooLarge):
        _read([b"x" * 1_200], limit=1_000, inflight=_busy())  # 1,200 > 1,000: split it, not retry it


def test_a_body_within_the_limit_on_a_busy_server_is_still_429() -> None:
    with pytest.raises(Backpressure):
        _read([b"x" * 600], limit=10_000, inflight=_busy())  # past b's share: retry later


def test_what_fits_is_read_whole_and_released() -> None:
    inflight = InflightBytes(total=1_000, per_project=0)
    assert _read([b"ab", b"cd"], limit=4, inflight=inflight) == b"abcd"
    assert inflight.fits("b", 1_000) is None  # everything was given back
