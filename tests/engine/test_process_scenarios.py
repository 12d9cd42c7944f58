"""The process-level scenarios of the corpus (tests/scenarios/trainings_process.py, recorded in
tests/scenarios/streams/crash.jsonl and stall.jsonl) through the pure pipeline: the kind, the first step
and the evidence. Expected values are read from the recorded streams themselves (the last logged step,
the exception the SDK captured, the exit, the heartbeats' timing), not from the pipeline's output."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Sequence, Tuple

from tests.scenarios.corpus import BY_NAME
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident, RunRecord

Event = Dict[str, Any]

STALL_FLOOR_S = 5.0
"""The stall floor the stall stream was recorded for (bench/detection.py's default): 12 s of hang, a
heartbeat a second (tests/scenarios/record.py)."""
HEARTBEAT_S = 1.0


def run(name: str, settings: DetectionSettings) -> Tuple[List[Incident], RunRecord]:
    pipeline = Pipeline(settings)
    pipeline.process(BY_NAME[name].events())
    (record,) = pipeline.runs()
    return pipeline.incidents(), record


def kinds(incidents: Sequence[Incident]) -> List[Tuple[str, str]]:
    return [(i.category, i.subtype) for i in incidents]


def of_kind(incidents: Sequence[Incident], category: str, subtype: str) -> Incident:
    (found,) = [i for i in incidents if (i.category, i.subtype) == (category, subtype)]
    return found


def metric_steps(events: Sequence[Event]) -> List[Tuple[int, int]]:
    """(step, event time) of every metric point, in stream order."""
    return [(int(p.get("step") or e["step"]), int(e["time_unix_nano"]))
            for e in events for p in e.get("metrics", {}).get("points", [])]


def lifecycle(events: Sequence[Event], phase: str) -> Event:
    (found,) = [e for e in events if e.get("lifecycle", {}).get("phase") == phase]
    return found


# ------------------------------------------------------------------------------------------------- crash

def test_crash_stream_is_the_real_bug() -> None:
    events = BY_NAME["crash"].events()
    (exc,) = [e for e in events if "exception" in e]
    body = exc["exception"]
    assert body["type"] == "RuntimeError" and not body["handled"]
    # 3000 rows, batches of 32: 93 full batches (steps 0..92), then 24 rows that cannot be 32 images
    assert body["message"] == "shape '[32, 1, 8, 8]' is invalid for input of size 1536"
    assert "x.view(BATCH, 1, 8, 8)" in body["traceback"]
    assert max(s for s, _t in metric_steps(events)) == 3000 // 32 - 1 == exc["step"]
    assert lifecycle(events, "EXIT")["lifecycle"]["exit_code"] == 1


def test_crash_is_exactly_one_process_exception_at_the_last_completed_step() -> None:
    events = BY_NAME["crash"].events()
    incidents, record = run("crash", DetectionSettings())
    assert kinds(incidents) == [("process", "exception")]
    (inc,) = incidents
    (exc,) = [e for e in events if "exception" in e]
    last_step = max(s for s, _t in metric_steps(events))
    assert inc.first_step == last_step == 92  # the last step that completed; it died in the next one
    assert inc.lead_rank == 0 and inc.severity == "error"
    assert "RuntimeError" in inc.title and "invalid for input of size 1536" in inc.title
    assert inc.fingerprint and inc.fingerprint == exc["exception"].get("fingerprint", inc.fingerprint)
    rules = {e.rule: e for e in inc.evidence}
    assert rules["exception.uncaught"].value == "RuntimeError"
    assert rules["exception.uncaught"].event_id == exc["event_id"]
    assert rules["exit.code"].value == 1
    assert rules["exit.code"].time_ns == lifecycle(events, "EXIT")["time_unix_nano"]
    assert record.status == "failed" and record.exit_codes == {"0": 1}


# ------------------------------------------------------------------------------------------------- stall

def test_stall_stream_is_a_real_hang_with_heartbeats() -> None:
    events = BY_NAME["stall"].events()
    steps = metric_steps(events)
    last_step, last_ns = max(steps)
    assert last_step == 2048 // 32 - 1  # the last step of epoch 0: epoch 1's forked workers deadlock
    exit_event = lifecycle(events, "EXIT")
    assert exit_event["lifecycle"]["exit_code"] == 143 and exit_event["lifecycle"]["signal"] == 15
    beats = [e for e in events if "heartbeat" in e]
    after = [e for e in beats if e["time_unix_nano"] > last_ns]
    # alive all along: a heartbeat at least every ~HEARTBEAT_S from the last step to the SIGTERM ...
    times = [last_ns, *sorted(e["time_unix_nano"] for e in after), exit_event["time_unix_nano"]]
    assert max(b - a for a, b in zip(times, times[1:])) / 1e9 < 2 * HEARTBEAT_S
    assert (exit_event["time_unix_nano"] - last_ns) / 1e9 > 2 * STALL_FLOOR_S
    # ... every one of them saying the step has not moved
    assert {e["heartbeat"]["last_step"] for e in after} == {last_step}
    # the deadlocked workers are alive too: forked children of the main process heartbeat as rank 0
    main_pid = lifecycle(events, "START")["pid"]
    assert len({e["pid"] for e in after} - {main_pid}) == 2


def test_stall_opens_a_stall_at_the_last_step_within_one_heartbeat_of_the_threshold() -> None:
    events = BY_NAME["stall"].events()
    steps = metric_steps(events)
    last_step = max(s for s, _t in steps)
    reached_ns = min(t for s, t in steps if s == last_step)  # the event that first carried that step
    incidents, record = run("stall", DetectionSettings(stall_min_s=STALL_FLOOR_S))
    inc = of_kind(incidents, "progress", "stalled")
    assert inc.first_step == last_step and inc.lead_rank == 0 and inc.ranks == [0]
    # it begins at the last progress: the later of when the step last advanced and the SDK's step time
    sdk_progress = max(e["heartbeat"]["last_step_time_unix_nano"] for e in events if "heartbeat" in e)
    assert inc.first_ns == max(reached_ns, sdk_progress)
    (evidence,) = [e for e in inc.evidence if e.rule == "progress.stalled"]
    assert evidence.threshold == STALL_FLOOR_S  # the step time is milliseconds: the floor decides
    assert evidence.value is not None and float(evidence.value) > STALL_FLOOR_S
    (flagged,) = [t for t in inc.timeline if t.what.endswith(": stalled")]
    detected_after = (flagged.time_ns - inc.first_ns) / 1e9
    assert STALL_FLOOR_S < detected_after <= STALL_FLOOR_S + HEARTBEAT_S + 0.1
    assert record.status == "failed" and record.exit_codes == {"0": 143}


def test_stall_is_exactly_one_incident_and_the_sigterm_that_ended_it_is_its_evidence() -> None:
    events = BY_NAME["stall"].events()
    exit_event = lifecycle(events, "EXIT")
    incidents, _record = run("stall", DetectionSettings(stall_min_s=STALL_FLOOR_S))
    assert kinds(incidents) == [("progress", "stalled")]
    (inc,) = incidents
    # the hang is why the run failed: the stall stays open, the exit is a consequence on it
    assert inc.status != "resolved"
    (exit_evidence,) = [e for e in inc.evidence if e.rule == "exit.code"]
    assert exit_evidence.value == 143 and exit_evidence.time_ns == exit_event["time_unix_nano"]
    assert any("143" in t.what and t.time_ns == exit_event["time_unix_nano"] for t in inc.timeline)


def test_stall_below_the_production_floor_is_not_a_stall() -> None:
    """12 s without progress is under the default 120 s floor: only the termination is reported."""
    incidents, _record = run("stall", DetectionSettings())
    assert kinds(incidents) == [("process", "terminated")]
    assert math.isclose(DetectionSettings().stall_min_s, 120.0)


def test_crash_title_names_the_shape_in_the_message_template() -> None:
    events = BY_NAME["crash"].events()
    (exc,) = [e["exception"] for e in events if "exception" in e]
    template = exc.get("message_template", "")
    # sizes are parameterised in the fingerprint's template, so every epoch-end crash groups as one
    assert template and not re.search(r"\b1536\b", template)


def test_a_hang_without_heartbeats_is_seen_at_the_kill() -> None:
    """Heartbeats off (or a replayed run, which has none): the same hung run is still a stall -- from its
    last progress, seen when the watchdog's SIGTERM ended it -- with the termination as its evidence."""
    events = [e for e in BY_NAME["stall"].events() if "heartbeat" not in e]
    pipeline = Pipeline(DetectionSettings(stall_min_s=STALL_FLOOR_S))
    pipeline.process(events)
    (incident,) = pipeline.incidents()
    last_step = max(s for s, _t in metric_steps(events))
    assert (incident.category, incident.subtype, incident.first_step) == ("progress", "stalled", last_step)
    assert {e.rule for e in incident.evidence} >= {"progress.stalled_until_exit", "exit.code"}
    assert incident.consequences == ["process/terminated on rank 0"]
    # a crash right after its last step is not a hang
    crash = [e for e in BY_NAME["crash"].events() if "heartbeat" not in e]
    crashed = Pipeline(DetectionSettings(stall_min_s=STALL_FLOOR_S))
    crashed.process(crash)
    assert kinds(crashed.incidents()) == [("process", "exception")]


def test_a_runtime_that_advances_at_next_timer_flags_the_hang_at_the_threshold_itself() -> None:
    """Heartbeats arrive every second; the stall threshold (5 s floor) falls between two of them. A runtime
    calling ``advance`` at ``next_timer_ns`` flags the hang at the threshold, not at the next heartbeat."""
    settings = DetectionSettings(stall_min_s=STALL_FLOOR_S)
    events = BY_NAME["stall"].events()
    last_progress = max(t for _s, t in metric_steps(events))
    threshold_ns = int(STALL_FLOOR_S * 1e9)
    before = [e for e in events if int(e["time_unix_nano"]) < last_progress + threshold_ns]
    pipeline = Pipeline(settings)
    pipeline.process(before)
    assert not pipeline.incidents()  # no heartbeat past the threshold yet
    assert pipeline.advance(int(before[-1]["time_unix_nano"])).is_empty()
    deadline = pipeline.next_timer_ns
    assert deadline > int(before[-1]["time_unix_nano"])
    assert pipeline.advance(deadline - 1).is_empty()
    out = pipeline.advance(deadline)
    (incident,) = out.incidents
    assert (incident.category, incident.subtype) == ("progress", "stalled")
    assert incident.last_ns - incident.first_ns <= threshold_ns + 1
    # the heartbeats that follow join the same incident; a silent rank is never called stalled by the clock
    pipeline.process([e for e in events if int(e["time_unix_nano"]) >= last_progress + threshold_ns])
    assert len(pipeline.incidents()) == 1
    silent = Pipeline(settings)
    silent.process(before)
    silent.advance(int(before[-1]["time_unix_nano"]))
    assert silent.advance(silent.next_timer_ns + int(60e9)).incidents == []
