"""Envelope readers used by the pipeline and the processor runtime, over the recorded real streams."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest

from trainguard_engine.extract import (
    as_int,
    is_raw_context,
    metric_points,
    point_step,
    raw_text,
    recent_points,
)

STREAMS = Path(__file__).resolve().parents[1] / "fixtures" / "streams"
NAMES = ("healthy", "diverging", "crashing", "stalling", "crashing_2rank")


def load(name: str) -> List[Dict[str, Any]]:
    with open(STREAMS / f"{name}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def alert(name: str = "diverging", metric: str = "loss") -> Dict[str, Any]:
    return next(e for e in load(name) if e.get("metrics", {}).get("alert") == f"non_finite:{metric}")


@pytest.mark.parametrize("name", NAMES)
def test_metric_points_expand_every_point_of_real_batches(name: str) -> None:
    for event in load(name):
        got = metric_points(event)
        if "metrics" not in event:
            assert got == []
            continue
        raw = event["metrics"]["points"]
        assert [n for n, _s, _v in got] == [p["name"] for p in raw]
        assert all(s == event["step"] for _n, s, _v in got)
        assert all(isinstance(v, float) for _n, _s, v in got)


def test_non_finite_values_are_floats_and_recent_context_is_separate() -> None:
    event = alert()
    ((name, step, value), *_rest) = metric_points(event)
    assert name == "loss" and step == event["step"] and math.isinf(value) and value > 0
    recent = recent_points(event)
    assert len(recent) == len(event["metrics"]["recent"]) and recent
    # own steps, not the envelope's: earlier steps, and this step's values logged just before the loss
    assert all(s <= event["step"] for _n, s, _v in recent)
    assert any(s < event["step"] for _n, s, _v in recent)
    assert {n for n, _s, _v in recent} >= {"loss", "grad/global_norm"}
    assert not any(p in metric_points(event) for p in recent)


def test_a_point_step_wins_when_set_and_proto3_zero_means_the_envelope() -> None:
    event = copy.deepcopy(load("healthy")[5])
    event["step"] = 7
    event["metrics"]["points"] = [{"name": "a", "value": 1.0, "step": 3}, {"name": "b", "value": "NaN"},
                                  {"name": "c", "value": "-Infinity", "step": 0},
                                  {"name": "d", "value": 2, "step": "12"}, {"name": "e", "value": 1, "step": -1}]
    got = metric_points(event)
    assert [(n, s) for n, s, _v in got] == [("a", 3), ("b", 7), ("c", 7), ("d", 12), ("e", 7)]
    assert math.isnan(got[1][2]) and got[2][2] == -math.inf and got[3][2] == 2.0
    assert point_step({}, 5) == 5


def test_bad_points_are_skipped_not_fatal() -> None:
    event = {"step": 1, "metrics": {"points": [{"name": "x", "value": "nan"}, {"value": 1.0}, "junk",
                                               {"name": "ok", "value": "1.5"}]}}
    assert metric_points(event) == [("ok", 1, 1.5)]
    assert metric_points({"heartbeat": {}}) == [] and metric_points({}) == []


def test_int64_fields() -> None:
    assert as_int("1795942053940513231") == 1795942053940513231
    assert as_int(3.0) == 3 and as_int(None, -1) == -1
    for bad in (True, 2.5, "x", [1]):
        with pytest.raises(ValueError):
            as_int(bad)


def test_raw_text_of_real_events() -> None:
    events = load("crashing")
    (exc,) = [e for e in events if "exception" in e]
    text = raw_text(exc)
    body = exc["exception"]
    assert text.startswith(f"{body['type']}: {body['message']}\n") and body["traceback"] in text
    start, end = [e for e in events if "lifecycle" in e]
    assert raw_text(end) == "process exited: exit code 1, reason exception"
    assert raw_text(start).startswith("process started: ") and "crashing" in raw_text(start)
    assert "torch 2." in raw_text(start)
    assert raw_text(alert()) == f"alert non_finite:loss: loss=Infinity at step {alert()['step']}"
    plain = next(e for e in events if "metrics" in e)
    assert raw_text(plain) == ""
    assert raw_text(next(e for e in load("stalling") if "heartbeat" in e)) == ""


def test_raw_text_of_logs_memory_and_chains() -> None:
    log = {"log": {"logger": "torch.distributed", "level": "ERROR", "message": "NCCL watchdog timeout"}}
    assert raw_text(log) == "ERROR torch.distributed: NCCL watchdog timeout"
    assert raw_text({"memory": {"summary": "|  Allocated memory  |"}}) == "|  Allocated memory  |"
    chained = {"exception": {"type": "RuntimeError", "message": "outer",
                             "chain": [{"type": "ValueError", "message": "inner", "relation": "cause"}]}}
    assert raw_text(chained) == "RuntimeError: outer\nValueError: inner"
    assert raw_text({"lifecycle": {"phase": "EXIT", "exit_code": 137, "signal": 9, "reason": "signal"}}) == \
        "process exited: exit code 137 (SIGKILL), reason signal"


@pytest.mark.parametrize("name", NAMES)
def test_raw_context_is_exceptions_lifecycle_and_alerts(name: str) -> None:
    for event in load(name):
        expected = ("exception" in event or "lifecycle" in event
                    or bool(event.get("metrics", {}).get("alert")))
        assert is_raw_context(event) == expected
        assert bool(raw_text(event)) == expected
    assert is_raw_context({"log": {"message": "x"}}) and is_raw_context({"memory": {"summary": "s"}})
    assert not is_raw_context({"memory": {"rss": 1}}) and not is_raw_context({})
