"""A loss that converged is not a plateau (detectors/loss.py, ``plateau_converged_level``), on a real run:
``tests/fixtures/converged/exact_fit.jsonl.gz`` (source.txt there) -- a linear model fitting exact targets,
its loss from 9.8 to 3.7e-13 and its grad norm to ~1e-6, flat at float32's floor for 250 steps. Tiny
gradients alone read as "optimisation stuck" (``plateau_small_grad``); at a minimum they vanish too."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any, Dict, List

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "converged" / "exact_fit.jsonl.gz"


def _kinds(settings: DetectionSettings) -> List[str]:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as fh:
        events: List[Dict[str, Any]] = [json.loads(line) for line in fh if line.strip()]
    pipeline = Pipeline(settings)
    for event in events:
        pipeline.process([event])
    pipeline.advance(int(events[-1]["time_unix_nano"]) + 60 * 10**9)
    return [f"{i.category}/{i.subtype}" for i in pipeline.incidents()]


def test_a_loss_that_converged_to_zero_opens_no_plateau() -> None:
    assert _kinds(DetectionSettings()) == []


def test_the_rule_is_a_setting_and_off_gives_the_old_plateau() -> None:
    off = dataclasses.replace(DetectionSettings(), plateau_converged_level=0.0)
    assert _kinds(off) == ["loss/plateau"]
