"""Lone UTF-16 surrogates (``"\\udfff"`` in a JSON body) where the rejection quotes what was sent
(security.md H47). A string value holding one was refused ``invalid_field`` already; but a map KEY, an
unknown field's name or an enum's text holding one was quoted raw into the rejection's message, which then
could not be encoded as UTF-8: the whole request was answered **500** (``UnicodeEncodeError`` in
``IngestResult.to_json``) -- after the batch's good events had been queued, so the client could not tell
what was kept and its retries met the same 500 for ever. Now the message shows the surrogate as the escape
``\\udfff`` and the answer is the usual 200 with that event rejected and the others accepted. Against
``trainguard serve`` in process (EmbeddedServer)."""

from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server
from trainguard import wire

live = module_live_server()

LONE = "\udfff"
CASES = {
    "a tag key": ({"lifecycle": {"phase": "START", "tags": {f"k{LONE}": "v"}}}, 'tags["k\\udfff"]'),
    "a sdk_stats key": ({"heartbeat": {"last_step": 1, "sdk_stats": {LONE: 1.0}}}, 'sdk_stats["\\udfff"]'),
    "an unknown field's name": ({f"colour{LONE}": 1}, 'unknown field "colour\\udfff"'),
    "a nested unknown field's name": ({"log": {"message": "m", LONE: "x"}}, 'unknown field "\\udfff"'),
    "an enum's text": ({"severity": f"ERROR{LONE}"}, '"ERROR\\udfff"'),
}


def _bad(fields: Dict[str, Any]) -> Dict[str, Any]:
    out = event("lone-surrogate")
    if "lifecycle" in fields or "heartbeat" in fields or "log" in fields:
        del out["metrics"]
    out.update(fields)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_lone_surrogate_quoted_in_a_rejection_is_escaped_and_the_rest_is_kept(live: LiveServer,
                                                                                case: str) -> None:
    fields, shown = CASES[case]
    good, bad = event(f"clean-{abs(hash(case)) % 10**6}"), _bad(fields)
    r = live.post_events([good, bad])
    assert r.status_code == 200, r.text  # was: 500 Internal Server Error (the good event queued anyway)
    body = r.json()
    assert body["accepted"] == 1 and body["duplicates"] == 0, body
    [rejected] = body["rejected"]
    assert (rejected["index"], rejected["event_id"], rejected["code"]) == (1, bad["event_id"], "invalid_field")
    assert shown in rejected["message"], rejected["message"]
    assert rejected["message"].encode("utf-8")  # a real string: no surrogate left in it
    live.wait_for(lambda: good["run_id"] in live.run_ids())


def test_an_event_id_with_a_lone_surrogate_is_rejected_under_its_escape(live: LiveServer) -> None:
    good, bad = event("clean-event-id"), event("lone-surrogate", event_id=f"e{LONE}")
    r = live.post_events([good, bad])
    assert r.status_code == 200, r.text  # was: 500 (the id echoed raw in the rejection)
    assert r.json()["accepted"] == 1 and r.json()["rejected"][0]["event_id"] == "e\\udfff", r.json()
    response = live.grpc_send([event("clean-event-id-grpc")])  # gRPC's answer is built from the same items
    assert response.accepted == 1


def test_a_deeply_nested_field_named_with_a_lone_surrogate_is_rejected_under_its_escape(live: LiveServer) -> None:
    """An element nested too deeply for the JSON decoder is rejected by the streaming splitter (deep_json),
    which quotes the field's name from the raw text."""
    good = event("clean-deep")
    deep = "[" * 5000 + "]" * 5000
    bad = ('{"event_id": "0123456789abcdef0123456789abcdef", "run_id": "lone-deep", "tags\\udfff": '
           + deep + "}")
    body = '{"events": [' + json.dumps(good) + ", " + bad + "]}"
    r = live.client.post("/v1/ingest", content=body.encode(), headers={
        "Authorization": f"Bearer {live.ingest_token}", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    [rejected] = r.json()["rejected"]
    assert r.json()["accepted"] == 1 and "tags\\udfff" in rejected["message"], r.json()


def test_the_wire_rejection_of_a_lone_surrogate_key_is_utf8() -> None:
    """The same through trainguard.wire alone (what the gRPC path's JSON-free twin never meets: protobuf
    refuses invalid UTF-8 on the wire)."""
    prepared = wire.prepare_batch([_bad(CASES["a tag key"][0])])
    [rejected] = prepared.rejected
    str(rejected["message"]).encode("utf-8")
    assert 'tags["k\\udfff"]' in str(rejected["message"])
