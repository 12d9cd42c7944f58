"""An fp16 overflow line that is no collapse is an info-severity notice (``amp_text_overflow_notice``,
detectors/process.py ``_overflow_notice``), on the real lines of tuned wild-corpus logs
(``tests/fixtures/wild/<id>/source.txt`` names each thread): the log says what it shows, the run stays
healthy, a collapse later raises it, and a NaN loss after it is not folded into it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_text
from trainguard_engine.correlate import route
from trainguard_engine.detectors.process import on_log
from trainguard_engine.incidents import Finding, apply
from trainguard_engine.state import RankState, RunState

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
AMP = "text:memory/amp-overflow"


def _lines(case_id: str) -> List[str]:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8").splitlines()


def _feed(lines: List[str], settings: DetectionSettings, run: Optional[RunState] = None) -> RunState:
    """Each line as one log record of rank 0 of a run without metrics, through on_log, route and apply."""
    run = run or RunState(project="p", run_id="r")
    rank = run.ranks.setdefault(0, RankState(rank=0))
    for i, line in enumerate(lines):
        found: Optional[Finding] = on_log(run, rank, {"event_id": f"e{i}"}, {"message": line}, i, 1000 + i,
                                          settings)
        if found is not None:
            apply(run, route(run, found, settings), settings)
    return run


def test_a_calibration_opens_an_info_notice_not_a_warning() -> None:
    # DeepSpeed: hysteresis then 65536 -> 8192 at the first steps (the thread: the scaler's normal search)
    run = _feed(_lines("num-ds-overflow-hysteresis-1"), DetectionSettings())
    inc = run.incidents[AMP].record
    assert inc.severity == "info" and "calibrating" in inc.summary
    assert "loss scale now 8192" in run.incidents[AMP].values["detail"]  # the title follows the latest scale


def test_the_notice_is_a_setting() -> None:
    run = _feed(_lines("num-ds-overflow-hysteresis-1"), DetectionSettings(amp_text_overflow_notice=False))
    assert AMP not in run.incidents


def test_a_collapse_after_the_notice_raises_it_and_takes_over_its_title() -> None:
    # HF + DeepSpeed LoRA: 64 -> 32 -> ... -> 2 on five consecutive steps: the fifth halving is a collapse
    run = _feed(_lines("num-ds-overflow-1"), DetectionSettings())
    st = run.incidents[AMP]
    assert st.record.severity == "warning"
    assert "calibrating" not in st.values["detail"] and "calibrating" not in st.record.summary


def test_an_instrumented_job_gets_no_notice() -> None:
    run = RunState(project="p", run_id="r")
    run.ranks[0] = RankState(rank=0)
    run.ranks[0].last_hb_ns = 1  # heartbeats: the GradScaler's metrics speak for it
    assert AMP not in _feed(_lines("num-ds-overflow-hysteresis-1"), DetectionSettings(), run).incidents


def test_a_nan_loss_after_a_notice_is_its_own_incident() -> None:
    # ColossalAI GPT-2: an overflow at 2^32 on the first step, then loss=nan on the same progress lines
    run = _feed(_lines("num-colossal-deepscale-overflow-loss-nan-gpt2-1"), DetectionSettings())
    loss = run.incidents["text:loss/non_finite"].record
    assert not loss.explained_by and loss.severity in ("warning", "error")
    assert run.incidents[AMP].record.severity == "info"


@pytest.mark.parametrize("line, step", [
    ("INFO     colossalai - colossalai - INFO: Found overflow. Skip step", None),
    ("Grad overflow on iteration 5", 5),
    ('it somtimes pops out "Gradient overflow.  Skipping step", I am wondering if it is normal', None),
    ("OVERFLOW! Skipping step.", None),
])
def test_an_overflow_line_naming_no_scale_is_read_as_one(line: str, step: Optional[int]) -> None:
    found = classify_text(line)
    assert found is not None and found.rule == "numeric.loss-scale" and found.facts.get("overflow") is True
    assert "scale" not in found.facts and found.facts.get("step") == step


@pytest.mark.parametrize("line", [
    "number of skipped iterations:   0 | number of nan iterations:   0 | lm loss: 2.301",
    "integer overflow in the tokenizer's offsets",
    "Epoch: [115]  loss: 6.5993 (6.5971)  loss_scale: 8192.0000 (8646.0600)",
])
def test_lines_that_are_no_overflow_open_no_notice(line: str) -> None:
    assert AMP not in _feed([line], DetectionSettings()).incidents
