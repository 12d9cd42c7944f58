"""The public API never raises, costs nothing when disabled, and survives misuse."""

from __future__ import annotations

import decimal
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

import trainguard
from tests.sdk.scripting import of_kind, read_jsonl
from trainguard.guard import reset_warnings


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


def _init(tmp_path: Path, **kw: object) -> Path:
    out = tmp_path / "events.jsonl"
    trainguard.init(endpoint=f"file://{out}", project="t", spool_dir="", capture_exit=False,
                    capture_uncaught=False, **kw)
    return out


def test_without_endpoint_everything_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_ENDPOINT", raising=False)
    trainguard.init(project="x")
    assert trainguard.get_client() is None
    assert trainguard.log(step=1, loss=1.0) is None
    assert trainguard.capture_exception(ValueError("x")) is None
    assert trainguard.watch(torch.nn.Linear(2, 2)) is None
    assert trainguard.flush(1) is True
    trainguard.shutdown()


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "env.jsonl"
    monkeypatch.setenv("TRAINGUARD_ENDPOINT", f"file://{out}")
    trainguard.init(project="x", capture_exit=False, capture_uncaught=False, spool_dir="")
    trainguard.log(step=0, loss=2.0)
    assert trainguard.flush(5)
    assert of_kind(read_jsonl(out), "metrics")


def test_all_kinds_of_values_never_raise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _init(tmp_path)

    class BrokenFloat:
        def __float__(self) -> float:
            raise RuntimeError("nope")

    trainguard.log(step=1, a=1.5, b=2, c=True, d=np.float32(0.25), e=np.int64(7), f=torch.tensor(3.0),
                   g=torch.tensor([4.0]), h=decimal.Decimal("0.5"), nan=math.nan, inf=-math.inf)
    trainguard.log(step=2, bad_none=None, bad_str="x", bad_tensor=torch.ones(3), bad_obj=BrokenFloat(),
                   bad_list=[1, 2], ok=1.0)
    trainguard.log(step=torch.tensor(3), loss=0.5)
    trainguard.log(step="four", loss=0.5)  # an unusable step: the call is dropped, counted, warned
    assert trainguard.flush(5)
    client = trainguard.get_client()
    assert client is not None
    assert client.stats.dropped["invalid_value"] == 6
    batches = {e["step"]: e["metrics"] for e in of_kind(read_jsonl(out), "metrics")}
    values = {p["name"]: p["value"] for p in batches[1]["points"]}
    assert values == {"a": 1.5, "b": 2.0, "c": 1.0, "d": 0.25, "e": 7.0, "f": 3.0, "g": 4.0, "h": 0.5,
                      "nan": "NaN", "inf": "-Infinity"}
    assert batches[1]["alert"] == "non_finite:nan"
    assert [p["name"] for p in batches[2]["points"]] == ["ok"]
    assert 3 in batches
    err = capsys.readouterr().err
    assert err.count("bad_none") == 1  # warned once per metric, not per call


def test_init_twice_replaces_the_client_and_flushes_the_first(tmp_path: Path) -> None:
    first = _init(tmp_path / "a")
    trainguard.log(step=0, loss=1.0)
    old = trainguard.get_client()
    second = _init(tmp_path / "b")
    assert trainguard.get_client() is not old
    trainguard.log(step=1, loss=0.5)
    assert trainguard.flush(5)
    assert [e["step"] for e in of_kind(read_jsonl(first), "metrics")] == [0]
    assert [e["step"] for e in of_kind(read_jsonl(second), "metrics")] == [1]


def test_use_after_shutdown_is_a_noop(tmp_path: Path) -> None:
    out = _init(tmp_path)
    trainguard.log(step=0, loss=1.0)
    trainguard.shutdown()
    trainguard.shutdown()
    trainguard.log(step=1, loss=1.0)
    assert trainguard.capture_exception(ValueError("late")) is None
    assert trainguard.flush(1) is True
    assert [e["step"] for e in of_kind(read_jsonl(out), "metrics")] == [0]


def test_bad_endpoint_disables_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    trainguard.init(endpoint="ftp://nowhere", project="x")
    assert trainguard.get_client() is None
    assert "unsupported endpoint" in capsys.readouterr().err
    trainguard.log(step=1, loss=1.0)


def test_capture_exception_handled_once_per_object(tmp_path: Path) -> None:
    out = _init(tmp_path)
    trainguard.log(step=4, loss=0.3)
    try:
        {}["missing"]
    except KeyError as exc:
        first = trainguard.capture_exception()
        again = trainguard.capture_exception(exc)
    assert first is not None and again is None
    assert trainguard.capture_exception() is None  # nothing being handled
    assert trainguard.flush(5)
    [event] = of_kind(read_jsonl(out), "exception")
    exc_payload = event["exception"]
    assert (exc_payload["type"], exc_payload["handled"], exc_payload["mechanism"]) == (
        "KeyError", True, "capture_exception")
    assert event["severity"] == "ERROR"
    assert exc_payload["fingerprint_version"] == "fp:v1" and len(exc_payload["fingerprint"]) == 32
    assert {"name": "loss", "step": 4, "value": 0.3} in exc_payload["recent_metrics"]
    assert exc_payload["frames"][-1]["function"] == "test_capture_exception_handled_once_per_object"


def test_unknown_options_warn_and_are_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _init(tmp_path, colour="blue")
    assert trainguard.get_client() is not None
    assert "unknown option 'colour' ignored" in capsys.readouterr().err


def test_logging_records_are_forwarded(tmp_path: Path) -> None:
    import logging

    out = _init(tmp_path, log_loggers=["trainer"])
    logger = logging.getLogger("trainer")
    logger.info("not forwarded")
    logger.warning("loss spiked to %s", 9.5)
    try:
        raise ZeroDivisionError("denominator")
    except ZeroDivisionError:
        logger.exception("step failed")
    trainguard.shutdown()
    events = read_jsonl(out)
    logs = [e["log"] for e in of_kind(events, "log")]
    assert [(r["level"], r["message"]) for r in logs] == [("WARNING", "loss spiked to 9.5"),
                                                          ("ERROR", "step failed")]
    [exc] = of_kind(events, "exception")
    assert exc["exception"]["mechanism"] == "log"
    assert not logging.getLogger("trainer").handlers  # removed at shutdown
