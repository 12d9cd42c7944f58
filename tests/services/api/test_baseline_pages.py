"""``GET /api/v1/baselines`` answers a page at a time (``limit``, ``cursor``; 50 by default), in name order,
reading only the page's baselines. Before (stop 44), it answered every baseline of the project at once:
2,000 of them were one 5.1 MB answer of 0.47 s, and nothing bounded how many a read token may define."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard_server.api.routes.gate import BASELINES_PAGE
from trainguard_server.storage.common import encode_cursor

NAMES = [f"b{k:03d}" for k in range(BASELINES_PAGE + 5)]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("baselines")) as server:
        r = server.post_events([event("base-run", step) for step in range(3)])
        assert r.status_code == 200, r.text
        server.wait_for(lambda: server.get("/api/v1/runs/base-run").status_code == 200)
        for name in reversed(NAMES):  # defined out of order: the listing sorts by name
            r = server.client.put(f"/api/v1/baselines/{name}", json={"runs": ["base-run"]},
                                  headers=server.read_headers)
            assert r.status_code == 200, r.text
        yield server


def _page(live: LiveServer, **params: Any) -> Dict[str, Any]:
    r = live.get("/api/v1/baselines", **params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_the_default_page_is_bounded_and_the_cursor_walks_every_baseline_once(live: LiveServer) -> None:
    first = _page(live)
    assert [b["name"] for b in first["items"]] == NAMES[:BASELINES_PAGE]  # was: all 55 in one answer
    assert first["next_cursor"]
    seen: List[str] = []
    page = _page(live, limit=7)
    while True:
        seen += [b["name"] for b in page["items"]]
        assert len(page["items"]) <= 7
        if not page["next_cursor"]:
            break
        page = _page(live, limit=7, cursor=page["next_cursor"])
    assert seen == NAMES


def test_the_last_page_has_no_cursor(live: LiveServer) -> None:
    page = _page(live, limit=len(NAMES))
    assert len(page["items"]) == len(NAMES) and page["next_cursor"] is None


def test_bad_limits_and_cursors_are_refused(live: LiveServer) -> None:
    assert live.get("/api/v1/baselines", limit=0).status_code == 422
    assert live.get("/api/v1/baselines", limit=501).status_code == 422
    r = live.get("/api/v1/baselines", cursor="not-a-cursor")
    assert r.status_code == 400 and "cursor" in r.json()["detail"], r.text
    for other in (encode_cursor("baselines", ["another-project"], ["b000"]),  # another project's page
                  encode_cursor("runs", ["default"], ["b000"])):  # another listing's
        assert live.get("/api/v1/baselines", cursor=other).status_code == 400
