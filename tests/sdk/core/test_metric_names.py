"""The SDK writes a metric name holding a control character (C0, DEL, C1) or a bidirectional control with
that character escaped (``loss\\x1b[2J`` is sent as the 12 characters ``loss\\x1b[2J``), so the server's rule
(it refuses such names, docs/security.md) never costs the user the event and its other metrics; every other
name is sent exactly as logged. Logging never raises, whatever the names."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

import trainguard
from tests.sdk.scripting import of_kind, read_jsonl
from trainguard.core import events as ev
from trainguard.guard import reset_warnings


@pytest.mark.parametrize("name,sent", [
    ("loss\x1b[2J", "loss\\x1b[2J"),
    ("acc\nINFO forged", "acc\\x0aINFO forged"),
    ("\x00", "\\x00"),
    ("grad\x85", "grad\\x85"),
    ("x\u202egnp", "x\\u202egnp"),
    ("\u2066y", "\\u2066y"),
])
def test_a_control_character_is_sent_escaped(name: str, sent: str) -> None:
    points = ev.metric_points({"ok": 1.0, name: 2.0})
    assert [p["name"] for p in points] == ["ok", sent]
    assert [p["value"] for p in points] == [1.0, 2.0]


def test_other_names_are_sent_as_logged() -> None:
    names = ["loss, smoothed", "val acc", "grad/layer.0/weight", "损失", "خسارة", "loss 🔥", "a\\x1b", ""]
    assert [p["name"] for p in ev.metric_points(dict.fromkeys(names, 0.5))] == names


def test_a_str_subclass_name_is_escaped_too() -> None:
    """numpy.str_ (a names list read back from an array) is a str subclass: escaped like a str (stop 41 review:
    ``type(name) is str`` sent it as is and the server refused the whole event)."""
    class Name(str):
        pass

    assert [p["name"] for p in ev.metric_points({"ok": 1.0, Name("loss\x1b"): 2.0})] == ["ok", "loss\\x1b"]


def test_recent_points_escape_too() -> None:
    assert ev.recent_points([("l\toss", 3, 1.0)]) == [{"name": "l\\x09oss", "step": 3, "value": 1.0}]


def test_names_that_are_not_strings_do_not_raise() -> None:
    values: Dict[Any, float] = {1: 1.0, ("a", "b"): 2.0, "c\n": 3.0}
    assert [p["name"] for p in ev.metric_points(values)] == [1, ("a", "b"), "c\\x0a"]


@pytest.fixture
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


def test_logging_such_names_never_raises_and_keeps_the_event(tmp_path: Path, _clean: None) -> None:
    out = tmp_path / "events.jsonl"
    trainguard.init(endpoint=f"file://{out}", project="t", spool_dir="", capture_exit=False,
                    capture_uncaught=False)
    trainguard.log(step=1, **{"loss": 1.0, "bad\x1b[2J": 2.0, "nan\x00": float("nan")})
    assert trainguard.flush(5)
    metrics = of_kind(read_jsonl(out), "metrics")
    names = {p["name"] for e in metrics for p in e["metrics"]["points"]}
    assert {"loss", "bad\\x1b[2J", "nan\\x00"} <= names
