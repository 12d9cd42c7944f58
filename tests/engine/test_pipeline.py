"""The pure pipeline over real event streams recorded from the demo trainings (tests/fixtures/streams),
plus synthetic edge cases built from those real envelopes with fields changed."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from trainguard.core.events import from_wire_float
from trainguard_engine.catalogue import DetectionSettings, kind
from trainguard_engine.pipeline import Pipeline, PipelineOutput
from trainguard_engine.records import (
    INCIDENT_OPEN,
    INCIDENT_RESOLVED,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_LOST,
    RUN_RUNNING,
    RUN_STALLED,
    Incident,
)

STREAMS = Path(__file__).resolve().parents[1] / "fixtures" / "streams"
NAMES = ("healthy", "diverging", "crashing", "stalling", "crashing_2rank")
DEMO = DetectionSettings(stall_min_s=2.0)  # the demo's setting: a stall is a few seconds


def load(name: str) -> List[Dict[str, Any]]:
    with open(STREAMS / f"{name}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def of_kind(events: Sequence[Dict[str, Any]], kind_: str) -> List[Dict[str, Any]]:
    return [e for e in events if kind_ in e]


def run_all(events: Sequence[Dict[str, Any]], settings: DetectionSettings = DEMO) -> Pipeline:
    pipeline = Pipeline(settings)
    pipeline.process(events)
    return pipeline


def final(pipeline: Pipeline) -> Tuple[Any, ...]:
    return pipeline.runs(), pipeline.incidents(), pipeline.clusters()


def state(pipeline: Pipeline) -> Dict[str, Any]:
    """The snapshot without the counters (which count replays, by design)."""
    doc = json.loads(pipeline.snapshot())
    del doc["counters"]
    return doc


def points(events: Sequence[Dict[str, Any]], name: str) -> List[Tuple[int, float]]:
    """(step, value) of every point of ``name`` in the stream, in stream order (the envelope's step)."""
    out = []
    for e in of_kind(events, "metrics"):
        for p in e["metrics"]["points"]:
            if p["name"] == name:
                out.append((e["step"], from_wire_float(p["value"])))
    return out


def last_time(events: Sequence[Dict[str, Any]]) -> int:
    return max(int(e["time_unix_nano"]) for e in events)


# ------------------------------------------------------------------------------------------------------
# The real streams


def test_healthy_run_has_no_incident_and_finishes() -> None:
    events = load("healthy")
    pipeline = run_all(events)
    (run,), incidents, clusters = final(pipeline)
    assert incidents == [] and clusters == []
    assert run.status == RUN_FINISHED and run.health == "healthy" and run.open_incidents == 0
    assert run.exit_codes == {"0": 0}
    assert run.last_step == max(s for s, _ in points(events, "loss"))
    assert run.tags["kind"] == "healthy"
    assert run.run_name == "demo-healthy" and run.ranks == [0]
    assert run.started_ns == of_kind(events, "lifecycle")[0]["time_unix_nano"]
    assert 0 < run.step_time_s < 1
    # a finished run is never lost, however long it stays silent
    assert pipeline.advance(last_time(events) + 10**13).incidents == []


def test_healthy_run_has_no_incident_with_default_settings_either() -> None:
    pipeline = run_all(load("healthy"), DetectionSettings())
    assert pipeline.incidents() == []


def _explosion_by_rule(events: Sequence[Dict[str, Any]], settings: DetectionSettings) -> bool:
    """DESIGN §4 correlation rule, first version, recomputed independently from the raw stream."""
    loss_step = min(s for s, v in points(events, "loss") if not math.isfinite(v))
    grads: Dict[int, float] = {}
    for step, value in points(events, "grad/global_norm"):
        grads[step] = value  # the last value logged at a step wins
    window = sorted((s, v) for s, v in grads.items() if loss_step - settings.explosion_window_steps <= s < loss_step)
    nonfinite = [s for s, v in window if not math.isfinite(v)]
    finite = [(s, v) for s, v in window if math.isfinite(v) and (not nonfinite or s < nonfinite[0])]
    peak_step, peak = max(finite, key=lambda p: (p[1], -p[0]))
    before = [v for s, v in finite if s < peak_step]
    baseline = statistics.median(before[: (len(before) + 1) // 2])
    return bool(nonfinite) or peak >= settings.explosion_jump_factor * baseline


def test_diverging_run_is_one_numeric_incident_classified_by_the_documented_rule() -> None:
    events = load("diverging")
    pipeline = run_all(events)
    (run,), (incident,), clusters = final(pipeline)
    assert clusters == []
    explosion = _explosion_by_rule(events, DEMO)
    expected = ("gradient", "explosion") if explosion else ("loss", "non_finite")
    assert (incident.category, incident.subtype) == expected
    # first_step: the first non-finite value anywhere in the stream
    first_bad = min(e["step"] for e in of_kind(events, "metrics")
                    for p in e["metrics"]["points"] if not math.isfinite(from_wire_float(p["value"])))
    # where it started: the climb's onset, before the first non-finite value
    onset = next(e.step for e in incident.evidence if e.rule == "gradient.norm_climb")
    assert incident.first_step == onset < first_bad
    loss_step = min(s for s, v in points(events, "loss") if not math.isfinite(v))
    assert incident.last_step == loss_step
    assert incident.ranks == [0] and incident.lead_rank == 0 and incident.count == 1
    assert incident.severity == kind(*expected).severity
    assert sorted(incident.checks) == sorted(kind(*expected).checklist())  # AMP checks last: no scaler here
    rules = {e.rule: e for e in incident.evidence}
    loss_ev = rules["loss.non_finite"]
    assert loss_ev.step == loss_step and loss_ev.metric == "loss"
    assert loss_ev.window[-1] == {"step": loss_step, "value": "Infinity"}  # what the real run produced
    assert [w["step"] for w in loss_ev.window] == sorted(w["step"] for w in loss_ev.window)
    if explosion:
        # the evidence states the rule: a climb past the threshold, or a non-finite norm before the loss
        climb = rules.get("gradient.norm_climb")
        nonfinite = rules.get("gradient.non_finite")
        assert climb is not None or nonfinite is not None
        if climb is not None:
            assert climb.threshold == DEMO.explosion_jump_factor and climb.value >= climb.threshold
            assert climb.step < loss_step
            grads = dict(points(events, "grad/global_norm"))
            for item in climb.window:
                assert from_wire_float(item["value"]) == pytest.approx(grads[item["step"]], nan_ok=True)
        if nonfinite is not None:
            assert nonfinite.step < loss_step
        assert "Gradient explosion" in incident.title and f"step {loss_step}" in incident.title
    assert [t.time_ns for t in incident.timeline] == sorted(t.time_ns for t in incident.timeline)
    # the script stopped by itself: exit 0, finished, but the open incident makes it critical
    assert run.status == RUN_FINISHED and run.health == "critical" and run.open_incidents == 1


def test_diverging_without_gradient_metrics_is_a_plain_non_finite_loss() -> None:
    events = load("diverging")
    for e in of_kind(events, "metrics"):
        e["metrics"]["points"] = [p for p in e["metrics"]["points"] if not p["name"].startswith("grad/")]
        e["metrics"].pop("recent", None)
    events = [e for e in events if "metrics" not in e or e["metrics"]["points"]]
    (incident,) = run_all(events).incidents()
    assert (incident.category, incident.subtype) == ("loss", "non_finite")
    loss_step = min(s for s, v in points(events, "loss") if not math.isfinite(v))
    assert incident.first_step == loss_step
    assert incident.title == f"Loss became Infinity at step {loss_step}"
    assert "no gradient-norm metric" in incident.summary


def test_crashing_run_is_one_exception_incident_with_its_fingerprint() -> None:
    events = load("crashing")
    (exc_event,) = of_kind(events, "exception")
    (exit_event,) = [e for e in of_kind(events, "lifecycle") if e["lifecycle"]["phase"] == "EXIT"]
    pipeline = run_all(events)
    (run,), (incident,), (cluster,) = final(pipeline)
    exc = exc_event["exception"]
    assert (incident.category, incident.subtype) == ("process", "exception")
    assert incident.fingerprint == exc["fingerprint"] == cluster.fingerprint
    assert incident.first_step == exc_event["step"] and incident.ranks == [0] and incident.lead_rank == 0
    assert incident.title == f"Crashed: {exc['type']}: {exc['message']}"
    assert incident.count == 1  # the exit explains nothing new: evidence, not another signal
    assert [e.rule for e in incident.evidence] == ["exception.uncaught", "exit.code"]
    assert incident.evidence[0].event_id == exc_event["event_id"]
    assert incident.evidence[1].value == 1 and incident.evidence[1].event_id == exit_event["event_id"]
    assert incident.status == "ongoing"  # opened by the exception, then more evidence (the exit)
    assert run.status == RUN_FAILED and run.exit_codes == {"0": 1} and run.health == "critical"
    assert cluster.count == 1 and cluster.runs == [run.run_id] and cluster.ranks == [f"{run.run_id}:0"]
    assert cluster.sample_event_id == exc_event["event_id"]
    assert cluster.exc_type == exc["type"] and cluster.message_template == exc["message_template"]
    assert cluster.sample["traceback"] == exc["traceback"]
    assert cluster.sample["frames"] == [{"context_line": "", **f} for f in exc["frames"]]
    assert [h["reason"] for h in cluster.sample["hints"]] == [h["reason"] for h in exc["hints"]]


def test_two_ranks_with_the_same_exception_are_one_incident_and_one_cluster_of_two() -> None:
    events = load("crashing_2rank")
    pipeline = run_all(events)
    (run,), (incident,), (cluster,) = final(pipeline)
    first_raise = min(of_kind(events, "exception"), key=lambda e: e["time_unix_nano"])
    assert incident.ranks == [0, 1] and incident.lead_rank == first_raise["rank"]
    assert incident.count == 2 and incident.fingerprint == cluster.fingerprint
    assert cluster.count == 2
    assert sorted(cluster.ranks) == [f"{run.run_id}:0", f"{run.run_id}:1"] and cluster.runs == [run.run_id]
    assert cluster.sample_event_id == first_raise["event_id"]
    assert run.status == RUN_FAILED and run.exit_codes == {"0": 1, "1": 1}
    assert run.ranks == [0, 1] and run.world_size == 2


def _heartbeats(events: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return of_kind(events, "heartbeat")


def test_stalling_run_opens_a_stall_from_heartbeats_within_the_threshold() -> None:
    events = load("stalling")
    stalled_step = max(s for s, _ in points(events, "loss"))
    heartbeats = _heartbeats(events)
    # last progress: the later of the SDK's own record and the event that carried the last step
    last_loss = next(e for e in of_kind(events, "metrics") if e["step"] == stalled_step)
    progress_ns = max(heartbeats[-1]["heartbeat"]["last_step_time_unix_nano"], last_loss["time_unix_nano"])
    pipeline = Pipeline(DEMO)
    opened_at: Optional[Dict[str, Any]] = None
    for event in events:  # one event at a time, as a live stream would arrive
        out = pipeline.process([event])
        if opened_at is None and any(i.subtype == "stalled" for i in out.incidents):
            opened_at = event
    assert opened_at is not None and "heartbeat" in opened_at
    waited = (opened_at["time_unix_nano"] - progress_ns) / 1e9
    interval = 0.5  # the recording's TRAINGUARD_HEARTBEAT_INTERVAL
    assert DEMO.stall_min_s < waited <= DEMO.stall_min_s + interval + 0.1
    (run,), (incident,), _ = final(pipeline)
    assert (incident.category, incident.subtype) == ("progress", "stalled")
    assert incident.first_step == stalled_step == heartbeats[-1]["heartbeat"]["last_step"]
    assert incident.first_ns == progress_ns and incident.last_ns == heartbeats[-1]["time_unix_nano"]
    assert incident.status != INCIDENT_RESOLVED and incident.count == 1 and incident.ranks == [0]
    (ev,) = incident.evidence  # refreshed in place by every heartbeat
    assert ev.rule == "progress.stalled" and ev.threshold == DEMO.stall_min_s
    assert ev.value == pytest.approx((heartbeats[-1]["time_unix_nano"] - progress_ns) / 1e9, abs=1e-3)
    assert incident.title == f"No progress for {ev.value:.1f} s after step {stalled_step}"
    assert run.status == RUN_STALLED and run.health == "warning"


def test_stalling_run_is_not_stalled_under_default_settings() -> None:
    (run,), incidents, _ = final(run_all(load("stalling"), DetectionSettings()))
    assert incidents == [] and run.status == RUN_RUNNING  # 5 s < the 120 s floor


def test_stalling_run_killed_without_exit_becomes_lost() -> None:
    events = load("stalling")
    pipeline = run_all(events)
    end = last_time(events)
    assert pipeline.advance(end + int((DEMO.lost_after_s - 1) * 1e9)).is_empty()
    out = pipeline.advance(end + int((DEMO.lost_after_s + 1) * 1e9))
    (run,) = out.runs
    (lost,) = out.incidents
    assert (lost.category, lost.subtype) == ("progress", "lost") and lost.status == INCIDENT_OPEN
    assert lost.ranks == [0] and lost.first_ns == end and lost.first_step == run.last_step
    assert run.status == RUN_LOST and run.health == "critical" and run.open_incidents == 2
    assert pipeline.advance(end + int(2 * DEMO.lost_after_s * 1e9)).is_empty()  # once, not every tick


def test_a_replayed_run_is_never_lost() -> None:
    """`trainguard replay` tags its runs replay=true: old events and the end of a file are not silence."""
    events = copy.deepcopy(load("stalling"))
    for event in events:
        lifecycle = event.get("lifecycle")
        if lifecycle and lifecycle.get("phase") == "START":
            lifecycle.setdefault("tags", {})["replay"] = "true"
    pipeline = run_all(events)
    assert not [i for i in pipeline.advance(last_time(events) + int(10 * DEMO.lost_after_s * 1e9)).incidents
                if i.subtype == "lost"]


def _heartbeat_after(events: Sequence[Dict[str, Any]], seconds: float, last_step: int) -> Dict[str, Any]:
    """The recording's last heartbeat, ``seconds`` later, with ``last_step`` (a new event id)."""
    beat = copy.deepcopy(_heartbeats(events)[-1])
    beat["event_id"] = "f" * 32
    beat["time_unix_nano"] += int(seconds * 1e9)
    beat["heartbeat"]["last_step"] = last_step
    beat["heartbeat"]["last_step_time_unix_nano"] = beat["time_unix_nano"] - 1000
    return beat


def test_stall_resolves_when_progress_resumes() -> None:
    events = load("stalling")
    pipeline = run_all(events)
    step = pipeline.runs()[0].last_step
    resumed = _heartbeat_after(events, 1.0, step + 1)
    out = pipeline.process([resumed])
    (incident,) = out.incidents
    assert incident.status == INCIDENT_RESOLVED and "progressed again" in incident.timeline[-1].what
    assert out.runs[0].status == RUN_RUNNING and out.runs[0].health == "healthy"
    # a new stall later is a new incident (episode 2), the first one stays resolved
    later = _heartbeat_after(events, 10.0, step + 1)
    later["event_id"] = "e" * 32
    later["heartbeat"]["last_step_time_unix_nano"] = resumed["heartbeat"]["last_step_time_unix_nano"]
    pipeline.process([later])
    stalls = [i for i in pipeline.incidents() if i.subtype == "stalled"]
    assert [i.status for i in stalls] == [INCIDENT_RESOLVED, "open"]
    assert len({i.incident_id for i in stalls}) == 2


def test_stall_resolves_when_the_run_exits_and_lost_resolves_when_events_return() -> None:
    events = load("stalling")
    exit_event = copy.deepcopy([e for e in load("crashing") if "lifecycle" in e][-1])
    pipeline = run_all(events)
    pipeline.advance(last_time(events) + int((DEMO.lost_after_s + 1) * 1e9))
    for field_ in ("project", "run_id", "host", "pid", "rank"):
        exit_event[field_] = events[0][field_]
    exit_event["time_unix_nano"] = last_time(events) + int((DEMO.lost_after_s + 2) * 1e9)
    exit_event["lifecycle"].update(exit_code=143, signal=15, reason="signal")
    out = pipeline.process([exit_event])
    by_kind = {i.subtype: i for i in out.incidents}
    # killed while hung: the SIGTERM is evidence on the stall (why it was killed), which stays open
    stalled = by_kind["stalled"]
    assert stalled.status != INCIDENT_RESOLVED and "exited (code 143) while stalled" in stalled.timeline[-1].what
    assert stalled.consequences == ["process/terminated on rank 0"]
    assert [e.value for e in stalled.evidence if e.rule == "exit.code"] == [143]
    assert "terminated" not in by_kind and by_kind["lost"].status == INCIDENT_RESOLVED
    assert out.runs[0].status == RUN_FAILED and out.runs[0].exit_codes == {"0": 143}
    assert out.runs[0].health == "warning"


def test_a_stall_resolves_when_the_rank_exits_cleanly() -> None:
    events = load("stalling")
    exit_event = copy.deepcopy([e for e in load("crashing") if "lifecycle" in e][-1])
    pipeline = run_all(events)
    for field_ in ("project", "run_id", "host", "pid", "rank"):
        exit_event[field_] = events[0][field_]
    exit_event["time_unix_nano"] = last_time(events) + 10**9
    exit_event["lifecycle"].update(exit_code=0, signal=0, reason="normal")
    (stalled,) = pipeline.process([exit_event]).incidents
    assert stalled.status == INCIDENT_RESOLVED and "exited (code 0)" in stalled.timeline[-1].what


# ------------------------------------------------------------------------------------------------------
# Idempotence, determinism, snapshots


@pytest.mark.parametrize("name", NAMES)
def test_replaying_a_stream_changes_nothing(name: str) -> None:
    events = load(name)
    pipeline = run_all(events)
    before = final(pipeline), state(pipeline)
    replay = pipeline.process(events)
    assert replay.is_empty()
    assert (final(pipeline), state(pipeline)) == before
    assert pipeline.counters["duplicates"] > 0 or not any(
        k in e for e in events for k in ("exception", "lifecycle", "log"))


@pytest.mark.parametrize("name", NAMES)
def test_duplicates_interleaved_give_the_records_of_the_clean_stream(name: str) -> None:
    events = load(name)
    doubled = [e for event in events for e in (event, copy.deepcopy(event))]
    assert final(run_all(doubled)) == final(run_all(events))


@pytest.mark.parametrize("name", NAMES)
def test_batch_boundaries_do_not_matter(name: str) -> None:
    events = load(name)
    one_by_one = Pipeline(DEMO)
    for event in events:
        one_by_one.process([event])
    assert final(one_by_one) == final(run_all(events))
    assert one_by_one.snapshot() == run_all(events).snapshot()


def _merge(outputs: Sequence[PipelineOutput]) -> Dict[str, Any]:
    """What a store holds after upserting ``outputs`` in order."""
    store: Dict[str, Any] = {}
    for out in outputs:
        for r in out.runs:
            store[f"run:{r.run_id}"] = r
        for i in out.incidents:
            store[f"inc:{i.incident_id}"] = i
        for c in out.clusters:
            store[f"cl:{c.fingerprint}"] = c
    return store


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_mid_stream_equals_straight_through(name: str) -> None:
    events = load(name)
    tick = last_time(events) + int((DEMO.lost_after_s + 5) * 1e9)
    straight = Pipeline(DEMO)
    straight_outputs = [straight.process(events), straight.advance(tick)]
    for cut in range(0, len(events) + 1, 5):
        first = Pipeline(DEMO)
        out_a = first.process(events[:cut])
        blob = first.snapshot()
        restored = Pipeline.restore(blob, DEMO)
        assert restored.snapshot() == blob
        reference = Pipeline(DEMO)
        reference.process(events[:cut])
        out_b = restored.process(events[cut:])
        assert out_b == reference.process(events[cut:])  # identical outputs, record for record
        assert restored.advance(tick) == reference.advance(tick)
        assert restored.snapshot() == reference.snapshot() == straight.snapshot()
        assert final(restored) == final(straight)
        assert _merge([out_a, out_b]) == _merge(straight_outputs[:1])


def test_restore_rejects_what_is_not_a_snapshot() -> None:
    with pytest.raises(ValueError, match="not a pipeline snapshot"):
        Pipeline.restore(b"{}")
    with pytest.raises(ValueError, match="not a pipeline snapshot"):
        Pipeline.restore(b"\xff")
    blob = json.loads(Pipeline().snapshot())
    blob["version"] = 99
    with pytest.raises(ValueError, match="version 99 is not supported"):
        Pipeline.restore(json.dumps(blob).encode())


def test_outputs_are_copies_not_live_state() -> None:
    pipeline = Pipeline(DEMO)
    out = pipeline.process(load("crashing"))
    out.incidents[0].ranks.append(99)
    out.clusters[0].count = 1000
    assert pipeline.incidents()[0].ranks == [0] and pipeline.clusters()[0].count == 1


# ------------------------------------------------------------------------------------------------------
# The exit-code decision path, from the real EXIT envelope with fields changed


def _crash_stream(exit_code: int, signal: int, *, with_exception: bool,
                  exc_type: Optional[str] = None, message: Optional[str] = None) -> List[Dict[str, Any]]:
    events = copy.deepcopy(load("crashing"))
    if not with_exception:
        events = [e for e in events if "exception" not in e]
    for e in events:
        if "exception" in e and exc_type is not None:
            e["exception"]["type"] = exc_type
            e["exception"]["message"] = message or ""
        if "lifecycle" in e and e["lifecycle"]["phase"] == "EXIT":
            e["lifecycle"].update(exit_code=exit_code, signal=signal, reason="signal" if signal else "exit")
    return events


@pytest.mark.parametrize(("exit_code", "signal", "expected"), [
    (0, 0, None),
    (1, 0, ("process", "exception")),
    (134, 6, ("process", "exit")),  # the fixture is a CPU-only job (torch +cpu): no CUDA to blame
    (135, 0, ("process", "exit")),
    (137, 9, ("process", "killed")),
    (137, 0, ("process", "killed")),
    (143, 15, ("process", "terminated")),
    (255, 0, ("comm", "failure")),
    (139, 11, ("process", "exit")),
    (3, 0, ("process", "exit")),
])
def test_exit_code_decision_path(exit_code: int, signal: int, expected: Optional[Tuple[str, str]]) -> None:
    pipeline = run_all(_crash_stream(exit_code, signal, with_exception=False))
    (run,) = pipeline.runs()
    assert run.exit_codes == {"0": exit_code}
    if expected is None:
        assert pipeline.incidents() == [] and run.status == RUN_FINISHED
        return
    (incident,) = pipeline.incidents()
    assert (incident.category, incident.subtype) == expected
    assert incident.evidence[0].rule == "exit.code" and incident.evidence[0].value == exit_code
    # the kind's checks, those the run rules out last (a single CPU process: no NCCL, no GPU checks first)
    assert run.status == RUN_FAILED and sorted(incident.checks) == sorted(kind(*expected).checklist())
    if expected == ("process", "killed"):
        assert "OOM-killer" in incident.title and "preemption" in incident.title


@pytest.mark.parametrize("torch_build", ["2.13.0+cu128", None])
def test_an_abort_is_oom_or_a_cuda_error_only_where_cuda_may_be_in_use(torch_build: Optional[str]) -> None:
    """134 / SIGABRT: on a CPU-only job (the fixture's torch is a +cpu build) a plain abort that says what
    is known; with a CUDA build, or nothing said about the build, the usual 'OOM or a CUDA error'."""
    cpu = _crash_stream(134, 6, with_exception=False)
    (incident,) = run_all(cpu).incidents()
    assert (incident.category, incident.subtype) == ("process", "exit")
    assert "CUDA is not in use" in incident.summary and "SIGABRT" in incident.title
    events = copy.deepcopy(cpu)
    for e in events:
        if "lifecycle" in e and e["lifecycle"]["phase"] == "START":
            if torch_build is None:
                e["lifecycle"].pop("torch", None)
            else:
                e["lifecycle"]["torch"] = torch_build
    (incident,) = run_all(events).incidents()
    assert (incident.category, incident.subtype) == ("memory", "oom-or-cuda-error")


def test_checks_the_run_rules_out_go_last() -> None:
    """A single CPU process that reported no GradScaler: the kind's AMP, NCCL and GPU checks are kept but
    come after the ones that can apply (the run's signals may be incomplete, so nothing is dropped)."""
    (incident,) = run_all(_crash_stream(255, 0, with_exception=False)).incidents()
    spec = kind("comm", "failure").checklist()
    assert sorted(incident.checks) == sorted(spec) and incident.checks != spec
    moved = [c for c in incident.checks if "NCCL" in c or "GPU" in c or "nvidia-smi" in c]
    assert moved and incident.checks[-len(moved):] == moved


def test_a_kubernetes_oomkilled_reason_says_which_of_the_two_it_was() -> None:
    """137 alone: the OOM-killer or a preemption; the agent's EXIT with Kubernetes' reason says which."""
    events = _crash_stream(137, 9, with_exception=False)
    for e in events:
        if "lifecycle" in e and e["lifecycle"]["phase"] == "EXIT":
            e["lifecycle"]["reason"] = "OOMKilled"
    (incident,) = run_all(events).incidents()
    assert (incident.category, incident.subtype) == ("process", "killed")
    assert "reason OOMKilled" in incident.title
    assert "container's memory limit" in incident.summary and "not a preemption" in incident.summary
    assert "container's memory limit" in incident.evidence[0].description
    (plain,) = run_all(_crash_stream(137, 9, with_exception=False)).incidents()
    assert "or a preemption" in plain.summary and "memory limit" not in plain.summary


OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 256.00 GiB. GPU 0 has a total capacity of 139.80 GiB of "
               "which 102.12 GiB is free.")


@pytest.mark.parametrize(("exit_code", "signal", "exc_type", "message", "expected"), [
    (1, 0, None, None, ("process", "exception")),
    (1, 0, "torch.OutOfMemoryError", OOM_MESSAGE, ("memory", "oom")),
    (1, 0, "RuntimeError", OOM_MESSAGE, ("memory", "oom")),
    (134, 6, "torch.OutOfMemoryError", OOM_MESSAGE, ("memory", "oom")),
    (134, 6, None, None, ("memory", "oom-or-cuda-error")),  # the exit refines a generic exception
])
def test_exit_refined_by_the_exception_is_one_incident(exit_code: int, signal: int, exc_type: Optional[str],
                                                       message: Optional[str], expected: Tuple[str, str]) -> None:
    pipeline = run_all(_crash_stream(exit_code, signal, with_exception=True, exc_type=exc_type, message=message))
    (incident,) = pipeline.incidents()
    assert (incident.category, incident.subtype) == expected
    assert [e.rule for e in incident.evidence] == ["exception.uncaught", "exit.code"]
    assert incident.fingerprint and incident.count == 1


def test_killed_after_an_exception_is_a_separate_incident() -> None:
    (first, second) = run_all(_crash_stream(137, 9, with_exception=True)).incidents()
    assert {(first.category, first.subtype), (second.category, second.subtype)} == {
        ("process", "exception"), ("process", "killed")}


# ------------------------------------------------------------------------------------------------------
# Robustness and bounds


def test_malformed_envelopes_are_counted_and_skipped() -> None:
    events = load("crashing")
    bad: List[Any] = ["nope", {"run_id": "x"}, {"metrics": {}}, dict(events[1], step="abc"), None]
    pipeline = Pipeline(DEMO)
    pipeline.process(bad[:3] + events + bad[3:])
    assert pipeline.counters["malformed"] == len(bad)
    assert final(pipeline) == final(run_all(events))


def test_proto3_defaults_and_int64_strings() -> None:
    event = copy.deepcopy(of_kind(load("diverging"), "metrics")[-3])  # the loss alert
    for name in ("rank", "step", "world_size", "host", "pid", "severity"):
        event.pop(name, None)
    event["time_unix_nano"] = str(event["time_unix_nano"])
    pipeline = Pipeline(DEMO)
    pipeline.process([event])
    (run,) = pipeline.runs()
    assert run.ranks == [0] and run.world_size == 1 and run.last_event_ns == int(event["time_unix_nano"])


def test_handled_exceptions_count_in_clusters_but_open_no_incident() -> None:
    events = copy.deepcopy(load("crashing"))
    for e in of_kind(events, "exception"):
        e["exception"]["handled"] = True
    events = [e for e in events if e.get("lifecycle", {}).get("phase") != "EXIT"]
    pipeline = run_all(events)
    assert pipeline.incidents() == [] and pipeline.clusters()[0].count == 1
    strict = run_all(events, DetectionSettings.from_overrides({"incident_on_handled_exceptions": True}))
    assert [i.evidence[0].rule for i in strict.incidents()] == ["exception.handled"]


def test_exception_without_a_fingerprint_is_fingerprinted_by_the_pipeline() -> None:
    events = copy.deepcopy(load("crashing"))
    (exc,) = of_kind(events, "exception")
    sent = exc["exception"]["fingerprint"]
    for name in ("fingerprint", "fingerprint_version", "message_template", "hints"):
        exc["exception"].pop(name)
    (cluster,) = run_all(events).clusters()
    assert cluster.fingerprint == sent and cluster.fingerprint_version == "fp:v1"


def test_project_settings_apply_per_project() -> None:
    events = load("stalling")
    pipeline = Pipeline(DetectionSettings(), project_settings={"demo": DEMO})
    pipeline.process(events)
    assert [i.subtype for i in pipeline.incidents()] == ["stalled"]
    other = [dict(e, project="other") for e in events]
    pipeline.process(other)
    assert [i.project for i in pipeline.incidents()] == ["demo"]


def test_state_is_bounded_and_ended_runs_are_evicted() -> None:
    settings = DetectionSettings(stall_min_s=2.0, history_len=8, dedupe_ids_per_run=3, max_evidence=2,
                                 ended_run_ttl_s=60.0)
    events = load("crashing_2rank")
    pipeline = run_all(events, settings)
    state = pipeline.run_state("demo", events[0]["run_id"])
    assert state is not None and len(state.seen) == 3
    assert all(len(series) <= 2 * 8 for rank in state.ranks.values() for series in rank.history.values())
    (incident,) = pipeline.incidents()
    assert len(incident.evidence) == 2 and incident.evidence[0].rule == "exception.uncaught"
    assert pipeline.advance(last_time(events) + int(61e9)).is_empty()
    assert pipeline.runs() == [] and pipeline.counters["runs_evicted"] == 1
    assert pipeline.process(events).is_empty()  # late events of an evicted run start nothing
    assert pipeline.counters["late"] == len(events) and pipeline.runs() == []


def test_max_runs_evicts_ended_runs_first() -> None:
    healthy, stalling = load("healthy"), load("stalling")
    pipeline = Pipeline(DetectionSettings(max_runs=2, stall_min_s=2.0))
    pipeline.process(stalling + healthy)
    crashing = load("crashing")
    pipeline.process(crashing)
    assert {r.run_id for r in pipeline.runs()} == {stalling[0]["run_id"], crashing[0]["run_id"]}


def test_incident_records_round_trip() -> None:
    for incident in run_all(load("diverging")).incidents():
        assert Incident.from_dict(json.loads(json.dumps(incident.to_dict()))) == incident


@pytest.mark.parametrize("name", NAMES)
def test_the_protobuf_path_gives_the_same_records_as_the_json_path(name: str) -> None:
    """gRPC ingest turns envelopes into protobuf and back (defaults dropped, e.g. a recent value's step 0):
    the pipeline must decide the same either way."""
    wire = pytest.importorskip("trainguard.wire")
    events = load(name)
    through_proto = [wire.envelope_to_dict(wire.envelope_from_dict(e)) for e in events]
    assert final(run_all(through_proto)) == final(run_all(events))
    with_defaults = [wire.envelope_to_dict(wire.envelope_from_dict(e), include_defaults=True) for e in events]
    assert final(run_all(with_defaults)) == final(run_all(events))


def test_keyboard_interrupt_then_exit_130_is_one_terminated_incident() -> None:
    events = _crash_stream(130, 2, with_exception=True, exc_type="KeyboardInterrupt", message="")
    (incident,) = run_all(events).incidents()
    assert (incident.category, incident.subtype) == ("process", "terminated")
    assert [e.rule for e in incident.evidence] == ["exception.uncaught", "exit.code"]


def test_a_rank_that_never_reported_makes_an_exited_run_lost() -> None:
    events = [dict(e, world_size=2) for e in load("healthy")]
    pipeline = run_all(events)
    assert pipeline.runs()[0].status == RUN_RUNNING  # rank 1 of 2 never said anything
    (lost,) = pipeline.advance(last_time(events) + int((DEMO.lost_after_s + 1) * 1e9)).incidents
    assert "only 1 of 2 ranks ever reported" in lost.evidence[0].description
