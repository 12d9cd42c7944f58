"""A query-API parameter given twice (``?names=loss&names=lr``, ``?limit=1&limit=500``): the API used the
last value and ignored the others without a word, so ``names=loss&names=lr`` answered lr's series alone and a
proxy or cache keyed on the first value saw another request than the one answered. No parameter of the API
is a list (``names`` is comma-separated), so a repeated one is now a 422 naming it and its values, after the
read-token check; one value works as before. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        e = event("rep", step=1)
        e["metrics"]["points"].append({"name": "lr", "value": 0.1})
        assert server.post_events([e]).json()["accepted"] == 1
        server.wait_for(lambda: server.get("/api/v1/runs/rep").status_code == 200)
        yield server


def _get(live: LiveServer, path_and_query: str, token: str | None = None) -> tuple[int, dict]:
    r = live.client.get(path_and_query, headers={"Authorization": f"Bearer {token or live.read_token}"})
    return r.status_code, r.json()


def test_a_repeated_names_is_refused_not_half_read(live: LiveServer) -> None:
    assert _get(live, "/api/v1/runs/rep/metrics?names=loss&names=lr") == (422, {  # was 200 with lr alone
        "detail": "query.names: given 2 times ('loss', 'lr'); give it once (names: comma-separated)"})
    status, body = _get(live, "/api/v1/runs/rep/metrics?names=loss,lr")
    assert status == 200 and sorted(body["series"]) == ["loss", "lr"]


def test_a_repeated_limit_is_refused(live: LiveServer) -> None:
    assert _get(live, "/api/v1/runs?limit=1&limit=500") == (422, {  # was 200, limit 500
        "detail": "query.limit: given 2 times ('1', '500'); give it once"})
    assert _get(live, "/api/v1/runs?limit=1")[0] == 200


def test_the_token_is_checked_first(live: LiveServer) -> None:
    assert _get(live, "/api/v1/runs?limit=1&limit=2", token="nope")[0] == 401


def test_every_parameter_of_a_route_is_covered(live: LiveServer) -> None:
    for query in ("status=open&status=resolved", "cursor=a&cursor=b"):
        status, body = _get(live, f"/api/v1/incidents?{query}")
        assert status == 422 and "given 2 times" in body["detail"], (query, body)
