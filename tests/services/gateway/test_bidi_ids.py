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
from typing import Any, Dict

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server

# field -> hostile values; each is refused naming its first bidi control's code point and position
_BIDI = {"run_id": ("run\u202egnp.exe", "\u2066a\u2069", "x\u200fy"), "trace_id": ("job\u202a1", "t\u061c")}
_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
HOSTILE = [(field, value, ord(ch), at) for field, values in _BIDI.items() for value in values
           for at, ch in [next((k, c) for k, c in enumerate(value) if c in _CONTROLS)]]


live = module_live_server()


def _message(index: int, field: str, value: str, code: int, at: int) -> str:
    shown = json.dumps(value, ensure_ascii=True)
    return (f"events[{index}].{field}: {shown} has the bidirectional control character U+{code:04X} at "
            f"position {at}; a {field} is printed as is, where it would reorder the text around it, so "
            f"bidirectional controls are refused")


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
    live.wait_for(lambda: "clean-bidi" in live.run_ids())


def test_grpc_refuses_the_same(live: LiveServer) -> None:
    good, bad = event("clean-bidi-grpc"), _with("run_id", "run\u202egnp.exe")
    response = live.grpc_send([good, bad])
    assert response.accepted == 1
    assert [(x.index, x.code, x.message) for x in response.rejected] == [
        (1, "invalid_field", _message(1, "run_id", "run\u202egnp.exe", 0x202E, 3))]


def test_right_to_left_letters_and_names_with_bidi_controls_stay_legal(live: LiveServer) -> None:
    hebrew, arabic = event("\u05e8\u05d9\u05e6\u05d4-1"), event("\u062a\u062c\u0631\u0628\u0629-2")
    named = event("bidi-named", run_name="run\u202egnp.exe", host="h\u2066x\u2069")
    r = live.post_events([hebrew, arabic, named])
    assert r.json() == {"accepted": 3, "duplicates": 0, "rejected": []}
    live.wait_for(lambda: {"\u05e8\u05d9\u05e6\u05d4-1", "bidi-named"} <= set(live.run_ids()))
