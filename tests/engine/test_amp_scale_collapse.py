"""When a pasted fp16 loss-scale log is a collapse (detectors/process.py ``_scale_collapsed``), on the real lines
of wild-corpus logs (tuned part; ``tests/fixtures/wild/<id>/source.txt`` names each thread): a run of
reductions under the usual 2^16 start is one, a healthy scaler's calibration is not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import Classification, classify_text
from trainguard_engine.detectors.process import SCALE_STATE_KEY, _numeric_text_wanted
from trainguard_engine.state import RankState, RunState

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _scale_lines(case_id: str) -> List[Classification]:
    """The loss-scale lines of one corpus log, classified, in order."""
    found = []
    for line in (WILD / case_id / "log.txt").read_text(encoding="utf-8").splitlines():
        hit = classify_text(line)
        if hit is not None and hit.rule == "numeric.loss-scale":
            found.append(hit)
    return found


def _verdicts(lines: List[Classification], settings: DetectionSettings) -> List[bool]:
    """Whether each line may open memory/amp-overflow, fed in order to one rank of a run without metrics."""
    run = RunState(project="p", run_id="r")
    rank = run.ranks[0] = RankState(rank=0)
    said = [_numeric_text_wanted(run, hit, settings, rank) for hit in lines]
    json.dumps(rank.detectors[SCALE_STATE_KEY], allow_nan=False)  # the state is snapshotted: plain JSON
    return said


def test_five_overflows_in_a_row_far_below_the_start_are_a_collapse() -> None:
    # HF + DeepSpeed LoRA: 64 -> 32 -> 16 -> 8 -> 4 -> 2 on five consecutive steps (then "already at minimum")
    lines = _scale_lines("num-ds-overflow-1")
    assert [h.facts["scale"] for h in lines] == [32.0, 16.0, 8.0, 4.0, 2.0]
    assert _verdicts(lines, DetectionSettings()) == [False, False, False, False, True]


def test_every_step_skipped_from_the_start_is_a_collapse_at_the_fifth_halving() -> None:
    # DeepSpeed: hysteresis, then 65536 -> 512 in 13 s, every step skipped
    lines = _scale_lines("num-ds-overflow-training-step-1")
    said = _verdicts(lines, DetectionSettings())
    assert [h.facts["scale"] for h, s in zip(lines, said) if s] == [2048.0, 1024.0, 512.0]
    # overridable: a user who expects a longer calibration asks for more halvings in a row
    assert not any(_verdicts(lines, DetectionSettings(amp_text_collapse_reductions=8)))


def test_a_healthy_calibration_is_not_a_collapse() -> None:
    # hysteresis then 65536 -> 8192 at the first steps (the thread: the scaler's normal search)
    assert not any(_verdicts(_scale_lines("num-ds-overflow-hysteresis-1"), DetectionSettings()))
    # six halvings from 2^32 down to 2^26: the search from a larger initial scale, above the usual start
    cog = _scale_lines("num-ds-overflow-cogvideo-1")
    assert len(cog) == 6 and not any(_verdicts(cog, DetectionSettings()))


def test_a_scale_grown_back_starts_the_count_again() -> None:
    lines = _scale_lines("num-ds-overflow-training-step-1")  # 65536 (hysteresis), 32768, ..., 512
    regrown = [*lines[:5], lines[1], *lines[2:5]]  # 4 halvings, back at 32768, then 3 more: never 5 in a row
    assert not any(_verdicts(regrown, DetectionSettings()))
    assert _verdicts(lines[:6], DetectionSettings())[-1]  # without the regrowth the 5th halving is one


def test_a_scale_at_the_floor_is_a_collapse_on_its_own() -> None:
    low = classify_text("| WARNING: overflow detected, setting loss scale to: 0.25")
    assert low is not None
    assert _verdicts([low], DetectionSettings()) == [True]
    assert _verdicts([low], DetectionSettings(amp_text_max_scale=0.1)) == [False]


