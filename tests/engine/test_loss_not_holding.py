"""The loss curve's rules answer "does not hold" with one shared verdict (loss._NOT_HOLDING, issue 15 stop
39): nothing may change it -- its fields or its evidence list -- and a finding never carries its list."""
from __future__ import annotations

from dataclasses import astuple

from tests.engine.test_pipeline_golden import CORPUS
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.detectors import loss
from trainguard_engine.pipeline import Pipeline


def test_shared_not_holding_verdict_stays_as_built() -> None:
    pristine = astuple(loss._Check(False))
    opened = set()
    for scenario in SCENARIOS:
        if scenario.name not in ("plateau", "oscillation", "healthy"):
            continue
        pipeline = Pipeline(CORPUS)
        for event in scenario.events():
            for incident in pipeline.process([event]).incidents:
                assert incident.evidence is not loss._NOT_HOLDING.evidence
                opened.add(f"{incident.category}/{incident.subtype}")
        assert astuple(loss._NOT_HOLDING) == pristine
        assert loss._NOT_HOLDING.evidence == []
    assert {"loss/plateau", "loss/oscillation"} <= opened  # the curve's opening path ran
