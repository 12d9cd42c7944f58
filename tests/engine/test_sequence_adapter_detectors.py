"""sequence/truncation and adapter/lora-grad-break on the real fine-tuning streams (tests/scenarios/
trainings_finetune.py, recorded through the SDK's check_batch and watch_lora): each anomalous stream yields
exactly its kind, where the stream says it began, with its evidence; the healthy LoRA run (correct
collation, checked) and every other stream of the corpus and of tests/fixtures/streams yield nothing from
these detectors. Expected values are recomputed from the streams. Plus the streaming properties (replay,
snapshot/restore, small JSON state), overridable thresholds and edge cases derived from the real envelopes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from tests.scenarios import corpus
from trainguard.core.events import from_wire_float
from trainguard_engine import robust
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import adapter, sequence
from trainguard_engine.extract import batch_points, payload
from trainguard_engine.incidents import Finding
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident
from trainguard_engine.state import RunState

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "fixtures" / "streams").glob("*.jsonl"))
DEFAULTS = DetectionSettings()
Event = Dict[str, Any]
MINE = {("sequence", "truncation"), ("adapter", "lora-grad-break")}


def load(name: str) -> List[Event]:
    return corpus.BY_NAME[name].events()


def tuned(**overrides: Any) -> DetectionSettings:
    """DetectionSettings with ``overrides``; settings the class does not declare yet (the detectors read
    them with getattr and a module default) are added by a subclass."""
    known = {f.name for f in dataclasses.fields(DetectionSettings)}
    base = DetectionSettings.from_overrides({k: v for k, v in overrides.items() if k in known})
    extra = {k: v for k, v in overrides.items() if k not in known}
    if not extra:
        return base
    cls = dataclasses.make_dataclass(
        "Tuned", [(k, type(v), dataclasses.field(default=v)) for k, v in extra.items()],
        bases=(DetectionSettings,), frozen=True)
    return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DetectionSettings)})  # type: ignore[no-any-return]


def drive(events: Sequence[Event], settings: DetectionSettings = DEFAULTS) -> List[Finding]:
    """The two detectors alone, fed as the pipeline feeds them (the loss history kept as it keeps it)."""
    runs: Dict[str, RunState] = {}
    out: List[Finding] = []
    for raw in events:
        kind, body = payload(raw)
        if kind != "metrics":
            continue
        run = runs.setdefault(raw["run_id"], RunState(project=raw.get("project", ""), run_id=raw["run_id"]))
        rank = run.rank_state(int(raw.get("rank", 0)), settings)
        assert rank is not None
        step, t, eid = int(raw.get("step", 0)), int(raw["time_unix_nano"]), raw.get("event_id", "")
        points = batch_points(body, step)
        for name, s, v in points:
            if settings.keeps_history(name):
                rank.observe_point(name, s, v, t, settings)
        out.extend(sequence.on_metrics(run, rank, points, step, t, eid, settings))
        out.extend(adapter.on_metrics(run, rank, points, step, t, eid, settings))
    return out


def run(events: Sequence[Event], settings: DetectionSettings = DEFAULTS) -> Pipeline:
    pipeline = Pipeline(settings)
    pipeline.process(events)
    return pipeline


def kinds(incidents: Sequence[Incident]) -> List[Tuple[str, str]]:
    return [(i.category, i.subtype) for i in incidents]


def checks(events: Sequence[Event], prefix: str) -> List[Tuple[int, Dict[str, float]]]:
    """(step, {name: value}) of every metric batch holding ``prefix`` metrics, in stream order."""
    out = []
    for e in events:
        pts = {p["name"]: from_wire_float(p["value"]) for p in e.get("metrics", {}).get("points", [])
               if p["name"].startswith(prefix)}
        if pts:
            out.append((int(e["step"]), pts))
    return out


def loss_series(events: Sequence[Event]) -> Dict[int, float]:
    out = {}
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] == "loss":
                out[int(e["step"])] = from_wire_float(p["value"])
    return out


def recorded(scenario: corpus.Scenario) -> bool:
    return all(path.exists() for path in scenario.stream_files()) and bool(scenario.stream_files())


# ------------------------------------------------------------------------------------------------------
# sequence/truncation on its scenario


def test_truncation_stream_is_exactly_sequence_truncation_from_the_first_check() -> None:
    events = load("truncation")
    (incident,) = run(events).incidents()
    assert (incident.category, incident.subtype) == ("sequence", "truncation")
    seq = checks(events, "seq/")
    assert len(seq) == 40  # check_batch(every=2) over 80 steps
    # the bug shows on every check: pads attended, mask disagreeing, loss on padding, from the first check
    first_pad = next(s for s, v in seq if v["seq/pad_attended_frac"] > 0)
    assert incident.first_step == first_pad == seq[0][0] == 0
    rules = {e.rule: e for e in incident.evidence}
    assert set(rules) == {"sequence.truncation.pad_attended", "sequence.truncation.mask_mismatch",
                          "sequence.truncation.labels_on_pad", "sequence.truncation.eos_cut"}
    confirm = sequence.SEQ_CONFIRM_CHECKS
    pad = rules["sequence.truncation.pad_attended"]
    assert pad.threshold == 0.0 and pad.step == 0 and pad.metric == "seq/pad_attended_frac"
    first_three = [v["seq/pad_attended_frac"] for _s, v in seq[:confirm]]
    assert pad.value == pytest.approx(first_three[-1]) and [w["value"] for w in pad.window] == first_three
    share = statistics.median(first_three)
    assert f"padding attended ({share:.0%} of sequences)" in incident.title
    assert incident.title.startswith("Truncation without a consistent attention mask (")
    # EOS cut off: the first check with a cut row; its value is the window's mean share, >= 0.05
    eos = rules["sequence.truncation.eos_cut"]
    first_cut = next(s for s, v in seq if v["seq/truncated_frac"] > 0)
    assert eos.step == first_cut == 2 and eos.threshold == sequence.SEQ_EOS_CUT_MIN_FRAC
    assert float(eos.value) >= 0.05 and eos.window
    # the rows that were not cut all end in EOS (the data appends one): eos_missing == truncated everywhere
    assert all(v["seq/eos_missing_frac"] == v["seq/truncated_frac"] for _s, v in seq)
    assert "EOS cut off" in incident.title and incident.severity == "warning"
    assert incident.count == 1  # opened once; the EOS rule joined it without a new count


def test_healthy_lora_checks_are_clean_and_give_nothing() -> None:
    events = load("healthy_lora")
    seq = checks(events, "seq/")
    assert len(seq) == 20 and all(v == 0.0 for _s, vals in seq for v in vals.values())
    lora = checks(events, "lora/")
    # the adapters learn throughout (A's gradient is exactly 0 only at step 0, while B is still 0)
    assert lora[0][1]["lora/grad_mean_A"] == 0.0 and lora[0][1]["lora/grad_mean_B"] > 1e-4
    assert all(v["lora/grad_mean_A"] > 1e-5 and v["lora/no_grad_params"] == 0 for _s, v in lora[1:])
    assert run(events).incidents() == []
    assert drive(events) == []


# ------------------------------------------------------------------------------------------------------
# adapter/lora-grad-break on its scenario


def test_lora_break_stream_is_exactly_lora_grad_break_since_the_checkpointing_switch() -> None:
    events = load("lora_break")
    (incident,) = run(events).incidents()
    assert (incident.category, incident.subtype) == ("adapter", "lora-grad-break")
    lora = checks(events, "lora/")
    # where it began, read from the stream: the first report of the final run of broken reports
    broken = [v["lora/no_grad_params"] > 0 or max(v["lora/grad_mean_A"], v["lora/grad_mean_B"]) < 1e-6
              for _s, v in lora]
    start = max(i for i in range(len(broken)) if i == 0 or not broken[i - 1])
    assert all(broken[start:]) and lora[start][0] == 24
    assert incident.first_step == lora[start][0] == 24
    assert incident.title == "LoRA adapters not learning since step 24"
    # before the switch the adapters learned
    assert all(v["lora/grad_mean_B"] > 1e-4 for s, v in lora if s < 24)
    rules = {e.rule: e for e in incident.evidence}
    assert set(rules) == {"adapter.lora_grad_break.grad_mean", "adapter.lora_grad_break.no_grad",
                          "adapter.lora_grad_break.loss_moves"}
    grad = rules["adapter.lora_grad_break.grad_mean"]
    assert grad.threshold == 1e-6 and grad.value == 0.0 and grad.step == 24 and grad.window
    no_grad = rules["adapter.lora_grad_break.no_grad"]
    assert no_grad.value == lora[-1][1]["lora/params"] == 12.0 and no_grad.threshold == 0.0
    moves = rules["adapter.lora_grad_break.loss_moves"]
    assert moves.threshold == DEFAULTS.trend_z and float(moves.value) <= -DEFAULTS.trend_z  # falling
    loss = loss_series(events)
    window = [w["value"] for w in moves.window]
    steps = [w["step"] for w in moves.window]
    assert steps[0] == 24 and window == [loss[s] for s in steps]
    assert robust.mann_kendall(window).z == pytest.approx(float(moves.value), abs=1e-4)
    # the loss really kept falling after the adapters were cut off (the head learns): compare the ends
    after = [loss[s] for s in sorted(loss) if s >= 24]
    assert statistics.median(after[-10:]) < statistics.median(after[:10]) - 0.2
    # it needed lora_confirm_reports reports and lora_loss_min_points losses: seen by step 34 at the latest
    assert 24 + 2 * (adapter.LORA_CONFIRM_REPORTS - 1) <= incident.last_step <= 40


# ------------------------------------------------------------------------------------------------------
# no false alarms anywhere else


@pytest.mark.parametrize("scenario", corpus.SCENARIOS, ids=lambda s: s.name)
def test_no_other_stream_of_the_corpus_triggers_these_detectors(scenario: corpus.Scenario) -> None:
    if not recorded(scenario):
        pytest.skip(f"{scenario.name}: stream not recorded here")
    found = {(f.category, f.subtype) for f in drive(scenario.events())}
    expected = {scenario.expected} & MINE if scenario.expected else set()
    assert found == expected, scenario.name


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_the_fixture_streams_trigger_nothing(path: Path) -> None:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert drive(events) == []


@pytest.mark.parametrize("name", ["truncation", "lora_break", "healthy_lora"])
def test_the_fine_tuning_streams_yield_exactly_their_expected_kind_in_the_pipeline(name: str) -> None:
    expected = corpus.BY_NAME[name].expected
    assert kinds(run(load(name)).incidents()) == ([expected] if expected else [])


# ------------------------------------------------------------------------------------------------------
# streaming properties


@pytest.mark.parametrize("name", ["truncation", "lora_break", "healthy_lora"])
def test_replay_changes_nothing(name: str) -> None:
    events = load(name)
    pipeline = run(events)
    before = pipeline.incidents()
    assert pipeline.process(events).is_empty()
    assert pipeline.incidents() == before
    assert len(drive(list(events) + list(events))) == len(drive(events))


@pytest.mark.parametrize("name", ["truncation", "lora_break"])
def test_snapshot_restore_mid_stream_gives_the_same_incidents(name: str) -> None:
    events = load(name)
    straight = run(events)
    for cut in (len(events) // 10, len(events) // 3, len(events) // 2, 2 * len(events) // 3):
        first = run(events[:cut])
        resumed = Pipeline.restore(first.snapshot(), DEFAULTS)
        resumed.process(events[cut:])
        assert resumed.incidents() == straight.incidents(), cut


@pytest.mark.parametrize("name", ["truncation", "lora_break", "healthy_lora"])
def test_detector_state_is_small_and_json(name: str) -> None:
    events = load(name)
    state = run(events).run_state(events[0]["project"], events[0]["run_id"])
    assert state is not None
    for rank in state.ranks.values():
        for key in (sequence.STATE_KEY, adapter.STATE_KEY):
            blob = json.dumps(rank.detectors.get(key, {}), allow_nan=False)
            assert len(blob) < 4096, (key, len(blob))
    seq_state = state.ranks[0].detectors.get(sequence.STATE_KEY, {})
    assert len(seq_state.get("checks", [])) <= sequence.SEQ_WINDOW_CHECKS


def test_two_ranks_merge_into_one_incident_listing_both() -> None:
    events = load("lora_break")
    twin = [dict(e, rank=1, event_id=e["event_id"] + "-r1", host="other") for e in events]
    (incident,) = run(sorted(events + twin, key=lambda e: int(e["time_unix_nano"]))).incidents()
    assert incident.ranks == [0, 1] and incident.lead_rank == 0 and incident.first_step == 24


# ------------------------------------------------------------------------------------------------------
# thresholds are overridable settings


def test_sequence_thresholds_are_overridable() -> None:
    events = load("truncation")
    assert drive(events, tuned(seq_window_checks=200, seq_confirm_checks=100)) == []
    no_eos = drive(events, tuned(seq_eos_cut_min_frac=0.5))
    assert no_eos and all("sequence.truncation.eos_cut" not in {e.rule for e in f.evidence} for f in no_eos)
    tolerant = drive(events, tuned(seq_pad_attended_max=1.0, seq_mask_mismatch_max=1.0,
                                   seq_labels_on_pad_max=1.0))
    assert tolerant and {e.rule for f in tolerant for e in f.evidence} == {"sequence.truncation.eos_cut"}
    assert drive(events, tuned(seq_pad_attended_max=1.0, seq_mask_mismatch_max=1.0,
                               seq_labels_on_pad_max=1.0, seq_eos_cut_min_frac=1.0)) == []


def test_adapter_thresholds_are_overridable() -> None:
    events = load("lora_break")
    assert drive(events, tuned(lora_confirm_reports=100)) == []
    assert drive(events, tuned(lora_loss_min_points=1000)) == []
    assert drive(events, tuned(trend_z=50.0, lora_loss_window=10_000)) == []
    later = drive(events, tuned(lora_confirm_reports=12))
    assert later and later[0].step == 24 and later[0].seen_step >= 24 + 2 * 11


def test_the_grad_threshold_decides_for_tiny_but_present_gradients() -> None:
    """The healthy run's adapter gradients scaled by 1e-4 (~1e-7 .. 3e-7): below the DESIGN's 1e-6, so
    the adapters count as not learning; with lora_grad_min=1e-8 they do learn."""
    events = copy.deepcopy(load("healthy_lora"))
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] in ("lora/grad_mean_A", "lora/grad_mean_B"):
                p["value"] = p["value"] * 1e-4
    found = drive(events)
    assert [(f.category, f.subtype) for f in found] == [("adapter", "lora-grad-break")]
    assert found[0].step == 0  # step 0 (A == 0 exactly: B starts at 0) already starts the streak
    assert {e.rule for e in found[0].evidence} >= {"adapter.lora_grad_break.grad_mean"}
    assert drive(events, tuned(lora_grad_min=1e-8)) == []


# ------------------------------------------------------------------------------------------------------
# edge cases built from the real envelopes


def test_dead_adapters_with_a_flat_loss_are_the_adapter_incident_after_a_full_loss_window() -> None:
    """lora_break with its loss values after the switch shuffled (seeded): the same level and noise, no
    movement -- no window the detector looks at shows a trend. Every adapter is without gradient on every
    report, so once a full lora_loss_window of flat values has passed since the streak began this is the
    adapters' doing (nothing else learns), not a plateau: one lora-grad-break saying the loss is flat."""
    events = copy.deepcopy(load("lora_break"))
    loss = loss_series(events)
    after = sorted(s for s in loss if s >= 24)
    values = [loss[s] for s in after]
    random.Random(7).shuffle(values)
    flat = dict(zip(after, values))
    for end in range(8, len(after) + 1):  # every window from the switch that the detector may judge
        window = values[:end][-adapter.LORA_LOSS_WINDOW:]
        assert abs(robust.mann_kendall(window).z) < DEFAULTS.trend_z, end
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] == "loss" and int(e["step"]) in flat:
                p["value"] = flat[int(e["step"])]
    (found,) = drive(events)
    assert (found.category, found.subtype, found.step) == ("adapter", "lora-grad-break", 24)
    # not before a full window of flat values (seen_step: the last watch_lora report, every 2 steps)
    assert found.seen_step >= after[adapter.LORA_LOSS_WINDOW - 1] - 2
    moves = next(e for e in found.evidence if e.rule == "adapter.lora_grad_break.loss_moves")
    assert abs(moves.value) < DEFAULTS.trend_z and "does not move" in moves.description
    assert "the loss is flat" in found.summary
    assert drive(events, tuned(lora_loss_window=10_000)) == []  # never a full window: no verdict


