"""A metric name holding a control character (C0 U+0000-U+001F, DEL and C1 U+007F-U+009F) or a Unicode
bidirectional control refuses its event alone, ``invalid_field`` naming the point, the code point and its
position; the rest of the request is stored. A metric name is printed as is -- the dashboard's charts and
tables, ``trainguard`` CLI output, webhook notifications, log lines -- where an ESC sequence clears an
operator's terminal, a newline forges a log line and ``loss\\u202e`` reorders what follows. Before (stop 41)
they were accepted and stored (hA, stop 40: ``""``, NUL and ESC names accepted). Commas, spaces, slashes,
any letters (CJK, RTL scripts) and emoji stay legal; a name longer than ``max_metric_name_length`` (1,024) is
``too_large`` (H16). HTTP and gRPC alike, against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server

live = module_live_server()


def _metrics(run_id: str, names: List[str]) -> Dict[str, Any]:
    return event(run_id, 1, metrics={"points": [{"name": n, "value": 0.5} for n in names]})


def _summary(live: LiveServer, run_id: str) -> List[str]:
    r = live.get(f"/api/v1/runs/{run_id}/metrics/summary", limit=1000)
    return [m["name"] for m in r.json()] if r.status_code == 200 else []


HOSTILE = [
    ("esc", "loss\x1b[2J", 0x1B, 4),
    ("newline", "acc\nINFO forged line", 0x0A, 3),
    ("nul", "\x00", 0x00, 0),
    ("del", "lr\x7f", 0x7F, 2),
    ("c1", "grad\x85norm", 0x85, 4),
    ("rlo", "loss\u202egnp", 0x202E, 4),
    ("isolate", "\u2066x", 0x2066, 0),
]


@pytest.mark.parametrize("case,name,code_point,position", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_control_character_in_a_metric_name_refuses_its_event_alone(live: LiveServer, case: str, name: str,
                                                                      code_point: int, position: int) -> None:
    run = f"names-{case}"
    request = [_metrics(run, ["loss"]), _metrics(run, ["ok/a", name, "ok/b"]), _metrics(run, ["ok/c"])]
    r = live.post_events(request)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 2, body  # was 3
    (rejected,) = body["rejected"]
    assert (rejected["index"], rejected["code"], rejected["event_id"]) == (1, "invalid_field",
                                                                           request[1]["event_id"])
    message = rejected["message"]
    assert message.startswith("events[1].metrics.points[1].name: "), message
    assert f"U+{code_point:04X} at position {position}" in message, message
    assert "\x1b" not in message and "\n" not in message and "\u202e" not in message  # shown escaped
    live.wait_for(lambda: sorted(_summary(live, run)) == ["loss", "ok/c"])


def test_legal_names_are_stored(live: LiveServer) -> None:
    names = ["loss, smoothed", "val acc", "grad/layer.0/weight", "损失", "خسارة", "loss 🔥", "a" * 1024]
    r = live.post_events([_metrics("names-legal", names)])
    assert (r.status_code, r.json()["accepted"]) == (200, 1), r.text
    live.wait_for(lambda: sorted(_summary(live, "names-legal")) == sorted(names))


def test_a_10k_name_is_too_large(live: LiveServer) -> None:
    r = live.post_events([_metrics("names-long", ["n" * 10_000])])
    body = r.json()
    assert body["accepted"] == 0 and body["rejected"][0]["code"] == "too_large", body
    assert "max_metric_name_length=1024" in body["rejected"][0]["message"]


def test_grpc_refuses_the_same_names(live: LiveServer) -> None:
    reply = live.grpc_send([_metrics("names-grpc", ["loss"]), _metrics("names-grpc", ["bad\x1b"])])
    assert reply.accepted == 1
    (rejected,) = reply.rejected
    assert rejected.index == 1 and rejected.code == "invalid_field"
    assert "U+001B at position 3" in rejected.message


def test_a_run_already_holding_the_names_is_refused_them_too(live: LiveServer) -> None:
    """The second request of the same names (a run that 'knows' them is checked the same way)."""
    run = "names-again"
    for _ in range(2):
        body = live.post_events([_metrics(run, ["x\ty"])]).json()
        assert body["accepted"] == 0 and body["rejected"][0]["code"] == "invalid_field", body
