"""The loss-curve and gradient detectors on the scenario corpus (tests/scenarios/streams): real, seeded CPU
trainings recorded through the SDK. Each anomalous scenario must yield exactly its own kind, where the data
says it began; the healthy runs (and the older healthy fixture) nothing. Expected values are recomputed
from the streams themselves, independently of the detectors. Plus the robust-statistics helpers, the
detectors' streaming properties (replay, snapshot, bounds) and edge cases built from the real envelopes."""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from trainguard.core.events import from_wire_float
from trainguard_engine import robust
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.gradient import STATE_KEY, layer_ratio
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios" / "streams"
FIXTURES = ROOT / "fixtures" / "streams"
HEALTHY = ("healthy_mlp", "healthy_lm", "healthy_cnn")
EXPECTED = {
    "oscillation": ("loss", "oscillation"),
    "rise_after_fall": ("loss", "rise-after-fall"),
    "plateau": ("loss", "plateau"),
    "explosion": ("gradient", "explosion"),
    "vanishing": ("gradient", "vanishing"),
    "clip_stale": ("gradient", "clip-stale"),
    "nan_source": ("gradient", "nan-source"),
}
SETTINGS = DetectionSettings()
TUNED = SETTINGS

Event = Dict[str, Any]


def load(name: str, folder: Path = SCENARIOS) -> List[Event]:
    with open(folder / f"{name}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run(events: Sequence[Event], settings: DetectionSettings = SETTINGS) -> Pipeline:
    pipeline = Pipeline(settings)
    pipeline.process(events)
    return pipeline


def series(events: Sequence[Event], name: str) -> Dict[int, float]:
    """step -> value of ``name`` in the stream (the point's own step, else the envelope's)."""
    out: Dict[int, float] = {}
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] == name:
                out[int(p.get("step") or e["step"])] = from_wire_float(p["value"])
    return out


def layer_reports(events: Sequence[Event]) -> List[Tuple[int, List[Tuple[str, float]]]]:
    """(step, [(layer, norm), ...]) of every per-layer batch, in the order the SDK sent the layers."""
    out = []
    for e in events:
        points = [(p["name"], from_wire_float(p["value"])) for p in e.get("metrics", {}).get("points", [])
                  if p["name"].startswith("grad/layer/")]
        if points:
            out.append((int(e["step"]), points))
    return out


def first_nonfinite(values: Dict[int, float]) -> Optional[int]:
    return min((s for s, v in values.items() if not math.isfinite(v)), default=None)


def kinds(incidents: Sequence[Incident]) -> List[Tuple[str, str]]:
    return [(i.category, i.subtype) for i in incidents]


def only(name: str) -> Incident:
    (incident,) = run(load(name)).incidents()
    return incident


# ------------------------------------------------------------------------------------------------------
# the corpus as a whole: a confusion table, exactly one right kind per anomaly, nothing on healthy runs


SHORT = {"loss/oscillation": "osc", "loss/rise-after-fall": "rise", "loss/plateau": "plat",
         "gradient/explosion": "expl", "gradient/vanishing": "van", "gradient/clip-stale": "clip",
         "gradient/nan-source": "nan"}


def test_confusion_table_every_scenario_yields_exactly_its_own_kind(capsys: pytest.CaptureFixture[str]) -> None:
    table: Dict[str, Counter[str]] = {}
    for name in (*HEALTHY, *EXPECTED):
        found = kinds(run(load(name)).incidents())
        table[name] = Counter(f"{c}/{s}" for c, s in found)
    columns = [*SHORT, "other"]
    lines = ["", "scenario (expected)               " + " ".join(SHORT.get(c, c).rjust(5) for c in columns)
             + "  none"]
    for name, row in table.items():
        expected = "/".join(EXPECTED[name]) if name in EXPECTED else "-"
        other = sum(n for k, n in row.items() if k not in SHORT)
        cells = [str(row.get(c, "") or "").rjust(5) for c in SHORT] + [str(other or "").rjust(5)]
        lines.append(f"{name:<16} {expected:<17}" + " ".join(cells) + ("     1" if not row else ""))
    with capsys.disabled():
        print("\n".join(lines))
    for name in HEALTHY:
        assert not table[name], name
    for name, (category, subtype) in EXPECTED.items():
        assert table[name] == Counter({f"{category}/{subtype}": 1}), name


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scenarios_have_noise_warmup_and_no_incident(name: str) -> None:
    events = load(name)
    loss = series(events, "loss")
    values = [loss[s] for s in sorted(loss)]
    assert all(math.isfinite(v) for v in values)
    # really trained: the last values are well below the first ones, with minibatch noise throughout
    assert statistics.median(values[-20:]) < 0.85 * statistics.median(values[:5])
    assert robust.robust_cv([b - a for a, b in zip(values[-40:], values[-39:])]) > 0
    lr = series(events, "lr")
    assert lr[0] < max(lr.values())  # a warmup
    assert run(events).incidents() == []


