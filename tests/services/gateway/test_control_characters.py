"""Hostile ids: a run id or trace id holding a control character (an ANSI escape that cleared the operator's
terminal in ``trainguard runs``, a newline that forged a second table row or log line, a NUL) was accepted
and printed as is. Now the event is refused ``invalid_field`` with the field, the character and its
position, over HTTP and gRPC; the other events of the batch are stored. Names and free text (run name, host,
log lines) keep their control characters (printers escape them: test_look_hostile.py). Against ``trainguard serve``
(EmbeddedServer: uvicorn and gRPC on 127.0.0.1, SQLite stores, processor)."""

from __future__ import annotations

import json
import time
from typing import Any, Dict

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server
from trainguard import wire
from trainguard_server.gateway.validate import Limits, validate_batch, validate_envelope

# (field, hostile value, the character's code point, its position)
HOSTILE = [
    ("run_id", "evil\x1b[2J\x1b[31mFAKE", 0x1B, 4),
    ("run_id", "a\nb", 0x0A, 1),
    ("run_id", "nul\x00", 0x00, 3),
    ("trace_id", "t\r1", 0x0D, 1),
    ("trace_id", "node-1\x7f", 0x7F, 6),
    ("run_id", "c1\x9bcontrol", 0x9B, 2),
]


live = module_live_server()


def _hostile_event(field: str, value: str) -> Dict[str, Any]:
    bad = event("hostile-run")
    bad[field] = value
    return bad


def _message(index: int, field: str, value: str, code: int, at: int) -> str:
    shown = json.dumps(value, ensure_ascii=True)
    return (f"events[{index}].{field}: {shown} has the control character U+{code:04X} at position {at}; a "
            f"{field} is printed as is, so control characters are refused")


@pytest.mark.parametrize("field,value,code,at", HOSTILE)
def test_http_refuses_a_control_character_in_a_name_and_keeps_the_rest(live: LiveServer, field: str, value: str,
                                                                      code: int, at: int) -> None:
    good, bad = event("clean-http"), _hostile_event(field, value)
    r = live.post_events([good, bad])
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 1, "duplicates": 0, "rejected": [  # was accepted: 2
        {"index": 1, "event_id": bad["event_id"], "code": "invalid_field",
         "message": _message(1, field, value, code, at)}]}
    live.wait_for(lambda: "clean-http" in live.run_ids())
    assert not [run for run in live.run_ids() if run != "clean-http" and run.startswith(("evil", "a\n", "nul"))]


def test_grpc_refuses_the_same(live: LiveServer) -> None:
    good, bad = event("clean-grpc"), _hostile_event("run_id", "evil\x1b[2J")
    response = live.grpc_send([good, bad])
    assert response.accepted == 1
    assert [(x.index, x.code, x.message) for x in response.rejected] == [
        (1, "invalid_field", _message(1, "run_id", "evil\x1b[2J", 0x1B, 4))]
    live.wait_for(lambda: "clean-grpc" in live.run_ids())
    assert "evil\x1b[2J" not in live.run_ids()


def test_names_and_free_text_keep_their_control_characters(live: LiveServer) -> None:
    """A log line may hold colours, tabs and newlines (captured stdout), a run name read from a file its
    newline: only the ids are checked, so such a run is not lost."""
    line = {"event_id": "0123456789abcdef0123456789abcdef", "run_id": "clean-log", "step": 3,
            "time_unix_nano": time.time_ns(), "log": {"message": "\x1b[32mok\x1b[0m\tstep 3\nnext", "level": "INFO"}}
    r = live.post_events([line, event("clean-log", run_name="bert\tv2\n", host="node-1\x1b")])
    assert r.json() == {"accepted": 2, "duplicates": 0, "rejected": []}


def test_the_batch_check_agrees_with_the_one_event_check() -> None:
    """``validate_batch``'s aggregate pass singles out exactly the events ``validate_envelope`` refuses."""
    dicts = [event("ok-1")] + [_hostile_event(f, v) for f, v, _, _ in HOSTILE] + [event("ok-2", host="gpu-7")]
    now, limits = time.time_ns(), Limits()
    envelopes = [wire.envelope_from_dict(d) for d in dicts]
    verdict = validate_batch(envelopes, project="p", now_ns=now, limits=limits, total_bytes=1000)
    one_by_one = {k: validate_envelope(wire.envelope_from_dict(d), project="p", now_ns=now, limits=limits, index=k)
                  for k, d in enumerate(dicts)}
    assert verdict.rejected == {k: r for k, r in one_by_one.items() if r is not None}
    assert sorted(verdict.rejected) == list(range(1, len(HOSTILE) + 1))
