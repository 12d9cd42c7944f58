"""A page of a run's events (or of search hits) was ``limit`` events whatever their size: events are legal
up to ``max_event_bytes`` (1 MiB), so one read token asking ``GET /api/v1/runs/{run}/events?limit=500`` of a run
with 500 log events of ~190 KB got one 155 MB answer, the server's resident memory going 210 -> 822 MB for it
and to 3.06 GB (1.5 GB kept) with 8 at once, the slots one project may hold. Now a page stops once its events
pass ``api_max_page_bytes`` (8 MiB): fewer than ``limit`` items, with ``next_cursor`` going on from there,
so following the cursors still gives every event exactly once. Small events fill ``limit`` as before.
Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server

FAT = 60  # events of ~190 KB of log text: ~11 MB as JSON, more than one page may hold
SMALL = 120


def _log_event(run_id: str, step: int, size: int) -> Dict[str, Any]:
    e = event(run_id, step)
    e.pop("metrics")
    e["log"] = {"logger": "l" * size, "level": "ERROR", "message": f"needle {step} " + "m" * size,
                "source": "s" * size}
    return e


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        for start in range(0, FAT, 20):
            r = server.post_events([_log_event("fat", s, 63_000) for s in range(start, start + 20)])
            assert r.json()["accepted"] == 20, r.text
        assert server.post_events([_log_event("small", s, 10) for s in range(SMALL)]).json()["accepted"] == SMALL
        server.wait_for(lambda: _stored(server, "small") == SMALL and _stored(server, "fat") == FAT, timeout=60)
        yield server


def _stored(live: LiveServer, run_id: str) -> int:
    count, cursor = 0, None
    while True:
        r = live.get(f"/api/v1/runs/{run_id}/events", limit=500, **({"cursor": cursor} if cursor else {}))
        if r.status_code != 200:
            return 0
        count += len(r.json()["items"])
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return count


def _page(live: LiveServer, path: str, **params: Any) -> tuple[List[Dict[str, Any]], Optional[str], int]:
    r = live.get(path, **params)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["items"], body["next_cursor"], len(r.content)


def _all(live: LiveServer, path: str, **params: Any) -> tuple[List[int], int]:
    """The sizes of the pages of ``path`` (limit 500), and the distinct events in them."""
    sizes, seen, cursor = [], [], None
    while True:
        items, cursor, size = _page(live, path, limit=500, **params, **({"cursor": cursor} if cursor else {}))
        sizes.append(size)
        assert items  # a page holds at least one whole event, however big
        seen += [i["event"]["event_id"] if "event" in i else i["event_id"] for i in items]
        if cursor is None:
            break
    assert len(seen) == len(set(seen))  # no event twice across pages
    return sizes, len(set(seen))


def test_a_page_of_fat_events_stops_near_the_byte_bound(live: LiveServer) -> None:
    items, cursor, size = _page(live, "/api/v1/runs/fat/events", limit=500)
    assert cursor is not None and len(items) < FAT  # was: all 60 in one 11+ MB answer
    assert size < 12 * 2**20
    sizes, count = _all(live, "/api/v1/runs/fat/events")
    assert count == FAT and len(sizes) >= 2
    assert items[0]["text"].startswith("needle 0 ") or "needle 0 " in json.dumps(items[0])


def test_search_pages_are_bounded_the_same_way(live: LiveServer) -> None:
    items, cursor, _ = _page(live, "/api/v1/search", q="needle", run_id="fat", limit=500)
    assert cursor is not None and len(items) < FAT
    assert _all(live, "/api/v1/search", q="needle", run_id="fat")[1] == FAT


def test_a_walk_one_event_at_a_time_gives_each_once(live: LiveServer) -> None:
    seen, cursor = [], None
    while True:
        items, cursor, _ = _page(live, "/api/v1/runs/fat/events", limit=1, **({"cursor": cursor} if cursor else {}))
        assert len(items) == 1 or cursor is None
        seen += [i["event_id"] for i in items]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == FAT


def test_small_events_fill_the_limit_as_before(live: LiveServer) -> None:
    items, cursor, _ = _page(live, "/api/v1/runs/small/events", limit=100)
    assert len(items) == 100 and cursor is not None
    items, cursor, _ = _page(live, "/api/v1/runs/small/events", limit=500)
    assert len(items) == SMALL and cursor is None
