"""Issue 18, finding 9 (read side): integers beyond int64 -- ``rank``, ``start_step``/``end_step``, and inside
forged ``events`` / ``search`` / listing cursors -- reached SQLite and answered 500 (``OverflowError``). Now a
query parameter beyond int64 is a 422 naming it (after the read token is checked), the served OpenAPI states
the bounds, and a cursor holding such an integer is a 400 ``invalid cursor``. Against ``trainguard serve``
(EmbeddedServer: SQLite stores, uvicorn on 127.0.0.1)."""

from __future__ import annotations

from typing import Any, Dict, Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard_server.storage.common import encode_cursor

HUGE = "99999999999999999999"  # > 2**63 - 1
INT64_MAX = 2**63 - 1
RUN = "int64-run"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        r = server.post_events([event(RUN, step=s) for s in range(5)]
                               + [event(RUN, step=5, severity="ERROR", metrics=None,
                                        log={"logger": "train", "message": "loss went nan at step 5"})])
        assert (r.status_code, r.json()["accepted"]) == (200, 6), r.text
        server.wait_for(lambda: server.get(f"/api/v1/runs/{RUN}").status_code == 200
                        and bool(server.get(f"/api/v1/runs/{RUN}/events").json()["items"]))
        yield server


@pytest.mark.parametrize(("name", "value", "message"), [
    ("rank", HUGE, f"query.rank: Input should be less than or equal to {INT64_MAX}"),
    ("end_step", HUGE, f"query.end_step: Input should be less than or equal to {INT64_MAX}"),
    ("start_step", HUGE, f"query.start_step: Input should be less than or equal to {INT64_MAX}"),
    ("rank", str(INT64_MAX + 1), f"query.rank: Input should be less than or equal to {INT64_MAX}"),
])
def test_metric_query_integers_beyond_int64_are_a_422_naming_the_parameter(
        live: LiveServer, name: str, value: str, message: str) -> None:
    r = live.get(f"/api/v1/runs/{RUN}/metrics", **{name: value})
    assert (r.status_code, r.json()) == (422, {"detail": message})  # rank / end_step were a 500
    # the largest int64 is a valid value: an empty answer, not an error
    r = live.get(f"/api/v1/runs/{RUN}/metrics", **{name: str(INT64_MAX)})
    assert r.status_code == 200, r.text


def test_the_token_is_checked_before_the_range(live: LiveServer) -> None:
    r = live.client.get(f"/api/v1/runs/{RUN}/metrics", params={"rank": HUGE})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = live.client.get(f"/api/v1/runs/{RUN}/metrics", params={"rank": HUGE},
                        headers={"Authorization": f"Bearer {live.ingest_token}"})
    assert r.status_code == 403


def test_openapi_states_the_int64_bounds(live: LiveServer) -> None:
    spec = live.client.get("/openapi.json").json()
    params: Dict[str, Any] = {p["name"]: p["schema"] for p in
                              spec["paths"]["/api/v1/runs/{run_id}/metrics"]["get"]["parameters"]}
    for name in ("rank", "start_step", "end_step"):
        integer = next(s for s in params[name]["anyOf"] if s.get("type") == "integer")
        assert (integer["minimum"], integer["maximum"]) == (0, INT64_MAX)
    assert (params["max_points"]["minimum"], params["max_points"]["maximum"]) == (1, 10_000)


@pytest.mark.parametrize("path", ["events", "search"])
def test_forged_cursors_with_integers_beyond_int64_are_a_400(live: LiveServer, path: str) -> None:
    if path == "events":
        url, params = f"/api/v1/runs/{RUN}/events", {}
        cursor = encode_cursor("events", ["default", RUN, None], [2**64, 2**70])
    else:
        url, params = "/api/v1/search", {"q": "nan"}
        cursor = encode_cursor("search", ["default", "nan", None], [2**70, 1.0, 2**64])
    assert live.get(url, **params).json()["items"]  # the listing itself has items
    r = live.get(url, cursor=cursor, **params)
    assert (r.status_code, r.json()) == (400, {"detail": "invalid cursor"})  # was a 500 (OverflowError)
    # a forged cursor with in-range integers is still just a position in the listing
    fine = encode_cursor("events", ["default", RUN, None], [0, 0]) if path == "events" else \
        encode_cursor("search", ["default", "nan", None], [INT64_MAX, 0.0, 0])
    assert live.get(url, cursor=fine, **params).status_code == 200