@pytest.mark.parametrize("name", ("healthy", "stalling", "crashing"))
def test_older_fixtures_get_no_loss_or_gradient_incident(name: str) -> None:
    found = kinds(run(load(name, FIXTURES)).incidents())
    assert not [k for k in found if k[0] in ("loss", "gradient")]


def test_the_diverging_fixture_is_still_one_explosion_judged_at_the_nan() -> None:
    """x3 LR per step: the norm jumps for two steps only; the sustained-climb rule does not fire before
    the NaN, the NaN-time rule classifies it (what test_pipeline asserts in detail), starting where the
    climb began."""
    events = load("diverging", FIXTURES)
    (incident,) = run(events).incidents()
    assert kinds([incident]) == [("gradient", "explosion")]
    onset = next(e.step for e in incident.evidence if e.rule == "gradient.norm_climb")
    assert incident.first_step == onset < first_nonfinite(series(events, "loss"))  # type: ignore[operator]


# ------------------------------------------------------------------------------------------------------
# each detector on its scenario, against what the stream itself says


def test_explosion_is_flagged_at_least_10_steps_before_the_first_nan() -> None:
    events = load("explosion")
    loss, grads = series(events, "loss"), series(events, "grad/global_norm")
    nan_step = first_nonfinite(loss)
    assert nan_step is not None
    flagged_at = None
    pipeline = Pipeline(SETTINGS)
    for event in events:  # streaming: when did the incident first come out?
        if pipeline.process([event]).incidents and flagged_at is None:
            flagged_at = int(event["step"])
    assert flagged_at is not None and flagged_at <= nan_step - 10, (flagged_at, nan_step)
    (incident,) = pipeline.incidents()
    assert kinds([incident]) == [("gradient", "explosion")] and incident.severity == "error"
    assert incident.first_step <= nan_step - 10 and incident.last_step == nan_step
    # first_step: where the norm rose above 2x its running median and stayed there
    before = [grads[s] for s in sorted(grads) if incident.first_step - 50 <= s < incident.first_step]
    baseline = statistics.median(before[: max(1, len(before) // 2)])
    climb = [grads[s] for s in sorted(grads) if incident.first_step <= s < flagged_at]
    assert climb and min(climb) >= 1.5 * baseline
    rules = {e.rule: e for e in incident.evidence}
    evidence = rules["gradient.norm_climb"]
    assert evidence.threshold == SETTINGS.explosion_jump_factor and evidence.value >= evidence.threshold
    assert all(from_wire_float(w["value"]) == pytest.approx(grads[w["step"]]) for w in evidence.window)
    assert rules["loss.non_finite"].step == nan_step  # the NaN joined the incident opened before it
    shown = "NaN" if math.isnan(loss[nan_step]) else "Infinity"
    assert incident.title.endswith(f"loss became {shown} at step {nan_step}")  # the values of the NaN
    assert "still finite" in incident.summary and "the LR went from" in incident.summary


def test_nan_source_names_the_first_non_finite_step_and_every_layer_without_a_climb() -> None:
    events = load("nan_source")
    incident = only("nan_source")
    all_points = {**series(events, "loss"), **series(events, "grad/global_norm")}
    first_bad = min(s for e in events for p in e.get("metrics", {}).get("points", [])
                    for s in [int(p.get("step") or e["step"])] if not math.isfinite(from_wire_float(p["value"])))
    assert incident.first_step == first_bad == first_nonfinite(all_points)
    # no climb before it: the norm stayed within a few times its median
    grads = series(events, "grad/global_norm")
    before = [v for s, v in grads.items() if s < first_bad]
    assert max(before) < SETTINGS.explosion_jump_factor * statistics.median(before)
    layers = next(ls for s, ls in layer_reports(events) if s == first_bad)
    assert all(not math.isfinite(v) for _n, v in layers)
    assert f"every layer at once ({len(layers)} of {len(layers)})" in incident.title
    assert f"at step {first_bad}" in incident.title
    rules = [e.rule for e in incident.evidence]
    assert rules[:2] == ["gradient.non_finite", "loss.non_finite"]
    assert "no climb" in incident.summary


def test_vanishing_starts_at_the_first_per_layer_report_and_the_ratio_is_the_streams() -> None:
    events = load("vanishing")
    incident = only("vanishing")
    reports = layer_reports(events)
    assert len(reports[0][1]) == 20 and incident.first_step == reports[0][0]
    (evidence,) = incident.evidence
    assert evidence.rule == "gradient.layer_ratio" and evidence.threshold == 1000
    for item in evidence.window:
        norms = [v for _n, v in dict(reports)[item["step"]]]
        k = len(norms) // 3
        ratio = math.sqrt(sum(v * v for v in norms[-k:])) / math.sqrt(sum(v * v for v in norms[:k]))
        assert from_wire_float(item["value"]) == pytest.approx(ratio) and ratio >= 1000


def test_clip_stale_starts_where_clipping_became_permanent_and_recommends_a_threshold() -> None:
    events = load("clip_stale")
    incident = only("clip_stale")
    flags = series(events, "grad/clip_triggered")
    steps = sorted(flags)
    streak_start = steps[0]
    for s in steps:
        if flags[s] < 0.5:
            streak_start = steps[steps.index(s) + 1]
    assert incident.first_step == streak_start
    rules = {e.rule: e for e in incident.evidence}
    assert set(rules) == {"gradient.clip_pinned", "loss.curvature", "gradient.clip_recommendation"}
    rec = rules["gradient.clip_recommendation"]
    assert rec.value == pytest.approx(1 + 0.05 * TUNED.confirm_checks)  # tau (1 + 0.05 stale_count)
    assert "min(1.2 tau, 10)" in rec.description
    # the SDK reports the threshold it was given (watch(clip=0.01)): the rule and advice use it
    assert set(series(events, "grad/clip_threshold").values()) == {0.01}
    assert "tau = 0.01" in rules["gradient.clip_pinned"].description
    assert f"= {0.01 * (1 + 0.05 * TUNED.confirm_checks):.3g}" in rec.description
    grads = series(events, "grad/global_norm")
    assert statistics.median(grads.values()) > TUNED.clip_stale_min_ratio * 0.01  # cut by > 10x: starved


def test_without_the_threshold_a_clipped_run_whose_loss_fell_is_not_clip_stale() -> None:
    """The clip_stale run with its grad/clip_threshold points dropped (an SDK or logger that does not
    report tau): every step is still clipped, but the loss fell by a third, and without tau nothing says
    by how much clipping cut the updates -- no verdict rather than advice to raise a threshold."""
    events = _drop_points(load("clip_stale"), lambda p: p["name"] == "grad/clip_threshold")
    assert ("gradient", "clip-stale") not in kinds(run(events).incidents())


def test_plateau_is_flat_from_the_start_and_blames_the_dead_layer() -> None:
    events = load("plateau")
    incident = only("plateau")
    loss = series(events, "loss")
    values = [loss[s] for s in sorted(loss)]
    assert incident.first_step <= 10
    assert abs(robust.mann_kendall(values).z) < TUNED.trend_z  # the whole run: no trend
    dead = [n[len("grad/layer/"):] for n, v in layer_reports(events)[0][1] if v == 0.0]
    assert dead and "Optimisation, not capacity" in incident.summary
    assert f"({', '.join(dead)})" in incident.summary
    stats = next(e for e in incident.evidence if e.rule == "gradient.plateau_stats")
    assert "verdict: optimisation" in stats.description


def test_rise_after_fall_turns_where_the_smoothed_loss_is_lowest() -> None:
    events = load("rise_after_fall")
    incident = only("rise_after_fall")
    loss = series(events, "loss")
    steps = sorted(loss)
    smooth = robust.rolling_median([loss[s] for s in steps], 5)
    # the lowest smoothed level before the rebound that the incident reports
    upto = steps.index(incident.first_step) + 10
    turn = steps[min(range(min(upto, len(smooth))), key=lambda i: smooth[i]) + 2]
    assert abs(incident.first_step - turn) <= 2
    assert statistics.median(loss[s] for s in steps[-20:]) > 2 * min(smooth)
    (evidence,) = incident.evidence
    assert evidence.rule == "loss.rise_after_fall" and evidence.value >= TUNED.rise_min_rise


def test_oscillation_swings_at_a_high_level_without_trend() -> None:
    events = load("oscillation")
    incident = only("oscillation")
    loss = series(events, "loss")
    values = [loss[s] for s in sorted(loss)]
    assert incident.first_step <= 10
    assert robust.robust_cv(values) >= TUNED.oscillation_min_cv
    assert statistics.median(values) > values[0]
    assert abs(robust.mann_kendall(values[10:]).z) < TUNED.trend_z
    (evidence,) = incident.evidence
    assert evidence.rule == "loss.oscillation" and evidence.value >= evidence.threshold


# ------------------------------------------------------------------------------------------------------
# streaming properties


@pytest.mark.parametrize("name", (*HEALTHY, *EXPECTED))
def test_replaying_a_scenario_changes_nothing(name: str) -> None:
    events = load(name)
    pipeline = run(events)
    before = pipeline.incidents()
    assert pipeline.process(events).is_empty()
    assert pipeline.incidents() == before


@pytest.mark.parametrize("name", tuple(EXPECTED))
def test_snapshot_restore_mid_stream_gives_the_same_incidents(name: str) -> None:
    events = load(name)
    straight = run(events)
    for cut in (len(events) // 3, 2 * len(events) // 3):
        first = run(events[:cut])
        resumed = Pipeline.restore(first.snapshot(), SETTINGS)
        resumed.process(events[cut:])
        assert resumed.incidents() == straight.incidents()


@pytest.mark.parametrize("name", (*HEALTHY, *EXPECTED))
def test_detector_state_is_small_and_json(name: str) -> None:
    events = load(name)
    state = run(events).run_state(events[0]["project"], events[0]["run_id"])
    assert state is not None
    for rank in state.ranks.values():
        blob = json.dumps(rank.detectors.get(STATE_KEY, {}), allow_nan=False)
        assert len(blob) < 4096, len(blob)


def test_two_ranks_merge_into_one_incident_listing_both() -> None:
    events = load("vanishing")
    twin = [dict(e, rank=1, event_id=e["event_id"] + "-r1", host="other") for e in events]
    (incident,) = run(sorted(events + twin, key=lambda e: int(e["time_unix_nano"]))).incidents()
    assert incident.ranks == [0, 1] and incident.lead_rank == 0 and set(incident.hosts) == {"vm", "other"}


def test_the_protobuf_path_decides_the_same() -> None:
    wire = pytest.importorskip("trainguard.wire")
    for name in ("explosion", "nan_source", "clip_stale"):
        events = load(name)
        through = [wire.envelope_to_dict(wire.envelope_from_dict(e)) for e in events]
        assert run(through).incidents() == run(events).incidents()


# ------------------------------------------------------------------------------------------------------
# edge cases built from the real envelopes


def _drop_points(events: Sequence[Event], drop: Any) -> List[Event]:
    out = []
    for e in events:
        if "metrics" in e:
            e = copy.deepcopy(e)
            e["metrics"]["points"] = [p for p in e["metrics"]["points"] if not drop(p)]
            e["metrics"].pop("recent", None)
            if not e["metrics"]["points"]:
                continue
        out.append(e)
    return out


def test_a_rise_after_fall_escalates_in_place_when_the_loss_goes_non_finite() -> None:
    """Without gradient metrics the explosion run is first a loss that turned and left its band (a rise
    after a fall, or already a divergence); at the NaN the same incident (same id, same first step)
    becomes the non-finite loss."""
    events = _drop_points(load("explosion"), lambda p: p["name"].startswith("grad/"))
    pipeline = Pipeline(SETTINGS)
    opened: Optional[Incident] = None
    for event in events:
        for incident in pipeline.process([event]).incidents:
            opened = opened or incident
    (final,) = pipeline.incidents()
    assert opened is not None and kinds([opened])[0] in (("loss", "rise-after-fall"), ("loss", "divergence"))
    assert kinds([final]) == [("loss", "non_finite")] and final.incident_id == opened.incident_id
    assert final.first_step == opened.first_step < first_nonfinite(series(events, "loss"))  # type: ignore[operator]
    rules = [e.rule for e in final.evidence]
    assert rules[-1] == "loss.non_finite" and set(rules[:-1]) <= {"loss.rise_after_fall", "loss.divergence"}
    assert rules[0] == {"rise-after-fall": "loss.rise_after_fall", "divergence": "loss.divergence"}[opened.subtype]


def test_a_non_finite_gradient_with_a_finite_loss_is_a_nan_source() -> None:
    """A loop that skips logging non-finite losses: the gradient alone tells where the NaN came from."""
    events = _drop_points(load("nan_source"),
                          lambda p: p["name"] == "loss" and not math.isfinite(from_wire_float(p["value"])))
    (incident,) = run(events).incidents()
    assert kinds([incident]) == [("gradient", "nan-source")]
    assert incident.first_step == first_nonfinite(series(events, "grad/global_norm"))
    assert "no non-finite loss was reported" in incident.summary


def test_without_per_layer_norms_the_nan_source_names_the_global_norm() -> None:
    events = _drop_points(load("nan_source"), lambda p: p["name"].startswith("grad/layer/"))
    incident = run(events).incidents()[0]
    assert kinds([incident]) == [("gradient", "nan-source")]
    assert "grad/global_norm" in incident.title and "watch(every=...)" in incident.summary


def test_loss_gradient_thresholds_are_overridable_detection_settings() -> None:
    strict = DetectionSettings.from_overrides({"vanishing_ratio": 1e15})
    assert strict.vanishing_ratio == 1e15
    assert run(load("vanishing"), strict).incidents() == []  # the scenario's ratio is ~1e12
    with pytest.raises(ValueError):
        DetectionSettings.from_overrides({"trend_z": -1})  # validated like every other threshold
    docs = {n: doc for n, _d, doc in DetectionSettings.documentation()}
    for name in ("trend_z", "oscillation_min_cv", "rise_min_fall", "plateau_small_grad", "vanishing_ratio",
                 "clip_stale_norm_ratio", "clip_stale_curvature", "explosion_sustain"):
        assert docs[name]


# ------------------------------------------------------------------------------------------------------
# robust statistics


def test_median_mad_and_robust_cv_ignore_an_outlier() -> None:
    values = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1000.0]
    assert robust.median(values) == 1.0
    assert robust.mad(values) == pytest.approx(0.05)
    assert robust.robust_cv(values) == pytest.approx(1.4826 * 0.05)
    assert robust.robust_cv([2.0, 2.0, 2.0]) == 0.0 and robust.robust_cv([0.0, 1.0, -1.0, 2.0, -2.0]) == math.inf
    assert robust.robust_z(1.2, 1.0, 0.1) == pytest.approx(0.2 / 0.14826)
    assert math.isnan(robust.median([]))


def test_mann_kendall_is_scale_free_and_handles_ties() -> None:
    rising = [float(i) for i in range(10)]
    mk = robust.mann_kendall(rising)
    assert mk.s == 45 and mk.tau == 1.0 and mk.z > 3
    assert robust.mann_kendall([v * 1e-9 for v in rising]) == mk
    assert robust.mann_kendall([v ** 3 + 5 for v in rising]).z == mk.z  # any monotone transform
    assert robust.mann_kendall(rising[::-1]).z == -mk.z
    flat = robust.mann_kendall([1.0] * 10)
    assert flat.s == 0 and flat.z == 0.0
    assert robust.mann_kendall([1.0, 2.0]).z == 0.0
    # the tie correction shrinks the variance: more significance than without it
    tied = robust.mann_kendall([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0])
    assert tied.s == 24 and tied.z > (24 - 1) / math.sqrt(8 * 7 * 21 / 18)


def test_theil_sen_shrugs_off_an_outlier() -> None:
    xs = [float(i) for i in range(11)]
    ys = [2.0 * x + 1.0 for x in xs]
    ys[5] = 500.0
    slope, intercept = robust.theil_sen(xs, ys)
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)
    assert robust.theil_sen([1.0, 1.0], [3.0, 5.0]) == (0.0, 4.0)


def test_curvature_of_a_parabola_and_of_noise() -> None:
    xs = [float(i) for i in range(20)]
    fit = robust.curvature(xs, [0.5 * x * x - 3 * x + 2 for x in xs])
    assert fit is not None and fit.d2 == pytest.approx(1.0) and fit.se == pytest.approx(0.0, abs=1e-9)
    line = robust.curvature(xs, [3.0 - 0.1 * x + (0.01 if i % 2 else -0.01) for i, x in enumerate(xs)])
    assert line is not None and abs(line.d2) <= 2.33 * line.se
    assert robust.curvature(xs[:3], xs[:3]) is None and robust.curvature([1.0] * 5, xs[:5]) is None


def test_rolling_median_ewma_and_trailing_run() -> None:
    assert robust.rolling_median([1.0, 9.0, 2.0, 3.0, 8.0], 3) == [2.0, 3.0, 3.0]
    assert robust.rolling_median([1.0], 3) == []
    ewma = robust.Ewma(alpha=0.5)
    assert [ewma.update(x) for x in (4.0, 2.0, 2.0)] == [4.0, 3.0, 2.5]
    assert robust.Ewma.from_json(json.loads(json.dumps(ewma.to_json()))) == ewma
    assert robust.trailing_run([True, False, True, True]) == 2 and robust.trailing_run([]) == 0


def test_layer_ratio_thirds() -> None:
    assert layer_ratio([1e-6, 1e-6, 1e-3, 1e-3, 1.0, 1.0]) == pytest.approx(1e6)
    assert layer_ratio([0.0, 1.0, 1.0]) is None  # exactly zero: dead or detached, not vanishing
    assert layer_ratio([1.0, 1.0]) is None and layer_ratio([1.0, math.nan, 1.0]) is None
    assert layer_ratio([1.0, 1.0, 0.0]) is None


def test_a_reported_clip_threshold_gives_the_seeds_rule_and_a_concrete_recommendation() -> None:
    """With tau reported (``grad/clip_threshold``, what watch(clip=...) knows): mean pre-clip norm of the
    last 5 steps > 0.98 tau, and the adaptive value tau (1 + 0.05 n) in numbers."""
    events = copy.deepcopy(load("clip_stale"))
    first = next(e for e in events if any(p["name"] == "grad/global_norm" for p in e.get("metrics", {}).get("points", [])))
    first["metrics"]["points"].append({"name": "grad/clip_threshold", "value": 0.01})
    (incident,) = run(events).incidents()
    rules = {e.rule: e for e in incident.evidence}
    assert "tau = 0.01" in rules["gradient.clip_pinned"].description
    assert rules["gradient.clip_pinned"].value > 0.98
    assert "= 0.0115" in rules["gradient.clip_recommendation"].description  # 0.01 x (1 + 0.05 x 3)
    assert "= 0.012" in rules["gradient.clip_recommendation"].description   # min(1.2 x 0.01, 10)


def test_a_step_logged_as_one_batch_with_loss_and_gradient_nan_is_still_a_nan_source() -> None:
    """A metrics file (``trainguard replay``) puts a step's loss and gradient norms on one line; the SDK
    sends the norms first. The verdict must not depend on that order."""
    merged: Dict[int, Event] = {}
    rest: List[Event] = []
    for e in load("nan_source"):
        if "metrics" not in e:
            rest.append(e)
            continue
        for p in e["metrics"]["points"]:
            step = int(p.get("step") or e["step"])
            if step not in merged:
                merged[step] = {**copy.deepcopy(e), "step": step, "metrics": {"points": []}}
            merged[step]["metrics"]["points"].append({**p, "step": step})
    one_line_per_step = [merged[s] for s in sorted(merged)]
    (incident,) = run(one_line_per_step + rest).incidents()
    assert (incident.category, incident.subtype) == ("gradient", "nan-source")
    assert incident.first_step == first_nonfinite(series(load("nan_source"), "loss"))
