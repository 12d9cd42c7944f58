"""DeepSpeed's launcher stopping its workers (``[launch.py:N:sigkill_handler] Killing subprocess PID``, rule
``deepspeed.launcher-teardown``): process/exit naming no rank, and only when nothing else in the text says
more. Text read from tests/fixtures/wild (tuned part; each case's source.txt names its thread)."""

from __future__ import annotations

from pathlib import Path

from trainguard_engine.classify import FALLBACKS, classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
TEARDOWN = "proc-ds-killing-subprocess-launcher-tb-1581-1"  # deepspeedai/DeepSpeed#1581


def _lines(case: str) -> list:
    return (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()


def test_the_teardown_line_is_the_launchers_exit_and_names_no_rank() -> None:
    line = _lines(TEARDOWN)[0]
    found = classify_text(line)
    assert found is not None and (found.kind, found.rule) == ("process/exit", "deepspeed.launcher-teardown")
    assert found.facts == {"pid": 250621, "launcher": "deepspeed"} and "rank" not in found.facts
    assert found.confidence >= 0.6 and found.lines == (line,)
    assert "deepspeed.launcher-teardown" in FALLBACKS


def test_the_teardown_is_only_a_fallback() -> None:
    killing = [ln for ln in _lines(TEARDOWN) if "Killing subprocess" in ln]
    # a worker's OOM in the same text (deepspeedai/DeepSpeed#3869, quoted as pasted) is what the text says
    oom = "\n".join(_lines("mem-oom-quoted-deepspeed-launcher-1"))
    found = classify_text(oom)
    assert found is not None and found.kind == "memory/oom"
    # so is the exit code with its --local_rank that DeepSpeed prints after the teardown (the rank named)
    named = classify_text("\n".join(_lines("comm-root-exit1-rank4-1")))
    assert named is not None and named.rule == "launcher.signal" and named.facts["rank"] == 4
    # and a Python exception printed in the same text (the worker's traceback; pytorch/pytorch#148976's entry
    # read as the worker printed it): its own kind, not the launcher's exit
    entry = _lines("comm-mismatch-barrier-torchrun-summary-148976-1")
    worker = "\n".join(["Traceback (most recent call last):"] + [ln[2:] for ln in entry[11:]])
    found = classify_text("\n".join([*killing, worker]))
    assert found is not None and found.kind == "comm/mismatch"


def test_the_words_alone_are_not_the_launcher() -> None:
    assert classify_text("then the script was Killing subprocess 12 by hand") is None
    assert classify_text("[INFO] [launch.py:131:sigkill_handler] Killing subprocess") is None
