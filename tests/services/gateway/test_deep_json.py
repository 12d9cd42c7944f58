"""Issue 18, finding 9 (ingest side): JSON nested ~1,000 levels deep made ``json.loads`` raise RecursionError
and the whole request answer 500 -- even when only one event of a valid batch was deep. Now such an event is
rejected on its own (``invalid_field``, naming the field and its ``event_id``) and the others are queued.
On a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest
from fastapi import FastAPI

from tests.services.gateway.helpers import (
    ControlledQueue,
    Tokens,
    UvicornThread,
    drain,
    metric_event,
    new_gateway,
)
from trainguard_server.gateway.deep_json import TooDeep, split_events_json
from trainguard_server.gateway.http import ingest_router

Server = Tuple[httpx.Client, Tokens, ControlledQueue]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    gateway, queue, tokens = new_gateway()
    app = FastAPI()
    app.include_router(ingest_router(gateway))
    with UvicornThread(app) as uv, httpx.Client(base_url=uv.url, timeout=30) as client:
        yield client, tokens, queue


def _post(server: Server, body: str) -> httpx.Response:
    client, tokens, _ = server
    return client.post("/v1/ingest", content=body.encode(), headers={
        "Authorization": f"Bearer {tokens.ingest}", "Content-Type": "application/json"})


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _body(parts: List[str]) -> str:
    return '{"events": [' + ", ".join(parts) + "]}"


@pytest.mark.parametrize("depth", [990, 5000, 100_000])
def test_one_deep_event_is_rejected_alone_and_the_batch_is_kept(server: Server, depth: int) -> None:
    good = [metric_event(i) for i in range(3)]
    deep = '{"event_id": "deep-1", "run_id": "r", "tags": {"a": ' + _nested(depth) + "}}"
    r = _post(server, _body([json.dumps(good[0]), deep, json.dumps(good[1]), json.dumps(good[2])]))
    assert r.status_code == 200, r.text  # was 500: RecursionError
    assert r.json() == {"accepted": 3, "duplicates": 0, "rejected": [{
        "index": 1, "event_id": "deep-1", "code": "invalid_field",
        "message": f"events[1].tags: JSON nested {depth + 2} levels deep, too deep to decode "
                   f"(an envelope nests a few levels)"}]}
    assert [e.event_id for _, e in drain(server[2])] == [g["event_id"] for g in good]


def test_several_deep_events_and_other_rejections_keep_their_positions(server: Server) -> None:
    good, other = metric_event(1), metric_event(2, project="other")
    parts = [_nested(3000), json.dumps(good), '{"event_id": "x\\"[{", "z": ' + _nested(1500) + "}",
             json.dumps(other)]
    r = _post(server, _body(parts))
    assert r.status_code == 200, r.text
    body: Dict[str, Any] = r.json()
    assert body["accepted"] == 1
    assert [(x["index"], x["event_id"], x["code"], x["message"].split(":")[0]) for x in body["rejected"]] == [
        (0, "", "invalid_field", "events[0]"), (2, 'x"[{', "invalid_field", "events[2].z"),
        (3, other["event_id"], "wrong_project", "events[3].project")]
    assert [e.event_id for _, e in drain(server[2])] == [good["event_id"]]


@pytest.mark.parametrize(("body", "message"), [
    (_nested(5000), 'IngestRequest: expected an object with an "events" array, nested too deeply to decode'),
    ('{"events": [' + "[" * 5000, "malformed JSON: unterminated array or object"),
    ('{"events": [' + _nested(5000) + '], "extra": ' + _nested(5000) + "}",
     'IngestRequest: unknown field "extra" (trainguard.v1.IngestRequest has: events)'),
    ('{"events": [' + _nested(5000) + "]} trailing", "malformed JSON: extra data at char 10015"),
])
def test_a_deep_body_that_is_not_an_ingest_request_is_a_400(server: Server, body: str, message: str) -> None:
    r = _post(server, body)
    assert (r.status_code, r.json()) == (400, {"detail": message})
    assert drain(server[2]) == []


def test_split_events_json_matches_json_loads_on_what_decodes() -> None:
    from trainguard_server.gateway.ingest import _JSON_DECODER

    events = [metric_event(i) for i in range(5)] + [{"s": "]}[{\\\"", "n": None, "l": [1, [2, [3]]]}]
    text = ' { "events" : [ ' + " , ".join(json.dumps(e) for e in events) + " ] } "
    assert split_events_json(text, _JSON_DECODER) == json.loads(text)["events"]
    assert split_events_json('{"events": []}', _JSON_DECODER) == []
    deep = split_events_json(_body(['{"event_id": 7, "k": ' + _nested(2000) + "}"]), _JSON_DECODER)
    assert deep == [TooDeep("k", 2001, "")]  # a non-string event_id is not reported
