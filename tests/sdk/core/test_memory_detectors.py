"""memory/fragmentation and memory/amp-overflow on the real H200 streams (tests/scenarios/streams_gpu)
and the healthy CPU streams, calling the detector functions directly (before the pipeline wiring)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from trainguard.core.catalogue import DetectionSettings
from trainguard.core.detectors import memory
from trainguard.core.extract import batch_points, payload
from trainguard.core.incidents import Finding
from trainguard.core.state import RunState

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "tests" / "scenarios" / "streams_gpu"
HEALTHY = [*sorted((ROOT / "tests" / "scenarios" / "streams").glob("healthy_*.jsonl")),
           ROOT / "tests" / "fixtures" / "streams" / "healthy.jsonl"]
DEFAULTS = DetectionSettings()


def load(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drive(events: List[Dict[str, Any]], settings: DetectionSettings = DEFAULTS) -> List[Finding]:
    """Feed events in order, as the pipeline will: memory payloads to on_memory, metric batches to
    on_metrics."""
    runs: Dict[str, RunState] = {}
    out: List[Finding] = []
    for raw in events:
        kind, body = payload(raw)
        run = runs.setdefault(raw["run_id"], RunState(project=raw.get("project", ""), run_id=raw["run_id"]))
        rank = run.rank_state(int(raw.get("rank", 0)), settings)
        assert rank is not None
        rank.touch(int(raw["time_unix_nano"]), raw.get("host", ""), int(raw.get("pid", 0)))
        step, t, eid = int(raw.get("step", 0)), int(raw["time_unix_nano"]), raw.get("event_id", "")
        if kind == "memory":
            out.extend(memory.on_memory(run, rank, body, step, t, eid, settings))
        elif kind == "metrics":
            out.extend(memory.on_metrics(run, rank, batch_points(body, step), step, t, eid, settings))
    return out


def first_step_above(events: List[Dict[str, Any]], threshold: float) -> int:
    return next(e["step"] for e in events if "memory" in e and e["memory"]["fragmentation"] > threshold)


def test_fragmentation_stream_is_severe_from_first_step_above_half() -> None:
    events = load(GPU / "gpu_fragmentation.jsonl")
    found = drive(events)
    frag = [f for f in found if (f.category, f.subtype) == ("memory", "fragmentation")]
    opened = [f for f in frag if f.counts]
    assert len(opened) == 1
    f = opened[0]
    assert f.step == first_step_above(events, 0.5) == 3
    assert f.values["level"] == "severe"
    rules = {e.rule: e for e in f.evidence}
    severe = rules["memory.fragmentation.severe"]
    assert severe.threshold == 0.5 and float(severe.value or 0) > 0.5 and severe.window
    # the stream covers ~2 s of memory events, far less than 60 s: the evidence says so
    assert "covers only" in rules["memory.fragmentation.peak_headroom"].description
    assert not [x for x in found if x.subtype == "amp-overflow"]
    # later findings only refresh it (no new count) as the ratio worsens, up to the stream's peak 0.981
    updates = [x for x in frag if not x.counts]
    assert updates and all(x.replace_evidence and x.update_values and x.step == 3 for x in updates)
    assert max(float(x.values["value"]) for x in frag) >= 0.95


def test_amp_overflow_stream_reports_scale_collapse() -> None:
    found = drive(load(GPU / "gpu_amp_overflow.jsonl"))
    amp = [f for f in found if (f.category, f.subtype) == ("memory", "amp-overflow")]
    assert len([f for f in amp if f.counts]) == 1
    assert amp[0].counts and amp[0].step == 0 and amp[0].seen_step == memory.AMP_OVERFLOW_CONSECUTIVE - 1
    f = amp[-1]  # the last refresh: every overflow step of the stream seen
    assert f.step == 0 and not f.counts and f.replace_evidence
    rules = {e.rule: e for e in f.evidence}
    assert rules["memory.amp_overflow.consecutive"].value == 21.0  # steps 0-20 overflowed in a row
    traj = rules["memory.amp_overflow.scale"].window
    values = [p["value"] for p in traj]
    assert values[0] == 65536.0 and values == sorted(values, reverse=True)
    assert values[-1] == 2.0**-10 == rules["memory.amp_overflow.scale"].value
    assert [p["step"] for p in rules["memory.amp_overflow.consecutive"].window][-6:] == [20, 28, 37, 50, 61, 77]
    assert not [x for x in found if x.subtype == "fragmentation"]


def test_amp_overflow_episodes_rule_without_long_streak() -> None:
    """Only the later, separate overflows (20, 28, 37, 50, 61, 77) and a short initial calibration."""
    settings = DetectionSettings()
    events = [e for e in load(GPU / "gpu_amp_overflow.jsonl") if e["step"] >= 16 or "metrics" not in e]
    found = drive(events, settings)
    amp = [f for f in found if f.subtype == "amp-overflow" and f.counts]
    assert len(amp) == 1
    assert {e.rule for e in amp[0].evidence} >= {"memory.amp_overflow.episodes"}
    assert amp[0].seen_step == 50  # episodes 16-20, 28, 37, 50: the 4th within 200 steps


def test_oom_stream_is_not_fragmentation() -> None:
    """gpu_oom: frag ~0.99 between steps only because active memory is tiny next to cached score buffers
    (reserved stays within 1.32x the peak allocated): not fragmentation. The OOM itself is memory/oom
    (error, from the exception); this detector opens nothing on it."""
    assert drive(load(GPU / "gpu_oom.jsonl")) == []


@pytest.mark.parametrize("path", HEALTHY, ids=lambda p: p.name)
def test_healthy_streams_give_nothing(path: Path) -> None:
    assert drive(load(path)) == []


def test_replay_counts_nothing_twice() -> None:
    events = load(GPU / "gpu_amp_overflow.jsonl")
    once = drive(events)
    assert len(drive(events + events)) == len(once)


@pytest.mark.parametrize("name,expected", [
    ("gpu_amp_overflow", [("memory", "amp-overflow")]),  # overflow NaN grads are not a nan-source
    ("gpu_fragmentation", [("memory", "fragmentation")]),
    ("gpu_oom", [("memory", "oom")]),  # its cached attention buffers are not fragmentation
])
def test_the_pipeline_classifies_each_real_gpu_stream_as_exactly_its_kind(name: str, expected: list) -> None:
    from trainguard.core.pipeline import Pipeline

    pipeline = Pipeline()
    pipeline.process(load(GPU / f"{name}.jsonl"))
    assert sorted((i.category, i.subtype) for i in pipeline.incidents()) == expected
