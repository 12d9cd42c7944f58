"""Issue 18 fuzz (found by schemathesis, tests/fuzz/test_fuzz_openapi.py, with its positive-data check): the
served OpenAPI let ``POST /v1/ingest``'s JSON body carry any top-level field, while the gateway answers 400
"IngestRequest: unknown field ..." to anything but ``events`` (docs/wire-format.md). The schema now says
``additionalProperties: false``, and the server still answers what it says (``trainguard serve`` in process,
on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data: Path = tmp_path_factory.mktemp("data")
    with live_server(data) as server:
        yield server


def _json_body_schema(live: LiveServer) -> Dict[str, Any]:
    spec = live.client.get("/openapi.json").json()
    schema: Dict[str, Any] = spec["paths"]["/v1/ingest"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]
    return schema


def test_the_ingest_schema_takes_events_only(live: LiveServer) -> None:
    schema = _json_body_schema(live)
    assert schema["required"] == ["events"]
    assert schema["additionalProperties"] is False  # was absent: any extra field looked valid


def test_the_server_refuses_what_the_schema_refuses(live: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {live.ingest_token}", "Content-Type": "application/json"}
    r = live.client.post("/v1/ingest", json={"events": [event("openapi-run")], "extra": 1}, headers=headers)
    assert r.status_code == 400
    assert r.json() == {"detail": 'IngestRequest: unknown field "extra" (trainguard.v1.IngestRequest has: events)'}
    r = live.client.post("/v1/ingest", json={"events": [event("openapi-run")]}, headers=headers)
    assert (r.status_code, r.json()["accepted"]) == (200, 1)
