"""The incident record's diagnosis (core/diagnosis.py) on the real scenario corpus: duration, related
metrics, trigger conditions and ranked hypotheses. Expected values are recomputed from the recorded
streams themselves (LR at the onset, peak memory, the OOM request against the GPU's capacity), not
copied from the pipeline's output."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, SCENARIOS
from trainguard.core.events import from_wire_float
from trainguard_engine.catalogue import DetectionSettings, kind
from trainguard_engine.classify import classify_chain
from trainguard_engine.diagnosis import PRIORS, hypotheses
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident

Event = Dict[str, Any]


def incidents_of(name: str) -> List[Incident]:
    pipeline = Pipeline(DetectionSettings())
    pipeline.process(BY_NAME[name].events())
    return pipeline.incidents()


def only(name: str) -> Incident:
    (incident,) = incidents_of(name)
    return incident


def series(events: Sequence[Event], names: Sequence[str]) -> List[Tuple[int, float]]:
    out = []
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] in names:
                out.append((int(p.get("step") or e["step"]), from_wire_float(p["value"])))
    return sorted(out)


def at_or_before(values: Sequence[Tuple[int, float]], step: int) -> float:
    return [v for s, v in values if s <= step][-1]


ANOMALOUS = [s.name for s in SCENARIOS if not s.healthy and s.source != "dist"]


@pytest.mark.parametrize("name", ANOMALOUS)
def test_every_incident_carries_a_diagnosis(name: str) -> None:
    for inc in incidents_of(name):
        assert inc.duration_s == pytest.approx(max(0, inc.last_ns - inc.first_ns) / 1e9, abs=1e-3)
        assert inc.trigger.get("step") == inc.first_step or inc.first_step < 0
        assert inc.hypotheses, inc.title
        confidences = [h["confidence"] for h in inc.hypotheses]
        assert confidences == sorted(confidences, reverse=True)
        assert sum(confidences) == pytest.approx(1.0, abs=0.03)
        assert all(h["why"] for h in inc.hypotheses)
        causes = kind(inc.category, inc.subtype).causes
        assert any(h["cause"] in causes for h in inc.hypotheses)


def test_explosion_trigger_is_the_rising_lr_and_the_lead_hypothesis_says_so() -> None:
    events = BY_NAME["explosion"].events()
    inc = only("explosion")
    lrs = series(events, ("opt/lr",))
    lr_then = at_or_before(lrs, inc.first_step)
    assert inc.trigger["lr_phase"] == "rising"
    assert inc.trigger["lr"] == pytest.approx(lr_then, rel=0.06)  # the LR log keeps 5% changes
    assert inc.trigger["lr_growth"] == pytest.approx(lr_then / lrs[0][1], rel=0.06)
    top = inc.hypotheses[0]
    assert "learning rate" in top["cause"] and "grew" in top["why"][0]
    loss = series(events, ("loss",))
    assert inc.related["loss"]["min"] == pytest.approx(min(v for _s, v in loss if math.isfinite(v)), rel=1e-6)
    assert inc.related["loss"]["last"] in ("NaN", "Infinity")


def test_rise_after_fall_keeps_the_lr_at_its_turn_although_the_history_dropped_that_step() -> None:
    events = BY_NAME["rise_after_fall"].events()
    inc = only("rise_after_fall")
    lrs = series(events, ("opt/lr",))
    assert len(lrs) > 2 * DetectionSettings().history_len  # the history no longer holds the turn
    assert inc.trigger["lr"] == pytest.approx(at_or_before(lrs, inc.first_step), rel=0.06)
    rising = at_or_before(lrs, inc.first_step) > at_or_before(lrs, max(0, inc.first_step - 8))
    assert (inc.trigger["lr_phase"] == "rising") is rising
    top_two = {h["cause"] for h in inc.hypotheses[:2]}
    assert top_two == {c for c in kind("loss", "rise-after-fall").causes if "LR" in c or "learning rate" in c}


def test_peak_memory_is_the_highest_value_the_rank_reported_up_to_the_incidents_last_signal() -> None:
    inc = only("gpu_fragmentation")
    events = [e for e in BY_NAME["gpu_fragmentation"].events() if int(e["time_unix_nano"]) <= inc.last_ns]
    for name in ("mem/reserved", "mem/allocated"):
        values = [v for _s, v in series(events, (name,))]
        memory_events = [int(e["memory"][name[4:]]) for e in events if name[4:] in e.get("memory", {})]
        assert inc.related["peak_memory_bytes"][name] == int(max(values + memory_events))


def test_oom_hypotheses_follow_the_parsed_message() -> None:
    events = BY_NAME["gpu_oom"].events()
    (exc,) = [e["exception"] for e in events if "exception" in e]
    facts = classify_chain(exc["type"], exc["message"], exc.get("chain", [])).facts
    inc = only("gpu_oom")
    top = inc.hypotheses[0]["cause"]
    if facts["requested"] > facts["capacity"] / 4:
        assert top.startswith("activations too large")
    if facts.get("reserved_unallocated", 0) >= facts["requested"]:
        assert "fragmentation" in " ".join(h["cause"] for h in inc.hypotheses[:2])


def test_without_evidence_for_a_cause_the_catalogue_order_is_the_ranking() -> None:
    from trainguard_engine.diagnosis import Facts

    ranked = hypotheses("gradient", "vanishing", Facts())
    causes = kind("gradient", "vanishing").causes
    assert [h["cause"] for h in ranked] == list(causes)
    weights = [PRIORS[min(i, len(PRIORS) - 1)] for i in range(len(causes))]
    assert [h["confidence"] for h in ranked] == [round(w / sum(weights), 2) for w in weights]


def test_a_single_process_stall_does_not_blame_a_collective() -> None:
    from trainguard_engine.diagnosis import Facts

    ranked = hypotheses("progress", "stalled", Facts(world_size=1))
    assert not ranked[0]["cause"].startswith("a collective waiting")
    ranked = hypotheses("progress", "stalled", Facts(world_size=8))
    assert ranked[0]["cause"].startswith("a collective waiting")


def test_diagnosis_survives_snapshot_restore_and_the_json_round_trip() -> None:
    events = BY_NAME["explosion"].events()
    half = len(events) // 2
    straight = Pipeline()
    straight.process(events)
    first = Pipeline()
    first.process(events[:half])
    resumed = Pipeline.restore(first.snapshot())
    resumed.process(events[half:])
    assert resumed.incidents() == straight.incidents()
    for inc in straight.incidents():
        assert Incident.from_dict(inc.to_dict()) == inc


def test_a_high_constant_lr_is_the_lead_hypothesis_of_an_explosion() -> None:
    """Issue 16: 'LR too high' was ranked last for a constant LR of 1.5 (only a growing LR counted)."""
    from trainguard_engine.diagnosis import Facts

    def lead(lr: float, phase: str = "constant", lr_high: float = 0.1) -> str:
        facts = Facts(lr=lr, lr_phase=phase, lr_growth=1.0, clip_rate=0.0, lr_high=lr_high)
        return str(hypotheses("gradient", "explosion", facts)[0]["cause"])

    lr_cause = kind("gradient", "explosion").cause_text("learning-rate-too-high")
    assert lead(1.5) == lr_cause
    assert lead(1e-4) != lr_cause           # its level says nothing
    assert lead(1.5, lr_high=2.0) != lr_cause  # the documented setting decides
    ranked = hypotheses("loss", "non_finite", Facts(lr=1.5, lr_phase="decaying", lr_growth=1.0, lr_high=0.1))
    assert ranked[0]["cause"] == kind("loss", "non_finite").cause_text("learning-rate-too-high")
    assert "1.5" in ranked[0]["why"][0]
