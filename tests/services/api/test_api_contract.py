"""Issue 18, finding 14 (API contract): the 422 body was a string where the OpenAPI said an array, 400 and 404
were undocumented, and a malformed body got 422 before a missing token got 401. Every error answer below,
from ``trainguard serve`` (EmbeddedServer on 127.0.0.1, SQLite stores), must be a status the served OpenAPI
documents for that operation, with a body that validates against the documented schema; a request without
a valid read token gets its 401/403 whatever its body."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional

import httpx
import pytest
from jsonschema import Draft202012Validator

from tests.services.gateway.embedded_server import LiveServer, event, live_server

RUN = "contract-run"
DEEP = "[" * 5000 + "]" * 5000


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        assert server.post_events([event(RUN, step=s) for s in range(3)]).status_code == 200
        server.wait_for(lambda: server.get(f"/api/v1/runs/{RUN}").status_code == 200)
        yield server


@pytest.fixture(scope="module")
def spec(live: LiveServer) -> Dict[str, Any]:
    r = live.client.get("/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def _check_documented(spec: Dict[str, Any], method: str, template: str, r: httpx.Response) -> None:
    """``r`` is a response the OpenAPI documents for ``method template``, and its body fits the schema."""
    operation = spec["paths"][template][method.lower()]
    documented = operation["responses"]
    status = str(r.status_code)
    assert status in documented, f"{method} {template} answered {status} ({r.text}); documents {sorted(documented)}"
    schema = documented[status].get("content", {}).get("application/json", {}).get("schema")
    assert schema is not None, f"{method} {template} {status}: no JSON body documented"
    validator = Draft202012Validator({**schema, "components": spec["components"]})
    errors = [e.message for e in validator.iter_errors(r.json())]
    assert not errors, f"{method} {template} {status}: body {r.text} does not fit the schema: {errors}"
    if status == "401":
        assert r.headers["www-authenticate"] == "Bearer"


CASES = [  # (method, template, concrete path, params, body, token, expected status)
    ("GET", "/api/v1/runs", "/api/v1/runs", {"limit": "abc"}, None, "read", 422),
    ("GET", "/api/v1/runs", "/api/v1/runs", {"cursor": "not-a-cursor"}, None, "read", 400),
    ("GET", "/api/v1/runs", "/api/v1/runs", {"status": "bogus"}, None, "read", 400),
    ("GET", "/api/v1/runs", "/api/v1/runs", None, None, None, 401),
    ("GET", "/api/v1/runs", "/api/v1/runs", None, None, "ingest", 403),
    ("GET", "/api/v1/runs/{run_id}", "/api/v1/runs/nope", None, None, "read", 404),
    ("GET", "/api/v1/runs/{run_id}/metrics", "/api/v1/runs/nope/metrics", None, None, "read", 404),
    ("GET", "/api/v1/runs/{run_id}/metrics", f"/api/v1/runs/{RUN}/metrics",
     {"start_step": "5", "end_step": "1"}, None, "read", 400),
    ("GET", "/api/v1/runs/{run_id}/events", f"/api/v1/runs/{RUN}/events", {"cursor": "x"}, None, "read", 400),
    ("GET", "/api/v1/incidents", "/api/v1/incidents", {"cursor": "x"}, None, "read", 400),
    ("GET", "/api/v1/incidents/{incident_id}", "/api/v1/incidents/nope", None, None, "read", 404),
    ("GET", "/api/v1/incidents/{incident_id}/workflow", "/api/v1/incidents/nope/workflow", None, None, "read",
     404),
    ("POST", "/api/v1/incidents/{incident_id}/notes", "/api/v1/incidents/nope/notes", None,
     {"by": "me", "text": "hi"}, "read", 404),
    ("POST", "/api/v1/incidents/{incident_id}/notes", "/api/v1/incidents/nope/notes", None, {"by": "me"},
     "read", 422),
    ("GET", "/api/v1/clusters", "/api/v1/clusters", {"limit": "0"}, None, "read", 422),
    ("GET", "/api/v1/clusters/{fingerprint}", "/api/v1/clusters/nope", None, None, "read", 404),
    ("GET", "/api/v1/search", "/api/v1/search", {"q": '"unterminated'}, None, "read", 400),
    ("GET", "/api/v1/search", "/api/v1/search", None, None, "read", 422),
    ("GET", "/api/v1/baselines/{name}", "/api/v1/baselines/nope", None, None, "read", 404),
    ("POST", "/api/v1/gate", "/api/v1/gate", None, {"baseline": "b", "candidate": RUN, "policy": {"zz": 1}},
     "read", 422),
    ("POST", "/api/v1/gate", "/api/v1/gate", None, '{"baseline": "b", "candidate": "c", "policy": ' + DEEP + "}",
     "read", 400),
]


@pytest.mark.parametrize(("method", "template", "path", "params", "body", "token", "status"), CASES,
                         ids=[f"{c[0]} {c[2]} {c[6]}" for c in CASES])
def test_every_error_answer_is_documented_with_its_body(
        live: LiveServer, spec: Dict[str, Any], method: str, template: str, path: str,
        params: Optional[Dict[str, str]], body: Any, token: Optional[str], status: int) -> None:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {live.read_token if token == 'read' else live.ingest_token}"
    content = body if isinstance(body, str) or body is None else json.dumps(body)
    r = live.client.request(method, path, params=params, content=content, headers=headers)
    assert r.status_code == status, r.text
    _check_documented(spec, method, template, r)


BODY_ROUTES = [("POST", "/api/v1/incidents/x/notes"), ("POST", "/api/v1/incidents/x/acknowledge"),
               ("POST", "/api/v1/incidents/x/resolve"), ("PUT", "/api/v1/baselines/b"),
               ("POST", "/api/v1/gate")]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize("body", ["{bad json", "[]", "{}", '{"by": ' + DEEP + "}"],
                         ids=["malformed", "array", "empty", "deep"])
def test_the_token_is_checked_before_the_body(live: LiveServer, method: str, path: str, body: str) -> None:
    json_type = {"Content-Type": "application/json"}
    r = live.client.request(method, path, content=body, headers=json_type)
    assert (r.status_code, r.headers.get("www-authenticate")) == (401, "Bearer"), r.text  # malformed: was 422
    assert r.json() == {"detail": "missing Authorization: Bearer <read token>"}
    r = live.client.request(method, path, content=body,
                            headers={**json_type, "Authorization": "Bearer tg_read_unknown"})
    assert (r.status_code, r.json()) == (401, {"detail": "unknown or revoked token"})
    r = live.client.request(method, path, content=body,
                            headers={**json_type, "Authorization": f"Bearer {live.ingest_token}"})
    assert (r.status_code, r.json()) == (403, {"detail": "ingest tokens cannot read; use a read token"})
    # with the read token, the body is judged
    r = live.client.request(method, path, content=body,
                            headers={**json_type, "Authorization": f"Bearer {live.read_token}"})
    assert r.status_code in (400, 422), r.text


def test_the_422_schema_is_the_string_body_the_app_sends(spec: Dict[str, Any]) -> None:
    detail = spec["components"]["schemas"]["HTTPValidationError"]["properties"]["detail"]
    assert detail["type"] == "string"  # was an array of ValidationError objects
    assert "ValidationError" not in spec["components"]["schemas"]