def test_packed_rows_without_eos_are_not_eos_cut_off() -> None:
    """Every row at the cap and none ending in EOS (packed pretraining chunks): not a truncation defect."""
    events = copy.deepcopy(load("healthy_lora"))
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] in ("seq/truncated_frac", "seq/eos_missing_frac"):
                p["value"] = 1.0
    assert drive(events) == []
    for e in events:  # ... while the same cut with the other rows ending in EOS is
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] in ("seq/truncated_frac", "seq/eos_missing_frac"):
                p["value"] = 0.25
    found = drive(events)
    assert len(found) == 1 and {e.rule for e in found[0].evidence} == {"sequence.truncation.eos_cut"}
    assert found[0].step == 0 and "EOS cut off (25% of sequences)" in str(found[0].values["detail"])


def test_one_odd_batch_is_not_a_defect() -> None:
    events = copy.deepcopy(load("healthy_lora"))
    odd = [e for e in events if any(p["name"] == "seq/pad_attended_frac"
                                    for p in e.get("metrics", {}).get("points", []))][5]
    for p in odd["metrics"]["points"]:
        if p["name"] in ("seq/pad_attended_frac", "seq/mask_mismatch_frac"):
            p["value"] = 0.0625
    assert drive(events) == []


def test_non_finite_and_foreign_values_are_ignored() -> None:
    events = copy.deepcopy(load("truncation"))
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"].startswith("seq/"):
                p["value"] = "NaN"
    assert drive(events) == []


def first(findings: Sequence[Finding], category: str) -> Optional[Finding]:
    return next((f for f in findings if f.category == category), None)


def test_the_finding_is_where_the_condition_began_not_where_it_was_confirmed() -> None:
    seq = first(drive(load("truncation")), "sequence")
    assert seq is not None and seq.step == 0 and seq.seen_step == 2 * (sequence.SEQ_CONFIRM_CHECKS - 1)
    lora = first(drive(load("lora_break")), "adapter")
    assert lora is not None and lora.step == 24 and lora.seen_step > lora.step
    assert math.isfinite(float(lora.values["step"]))
