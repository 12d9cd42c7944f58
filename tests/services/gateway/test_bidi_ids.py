"""Hostile ids, part two: a run id or trace id holding a Unicode bidirectional control (U+202E RIGHT-TO-LEFT
OVERRIDE, the isolates U+2066-U+2069, the marks U+200E / U+200F / U+061C) was accepted: ``run\u202egnp.exe``
is shown as ``runexe.png`` by the dashboard and by any terminal or log viewer that applies the Unicode bidi
algorithm, so one id reads as another (the "Trojan Source" trick, CVE-2021-42574). Ids are refused C0/C1
controls already (test_control_characters.py); bidi controls are refused the same way now, with the field,
the code point and its position, over HTTP and gRPC; the rest of the batch is stored. Right-to-left text
itself (Hebrew, Arabic letters) stays legal, and names and free text keep their bidi controls. Against
``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List

import grpc
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard import wire
from trainguard.v1 import ingest_pb2_grpc

# (field, hostile value, the character's code point, its position)
HOSTILE = [
    ("run_id", "run\u202egnp.exe", 0x202E, 3),
    ("run_id", "\u2066a\u2069", 0x2066, 0),
    ("run_id", "x\u200fy", 0x200F, 1),
    ("trace_id", "job\u202a1", 0x202A, 3),
    ("trace_id", "t\u061c", 0x061C, 1),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _message(index: int, field: str, value: str, code: int, at: int) -> str:
    shown = json.dumps(value, ensure_ascii=True)
    return (f"events[{index}].{field}: {shown} has the bidirectional control character U+{code:04X} at "
            f"position {at}; a {field} is printed as is, where it would reorder the text around it, so "
            f"bidirectional controls are refused")


def _run_ids(live: LiveServer) -> List[str]:
    r = live.get("/api/v1/runs", limit=500)
    assert r.status_code == 200, r.text
    return [run["run_id"] for run in r.json()["items"]]


def _with(field: str, value: str) -> Dict[str, Any]:
    bad = event("bidi-run")
    bad[field] = value
    return bad


@pytest.mark.parametrize("field,value,code,at", HOSTILE)
def test_http_refuses_a_bidi_control_in_an_id_and_keeps_the_rest(live: LiveServer, field: str, value: str,
                                                                code: int, at: int) -> None:
    good, bad = event("clean-bidi"), _with(field, value)
    r = live.post_events([good, bad])
    assert r.json() == {"accepted": 1, "duplicates": 0, "rejected": [  # was accepted: 2
        {"index": 1, "event_id": bad["event_id"], "code": "invalid_field",
         "message": _message(1, field, value, code, at)}]}
    live.wait_for(lambda: "clean-bidi" in _run_ids(live))


def test_grpc_refuses_the_same(live: LiveServer) -> None:
    good, bad = event("clean-bidi-grpc"), _with("run_id", "run\u202egnp.exe")
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        response = stub.Send(wire.ingest_request_from_dicts([good, bad]), timeout=10,
                             metadata=(("authorization", f"Bearer {live.ingest_token}"),))
    assert response.accepted == 1
    assert [(x.index, x.code, x.message) for x in response.rejected] == [
        (1, "invalid_field", _message(1, "run_id", "run\u202egnp.exe", 0x202E, 3))]


def test_right_to_left_letters_and_names_with_bidi_controls_stay_legal(live: LiveServer) -> None:
    hebrew, arabic = event("\u05e8\u05d9\u05e6\u05d4-1"), event("\u062a\u062c\u0631\u0628\u0629-2")
    named = event("bidi-named", run_name="run\u202egnp.exe", host="h\u2066x\u2069")
    r = live.post_events([hebrew, arabic, named])
    assert r.json() == {"accepted": 3, "duplicates": 0, "rejected": []}
    live.wait_for(lambda: {"\u05e8\u05d9\u05e6\u05d4-1", "bidi-named"} <= set(_run_ids(live)))
