"""Loss detectors: a non-finite loss told apart from a gradient explosion and a NaN source, and the loss
curve's shape (oscillation, rise after a fall, plateau). Pure and streaming; the rules, their thresholds
and evidence are specified in docs/detectors.md (Loss).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from operator import itemgetter
from typing import AbstractSet, Any, Dict, Final, List, Optional, Sequence, Tuple

from trainguard.core.events import wire_float

from .. import robust
from ..catalogue import DetectionSettings
from ..incidents import Finding, resolve
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState, SeriesTail, Shiftable
from . import finite_or_none, fmt_number, window
from .adapter import KEY as ADAPTER_KEY
from .base import Detector, MetricBatch
from .numeric import (
    CLIP_STALE_KEY,
    ESCALATING,
    NUMERIC_KEY,
    VANISHING_KEY,
    Explosion,
    LossGradientSettings,
    climb_baseline,
    diverged_before,
    divergence_base,
    family_names,
    find_explosion,
    finite_series,
    grad_metric,
    loss_diverged,
    lr_span,
    nan_source,
    nan_source_evidence,
    note_nonfinite_batch,
    numeric_final,
    point_time,
    rank_has_open,
    rank_state,
    recent,
    upgrades,
)

__all__ = ["NUMERIC_KEY", "Explosion", "find_explosion", "on_curve", "on_metrics"]

CURVE_KINDS: Final = ("oscillation", "divergence", "rise-after-fall", "plateau")
"""Loss-curve subtypes, in the order they are judged (the first that confirms wins)."""
CURVE_KEYS = {"divergence": NUMERIC_KEY, "rise-after-fall": NUMERIC_KEY, "oscillation": "loss:oscillation",
              "plateau": "loss:plateau"}
"""Their incident slots (one per run each, all ranks merged). A rise after a fall and a divergence share
the ``numeric`` slot: a rise that goes on to leave the band becomes a divergence, and either, when it turns
out to be the start of an explosion or a NaN, is re-classified by that finding (one incident, first_step =
where the loss turned)."""
ESCALATES_TO = {"rise-after-fall": ("divergence", "rise-after-fall")}
"""The kinds still judged while a curve incident of the key's kind is open (the others wait; an open
divergence or oscillation may also give way, see :func:`_divergence_settled` and
:func:`_swings_on_a_rebound`)."""


def on_metrics(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (already folded into its history)."""
    loss_names = family_names(settings)[1]
    for name, step, value in points:
        if name in loss_names and value - value != 0.0:
            if _scaler_skipped(rank, step, points):
                return []  # the GradScaler found Inf/NaN and skipped this step: it did its job (the AMP
                #            detector judges whether the scale keeps collapsing)
            note_nonfinite_batch(run, rank, points, time_ns, settings)
            return [_loss_finding(run, rank, name, step, value, time_ns, event_id, settings)]
    return []


def _scaler_skipped(rank: RankState, step: int, points: Sequence[Tuple[str, int, float]]) -> bool:
    """Whether a GradScaler reported an overflow (``amp/overflow`` = 1: the optimizer step was skipped)
    at ``step``, in this batch or earlier in the rank's history."""
    for name, s, value in points:
        if name == "amp/overflow" and s == step:
            return value >= 0.5
    kept = rank.history.get("amp/overflow", {}).get(step)
    return kept is not None and kept[0] >= 0.5


def _loss_finding(run: RunState, rank: RankState, name: str, step: int, value: float, time_ns: int,
                  event_id: str, settings: DetectionSettings) -> Finding:
    shown = fmt_number(value)
    evidence = [Evidence(rule="loss.non_finite", description=f"{name} was {shown} at step {step} on rank "
                         f"{rank.rank}", step=step, time_ns=time_ns, rank=rank.rank, metric=name,
                         value=wire_float(value), window=window(rank, name, step, settings.evidence_window),
                         event_id=event_id)]
    timeline = [TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: {name} became {shown} at step {step}")]
    state = rank_state(rank)
    first_time = "loss_nonfinite" not in state
    if first_time:
        state["loss_nonfinite"] = step
    current = run.incidents.get(NUMERIC_KEY)
    escalate = current is not None and (current.record.category, current.record.subtype) in ESCALATING
    if current is not None and rank.rank in current.rank_first and not escalate:
        # the same rank again: one more signal; its first non-finite loss joins an incident opened earlier
        if not first_time:
            return Finding(current.record.category, current.record.subtype, NUMERIC_KEY, rank.rank, step,
                           time_ns, host=rank.host, event_id=event_id)
        exploded = (current.record.category, current.record.subtype) == ("gradient", "explosion")
        return Finding(current.record.category, current.record.subtype, NUMERIC_KEY, rank.rank, step, time_ns,
                       host=rank.host, event_id=event_id, evidence=evidence, timeline=timeline,
                       values={"value": shown, "step": step} if exploded else {}, update_values=exploded)
    explosion = find_explosion(rank, step, time_ns, settings) or \
        diverged_before(run, rank, step, time_ns, settings)
    values = {"value": shown, "step": step, "metric": name, "rank": rank.rank, "detail": ""}
    if explosion is None:
        source = nan_source(rank)
        if source is not None and source.step <= step:
            began = min(step, source.step)
            gname = grad_metric(rank, settings)
            before = finite_series(rank, gname, began - settings.explosion_window_steps, began - 1) \
                if gname else []
            calm = (f"; before it {gname} was steady (median "
                    f"{fmt_number(robust.median([v for _s, v, _t in before]))}, max "
                    f"{fmt_number(max(v for _s, v, _t in before))}: no climb, so not an explosion)"
                    if len(before) >= 2 else "")
            values.update({"detail": source.detail, "step": began})
            return Finding(
                "gradient", "nan-source", NUMERIC_KEY, rank.rank, began, source.time_ns or time_ns,
                seen_ns=time_ns, seen_step=step, host=rank.host, event_id=event_id,
                evidence=[nan_source_evidence(rank, source, time_ns, settings), *evidence],
                timeline=[TimelineEntry(time_ns=source.time_ns or time_ns, step=source.step, rank=rank.rank,
                                        what=f"rank {rank.rank}: {source.metric} became {source.value} at "
                                             f"step {source.step}"), *timeline],
                values=values, relabel=upgrades(run, "gradient", "nan-source"),
                summary=(f"On rank {rank.rank}, {name} became {shown} at step {step}; {source.description}"
                         f"{calm}. Look at the batch of step {source.step} and at log/div/sqrt in the loss "
                         f"and the named layers."))
        sudden = _sudden_nan(run, rank, name, step, time_ns, event_id, shown, evidence, timeline, settings)
        if sudden is not None:
            return sudden
        grads = [g for g in settings.grad_norm_metrics if g in rank.history]
        why = (f"{', '.join(grads)} showed no climb (< {settings.explosion_jump_factor:g}x its median) and "
               f"stayed finite before it" if grads else "no gradient-norm metric was reported")
        return Finding("loss", "non_finite", NUMERIC_KEY, rank.rank, step, time_ns, host=rank.host,
                       event_id=event_id, evidence=evidence, timeline=timeline, values=values,
                       relabel=upgrades(run, "loss", "non_finite"),
                       summary=f"On rank {rank.rank}, {name} became {shown} at step {step}; {why}.")
    began = min(s for s in (step, explosion.nonfinite_step, explosion.onset_step) if s is not None)
    values["detail"] = explosion.short
    return Finding(
        "gradient", "explosion", NUMERIC_KEY, rank.rank, began, explosion.earliest_ns, seen_ns=time_ns,
        seen_step=step, host=rank.host,
        event_id=event_id, evidence=explosion.evidence + evidence, timeline=explosion.timeline + timeline,
        values=values, relabel=True,
        summary=(f"On rank {rank.rank}, {explosion.detail}, and {name} became {shown} at step {step}: the "
                 f"gradients blew up first, so this is a gradient explosion (look for a data outlier, the "
                 f"learning rate or the clipping), not a loss or communication problem."))


def _sudden_nan(run: RunState, rank: RankState, name: str, step: int, time_ns: int, event_id: str, shown: str,
                evidence: List[Evidence], timeline: List[TimelineEntry],
                settings: DetectionSettings) -> Optional[Finding]:
    """A non-finite loss whose step's gradients were not read (a sampled norm cadence: readings at least 2
    steps apart) but whose sampled norms before it were calm (at least ``explosion_min_points`` finite
    readings in the window, no climb: the caller found no explosion): the NaN came suddenly from the
    forward pass or the loss -- the NaN-source story, told from what was sampled. None when there are
    too few readings to say, or when the norm was read every step lately (its value for this step is
    still to come)."""
    gname = grad_metric(rank, settings)
    if gname is None or step in rank.history.get(gname, {}):
        return None
    before = finite_series(rank, gname, step - settings.explosion_window_steps, step - 1)
    if len(before) < settings.explosion_min_points:
        return None
    recent_cadence = [*before[-settings.explosion_min_points:], (step, 0.0, 0)]
    if robust.median([b[0] - a[0] for a, b in zip(recent_cadence, recent_cadence[1:])]) < 2:
        return None  # read every step: this step's norm is still to come (the non-finite gradient rule)
    # (the cadence is the recent one, up to this step: the SDK's overhead budget thins the norm's
    # readings as a run goes on, so a run read every step at first may be sampled by the time of its NaN)
    values = [v for _s, v, _t in before]
    calm = (f"{gname} was read on {len(values)} of the {settings.explosion_window_steps} steps before it "
            f"(a sampled cadence) and stayed calm (median {fmt_number(robust.median(values))}, max "
            f"{fmt_number(max(values))}: no climb, so not an explosion); the gradients of step {step} "
            f"itself were not read")
    return Finding(
        "gradient", "nan-source", NUMERIC_KEY, rank.rank, step, time_ns, host=rank.host, event_id=event_id,
        evidence=[Evidence(rule="gradient.calm_before_nan", description=calm, step=step, time_ns=time_ns,
                           rank=rank.rank, metric=gname, value=wire_float(max(values)),
                           window=window(rank, gname, step, settings.evidence_window)), *evidence],
        timeline=timeline, relabel=upgrades(run, "gradient", "nan-source"),
        values={"value": shown, "step": step, "metric": name, "rank": rank.rank,
                "detail": f"the step's forward/loss ({name} {shown}; its gradients were not read)"},
        summary=(f"On rank {rank.rank}, {name} became {shown} at step {step} with no warning: {calm}. A "
                 f"sudden NaN/Inf from the forward pass or the loss -- a bad sample or label in that batch, "
                 f"log(0), a division by zero. Rerun the step with watch(every=1) and "
                 f"torch.autograd.set_detect_anomaly(True) to name the layer."))


# ----------------------------------------------------------------------------------------------------
# the loss curve


@dataclass
class _Check:
    """One loss-curve rule's verdict on the current window. ``summary`` may hold ``{since}``, filled in
    with the first step of the streak when the finding is made."""

    holds: bool
    since: int = -1              # where the condition began, as this check sees it
    deferred: bool = False       # not judged now (neither counts nor resets the streak)
    held: bool = False           # confirmed by a whole window already (no streak to wait for)
    at_once: bool = False        # confirmed by one value (a blow-up): opens with no streak
    evidence: List[Evidence] = field(default_factory=list)
    detail: str = ""
    summary: str = ""


_NOT_HOLDING: Final = _Check(False)
"""The verdict of a rule that does not hold on this value, shared (each of the four rules says so on most
values: no object and evidence list built each time). Read only -- never change it or its evidence list."""


def on_curve(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], time_ns: int,
             event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Loss-curve findings for one metric batch of ``rank`` (already folded into its history): judged
    once per new finite loss value (module docstring)."""
    loss_names = family_names(settings)[1]
    for point in points:  # the batch's first finite loss value (a plain loop: no generator)
        if point[0] in loss_names and point[2] - point[2] == 0.0:
            name, step, value = point
            break
    else:
        return []
    tuned = settings
    family = rank_state(rank)
    state: Optional[Dict[str, Any]] = family.get("loss")  # (get, set when absent: no empty dict per value)
    if state is None:
        state = family["loss"] = {}
    if state.setdefault("metric", name) != name or step <= state.get("last", -1):
        return []
    rank.derived.pop(STUCK_MEMO, None)  # (the memo serves this value only)
    state["last"] = step
    init: Optional[List[float]] = state.get("init")
    if init is None:
        init = state["init"] = []
    if len(init) < tuned.loss_baseline_points:
        init.append(value)
        state.setdefault("init_steps", []).append(step)
        if len(init) < tuned.loss_baseline_points:
            return []
        base = divergence_base(robust.median(init), init[0], tuned)  # known now: once for the first values
        for at, early in zip(state.pop("init_steps"), init):
            _note_early_blowup(state, at, early, tuned, base)
        return []
    if "ginit" not in state:  # (_track_grad_start's first test: no call once the level is known)
        _track_grad_start(rank, state, step, settings)
    series, tail, initial = _loss_series(rank, name, tuned.loss_window, step, init)
    if state.get("seen", 0) < tuned.divergence_early_blowup_values:  # (the base from the kept initial level)
        _note_early_blowup(state, step, value, tuned, divergence_base(initial, init[0], tuned))
    if "early_cv" not in state and len(series) >= 2 * tuned.loss_baseline_points:  # once (_swing_bar)
        earliest = [v for _s, v, _t in series[:2 * tuned.loss_baseline_points]]
        spread = robust.robust_cv(earliest)
        state["early_cv"] = spread if math.isfinite(spread) else None
        state["early"] = sorted(earliest)  # the run's first values, for _fell_from_start's rank test
    _track_level(state, series, tuned)
    if initial <= 0:
        return []
    muted, final, open_kind = _gates(run, rank)
    if muted and not tuned.divergence_beside_stale:
        return []
    if final and not muted:
        diverged = _explosion_held_diverged(run, rank, name, series, initial, state, step, time_ns, event_id,
                                            settings)
        if diverged is not None:
            return [diverged]
        if not _explosion_gave_way(run, rank, name, series, initial, state, step, time_ns, settings):
            return []
        _muted, final, open_kind = _gates(run, rank)  # (read again: those two may have resolved incidents)
    if muted and (open_kind not in (None, "divergence") or final):
        return []  # beside a clip-stale / vanishing / adapter incident only a divergence is judged
    if open_kind is not None and _curve_cleared(run, rank, open_kind, state, initial, step, time_ns,
                                                settings, series, tail):
        open_kind = None
    judged = ESCALATES_TO.get(open_kind, (open_kind,)) if open_kind is not None else CURVE_KINDS
    if muted:
        judged = ("divergence",)
    streaks: Optional[Dict[str, int]] = state.get("streak")  # (get, set when absent: as setdefault)
    if streaks is None:
        streaks = state["streak"] = {}
    since: Optional[Dict[str, int]] = state.get("since")
    if since is None:
        since = state["since"] = {}
    win: Optional[_Window] = None  # (made when first read: most values return before any rule reads it)
    if not muted:  # the curve's other state (start level, lows held, hand-overs) waits while muted
        if "start_level" not in state and len(series) >= tuned.loss_window:  # (the window is full)
            win = _Window(series, tuned.loss_window, tail)
            state["start_level"] = win.median  # the level of the first full window (_divergence_settled)
            state["start_values"] = list(win.ordered)  # and its values, sorted (_rose_from_start)
        held = tuned.rise_held_points
        if len(series) >= held and state.get("levels", 0) % tuned.rise_smooth == 0:
            # the lowest level held over rise_held_points values in a row (_check_rise), taken every
            # rise_smooth values (consecutive medians share all but that many values: cheap, and as low)
            level_held = _median_of(series[-held:])
            if level_held < state.get("best_held", math.inf):
                state["best_held"] = level_held
            if abs(level_held - initial) > tuned.plateau_resolve_drop * initial:
                state["moved_at"] = step  # the loss is away from its start (_plateau_min_steps)
        if open_kind in ("divergence", "oscillation"):  # (the hand-overs read the window)
            win = hand = win if win is not None else _Window(series, tuned.loss_window, tail)
            if open_kind == "divergence" and _divergence_settled(run, rank, name, series, hand, initial,
                                                                 state, step, time_ns, settings):
                open_kind, judged = None, ("oscillation",)
            elif open_kind == "oscillation" and _swings_on_a_rebound(run, rank, name, series, hand, initial,
                                                                     state, step, time_ns, settings):
                open_kind, judged = None, ("rise-after-fall",)
            elif open_kind == "oscillation" and _oscillation_held_high(run, rank, name, series, hand,
                                                                       initial, state, step, time_ns,
                                                                       settings):
                open_kind, judged = None, ("divergence",)
            elif open_kind == "oscillation" and _oscillation_calmed(run, rank, hand, initial, state, step,
                                                                    time_ns, settings):
                open_kind, judged = None, CURVE_KINDS
    if open_kind is not None and len(judged) == 1 and \
            state.get("levels", 0) % max(tuned.confirm_checks, tuned.loss_window // 4):
        return []  # an open incident's last step is refreshed every few values, not on each
    free = open_kind is None and not muted and tail is not None  # (judged: CURVE_KINDS)
    if free and (_young_quiet(state, series, tail, initial, settings)  # type: ignore[arg-type]
                 if len(series) < tuned.loss_window  # (free: tail is not None)
                 else _stays_quiet(rank, state, series, tail, initial, settings)):  # type: ignore[arg-type]
        streaks["oscillation"] = streaks["divergence"] = streaks["rise-after-fall"] = 0
        return []  # what the loop below does on this value (_stays_quiet)
    if win is None:
        win = _Window(series, tuned.loss_window, tail)
    quiet = free
    for kind in CURVE_KINDS:
        if kind not in judged:
            continue
        check = _CHECKS[kind](rank, name, series, win, initial, state, settings, tuned, False)
        if kind == "oscillation" and check.holds and open_kind != kind and \
                not _swings_shaped(win, initial, state, tuned, rank):
            check = _NOT_HOLDING  # a noisy loss, not swings: values independent of each other, near the start
        quiet = quiet and check is _NOT_HOLDING
        if check.deferred:
            continue
        if kind == "plateau" and kind != open_kind:
            if not _flat_stretch(state, check, win, initial, tuned):
                continue
            streaks[kind], since[kind] = state["flat"]["holds"], state["flat"]["since"]
        elif not check.holds:
            streaks[kind] = 0
            continue
        else:
            _count_hold(state, kind, check.since)
        first = since[kind]
        began_ns = point_time(rank, name, first, time_ns)
        if kind == open_kind:  # still so: extend the incident's last step
            return [Finding("loss", kind, CURVE_KEYS[kind], rank.rank, first, began_ns, seen_ns=time_ns,
                            seen_step=step, host=rank.host, event_id=event_id, counts=False)]
        if check.held:  # a whole window confirmed it (_check_rise)
            streaks[kind] = max(streaks[kind], tuned.rise_min_points)
        needed = 1 if check.at_once else {
            "rise-after-fall": tuned.rise_min_points,
            "divergence": _divergence_points(rank, step, settings)}.get(kind, tuned.confirm_checks)
        if streaks[kind] < needed or (kind == "plateau" and step - first < _plateau_min_steps(state, first,
                                                                                             tuned)):
            continue
        check = _CHECKS[kind](rank, name, series, win, initial, state, settings, tuned, True)
        state["opened"] = {"kind": kind, "level": state.get("level", win.median), "best": state.get("best"),
                           "low": win.median < tuned.plateau_min_level * initial}
        # a rise after the slot's explosion (or NaN) resolved re-classifies it: what cleared is history
        relabel = kind in ("divergence", "rise-after-fall") and upgrades(run, "loss", kind)
        return [Finding(
            "loss", kind, CURVE_KEYS[kind], rank.rank, first, began_ns, seen_ns=time_ns, seen_step=step,
            host=rank.host, event_id=event_id, evidence=list(check.evidence),  # (never the shared list)
            timeline=[TimelineEntry(time_ns=began_ns, step=first, rank=rank.rank,
                                    what=f"rank {rank.rank}: {name} {check.detail} since step {first}"),
                      TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                    what=f"rank {rank.rank}: confirmed on {streaks[kind]} values in a row")],
            values={"step": first, "detail": check.detail, "value": fmt_number(value), "rank": rank.rank},
            relabel=relabel, update_values=kind == "divergence" or relabel,
            summary=f"On rank {rank.rank}, {check.summary.format(since=first)}")]
    if tail is not None:
        _derived(tail).quiet = _quiet_stretch(state, win, tail, initial, settings) if quiet else None
    return []


class _Quiet:
    """A quiet stretch's certificate (:func:`_quiet_stretch`): derived, kept beside the loss tail
    (``_Derived.quiet``), never serialized. ``at``: the tail's length when it was taken; ``most``: how many
    more points the window may take in while it holds; ``checked``: the tail's length up to which the new
    points were found under ``blow_bar`` (the blow-up bar; inf: off); ``base``: the divergence base."""

    def __init__(self, settings: DetectionSettings, at: int, most: int, base: float, blow_bar: float) -> None:
        self.settings = settings
        self.at = at
        self.checked = at
        self.most = most
        self.base = base
        self.blow_bar = blow_bar


def _quiet_stretch(state: Dict[str, Any], win: _Window, tail: SeriesTail, initial: float,
                   settings: DetectionSettings) -> Optional[_Quiet]:
    """After a value on which no curve incident of the rank was open, nothing muted the curve and each of
    the four rules answered "does not hold" (the shared verdict; the plateau rule on no flat stretch): for
    how many more points of the tail the oscillation and plateau rules are proven to answer so again,
    whatever those values -- a certificate, or None when no point is proven. The window is the tail's last
    ``loss_window`` points (an exact tail, full); each new point replaces one of them, and a replacement
    moves each order statistic of the sorted window by at most one place, so after ``m`` points the
    median is at most ``ordered[w // 2 + m]`` (the upper middle value moved up ``m`` places; the median,
    or the rounded mean of the two middle ones, is at most that). While that bound is under
    ``oscillation_min_level`` x the lower of the initial level and the first value (the oscillation rule's
    level, either way it takes it), under ``plateau_min_level`` x the initial level (the plateau rule's
    "fell" level test) and under ``plateau_stalled_min_level`` x it (no "stalled" verdict), and the
    plateau rule's rank test against the run's first values still says "significantly lower" with each
    replaced value adding the most it can to the count of higher pairs (``len(early)``), neither rule
    can hold whatever the values are, as long as nothing moves the weights either (:func:`_stays_quiet`
    asks that on each value, with what the other two rules read)."""
    w = settings.loss_window
    if not win.full or "flat" in state or not initial > 0 or len(win.ordered) != w:
        return None
    early_blowup = state.get("early_blowup")
    if early_blowup is not None and early_blowup[2] < 0:
        return None  # (still to be judged, on a window: the divergence rule's)
    ordered = win.ordered
    init = state["init"]
    first = init[0]
    bar = min(settings.oscillation_min_level * min(initial, first), settings.plateau_min_level * initial)
    base = divergence_base(initial, first, settings)
    factor = settings.divergence_blowup_factor
    blow_bar = factor * base if factor > 0 and base > 0 else math.inf
    if not ordered[-1] < blow_bar:
        return None
    early: Optional[List[float]] = state.get("early")
    rank_test = bool(early)
    if rank_test:
        assert early is not None
        n1 = len(early)
        spread = math.sqrt(n1 * w * (n1 + w + 1) / 12.0)
        if not spread > 0:
            return None
        higher = _rank_higher(early, ordered)
        half = n1 * w / 2.0
    most = -1
    for m in range(0, w - w // 2):
        bound = ordered[w // 2 + m]
        if not (bound < bar and bound / initial < settings.plateau_stalled_min_level):
            break
        if rank_test and not -(((higher + m * n1) - half) / spread) >= settings.trend_z:
            break
        most = m
    if most < 1:
        return None
    return _Quiet(settings, len(tail.points), most, base, blow_bar)


def _stays_quiet(rank: RankState, state: Dict[str, Any], series: Sequence[Tuple[int, float, int]],
                 tail: SeriesTail, initial: float, settings: DetectionSettings) -> bool:
    """Whether the four curve rules answer "does not hold" on this value, proven without judging them:
    the tail's quiet certificate (:func:`_quiet_stretch`) covers this value's window (the same tail, at
    most ``most`` points taken in since, each under the blow-up bar: :func:`_blown_up` finds none), and
    what the rules read beside the window says so too -- the divergence rule's rolling level under its
    bar (``state["level"]``, exact), the rise rule's fall and rise tests (exact), no flat stretch and no
    early blow-up still to judge (the plateau's and divergence's state), and nothing that stops the
    weights (:func:`_optimisation_stuck`'s reason, the one the plateau rule would take on this value).
    Then the caller's loop would only zero the three streaks (and the plateau rule's flat stretch stays
    absent): the caller does that and skips it. The certificate is dropped when it no longer covers."""
    kept: Optional[_Derived] = tail.windows.get("loss")
    quiet = kept.quiet if kept is not None else None
    if kept is None or quiet is None:
        return False
    points = tail.points
    n = len(points)
    if quiet.settings is not settings or not quiet.at < n <= quiet.at + quiet.most or \
            len(series) < settings.loss_window:
        kept.quiet = None
        return False
    blow_bar = quiet.blow_bar
    for i in range(quiet.checked, n):
        if not points[i][1] < blow_bar:
            kept.quiet = None
            return False
    quiet.checked = n
    if "flat" in state:
        return False
    early_blowup = state.get("early_blowup")
    if early_blowup is not None and early_blowup[2] < 0:
        return False
    if not _level_under_bar(state, quiet.base, settings):
        return False  # (the divergence rule's last test before it holds: the caller judges)
    if not _rise_fails(state, initial, settings):
        return False
    hi = series[-1][0]
    memo = rank.derived.get(STUCK_MEMO)
    if memo is not None and memo[0] == hi:
        reason = memo[1]
    else:
        reason = _stuck_now(rank, series[-settings.loss_window][0], hi, settings)
        rank.derived[STUCK_MEMO] = (hi, reason)
    return not reason


def _young_quiet(state: Dict[str, Any], series: Sequence[Tuple[int, float, int]], tail: SeriesTail,
                 initial: float, settings: DetectionSettings) -> bool:
    """:func:`_stays_quiet`'s answer for a window not full yet (fewer than ``loss_window`` values in
    ``series``, the tail's exact last points: finite): whether the four curve rules answer "does not hold"
    on this value, proven by the tests they make first, exactly. The oscillation and plateau rules answer
    so on a window that is not full (their first test), and the plateau rule's flat stretch is left as it
    is (:func:`_flat_stretch` changes it only on a full window or a holding check); the rise rule's fall
    and rise tests (:func:`_check_rise`'s first, as :func:`_stays_quiet` makes them); the divergence rule's
    blow-up scan (:func:`_blown_up`: no value at or over the bar, or the newest one still over it -- for
    finite values, the largest under the bar is "none over it"), its early blow-up (judged only on a full
    window: :func:`_early_blowup_left_dead`) and its rolling level under ``divergence_factor`` x its base
    (its last test before it holds). Then the caller's loop would only zero the three streaks and leave
    the tail without a quiet certificate (:func:`_quiet_stretch` takes none on such a window): the caller
    zeroes them, this drops the certificate. Else False (the caller judges the rules)."""
    if not _rise_fails(state, initial, settings):
        return False
    base = divergence_base(initial, state["init"][0], settings)
    factor = settings.divergence_blowup_factor
    if factor > 0 and base > 0 and series:
        bar = factor * base
        if series[-1][1] < bar and not max(map(_VALUE, series)) < bar:
            return False  # (a blow-up the loss came back from: the rule's, judged in full)
    if not _level_under_bar(state, base, settings):
        return False
    _derived(tail).quiet = None
    return True


def _rise_fails(state: Dict[str, Any], initial: float, settings: DetectionSettings) -> bool:
    """Whether the rise rule's first tests fail on this value, as :func:`_check_rise` makes them (exact):
    no fall from the start of ``rise_min_fall`` x it yet, or no rise since of ``rise_min_rise`` x the fall
    (True too while there is no level or best yet). For the quiet proofs (:func:`_stays_quiet`,
    :func:`_young_quiet`)."""
    level, best = state.get("level"), state.get("best")
    if best is None or level is None:
        return True
    start = max(initial, state["init"][0])
    fall = start - best
    return fall < settings.rise_min_fall * start or level - best < settings.rise_min_rise * fall


def _level_under_bar(state: Dict[str, Any], base: float, settings: DetectionSettings) -> bool:
    """Whether the divergence rule's rolling level (``state["level"]``) is under ``divergence_factor`` x
    ``base`` -- its last test before it holds -- or there is no level or base to test (exact). For the quiet
    proofs."""
    level = state.get("level")
    return level is None or base <= 0 or level < settings.divergence_factor * base


def _explosion_gave_way(run: RunState, rank: RankState, name: str, series: Sequence[Tuple[int, float, int]],
                        initial: float, state: Dict[str, Any], step: int, time_ns: int,
                        settings: DetectionSettings) -> bool:
    """Whether the open gradient explosion of ``rank`` -- flagged from the norm's climb, before any
    non-finite loss or gradient -- gives way to a plateau, resolving it then: the plateau rule has held
    on a flat stretch (:func:`_flat_stretch`) of ``plateau_min_steps``+ steps while the explosion was
    open, the loss's level under ``divergence_factor`` x its base (at its initial level, not diverged).
    The gradients climbed and nothing blew up: the run that stays where it started has learned nothing
    -- its plateau is what goes on (the caller's plateau check opens it on this value). Only while such
    an explosion is open; cheap otherwise (one dict lookup)."""
    st = run.incidents.get(NUMERIC_KEY)
    if st is None or not st.is_open or (st.record.category, st.record.subtype) != ("gradient", "explosion"):
        return False
    numeric = rank_state(rank)
    if "loss_nonfinite" in numeric or numeric.get("nonfinite"):
        return False
    state["climbed"] = True  # the norm climbed with nothing non-finite: a flat loss now is stalled (_stalled)
    win = _Window(series, settings.loss_window)
    base = divergence_base(initial, state["init"][0], settings)
    check = _check_plateau(rank, name, series, win, initial, state, settings, settings, False)
    if not win.full or win.median >= settings.divergence_factor * base:
        state.pop("flat", None)
        return False
    if not _flat_stretch(state, check, win, initial, settings):
        return False
    flat = state["flat"]
    if flat["holds"] < settings.confirm_checks or step - flat["since"] < settings.plateau_min_steps:
        return False
    resolve(st, time_ns, step, rank.rank, f"rank {rank.rank}: {name} has stayed flat at "
            f"{fmt_number(win.median)} ({win.median / initial:.2f}x where it started) since step "
            f"{flat['since']} with no non-finite value: the gradients' climb did not blow the run up, it "
            f"learns nothing (the loss/plateau incident goes on from here)", settings)
    numeric.setdefault("grad", {})["gave_way"] = step
    return True


HELD_DIVERGED = "explosion-diverged"
"""The streak key of :func:`_explosion_held_diverged` (beside the curve kinds' streaks)."""


def _explosion_held_diverged(run: RunState, rank: RankState, name: str,
                             series: Sequence[Tuple[int, float, int]], initial: float, state: Dict[str, Any],
                             step: int, time_ns: int, event_id: str,
                             settings: DetectionSettings) -> Optional[Finding]:
    """A re-classification (in place) of the open gradient explosion of ``rank`` -- flagged from the norm's
    climb, before any non-finite loss or gradient -- as ``loss/divergence``, once the loss has stayed out of
    its band (its rolling level >= ``divergence_factor`` x its :func:`divergence_base`, ``loss_diverged``)
    on ``explosion_diverged_points`` values in a row with nothing non-finite: the norm climbed because the
    loss left its band, and the run goes on far above its start without blowing up -- what it is, is a
    divergence (the corpus label's rule too: an explosion ends in a non-finite value; swings held out of the
    band are not an oscillation either, :func:`_held_out_of_band`). Same incident (its first step, the
    climb's evidence and the lead it gave are kept); a later non-finite value re-classifies it back to an
    explosion (the divergence is an escalating kind), and the curve rules judge it from here (it may
    settle into an oscillation). None otherwise; cheap unless such an explosion is open (a dict lookup)."""
    points = settings.explosion_diverged_points
    st = run.incidents.get(NUMERIC_KEY)
    if points <= 0 or st is None or not st.is_open or \
            (st.record.category, st.record.subtype) != ("gradient", "explosion"):
        return None
    numeric = rank_state(rank)
    if "loss_nonfinite" in numeric or numeric.get("nonfinite"):
        return None
    streaks: Dict[str, int] = state.setdefault("streak", {})
    if not loss_diverged(rank, settings):
        streaks[HELD_DIVERGED] = 0
        return None
    centre = series[-(settings.rise_smooth // 2) - 1][0] if len(series) > settings.rise_smooth else step
    if _count_hold(state, HELD_DIVERGED, centre) < points:
        return None
    streaks[HELD_DIVERGED] = 0
    first = state["since"][HELD_DIVERGED]
    win = _Window(series, settings.loss_window)
    level = state.get("level", win.median)
    base = divergence_base(initial, state["init"][0], settings)
    state["opened"] = {"kind": "divergence", "level": level, "best": state.get("best"), "low": False}
    numeric.setdefault("grad", {}).pop("climb", None)  # no longer an explosion waiting to settle
    began_ns = point_time(rank, name, first, time_ns)
    ratio = level / base if base > 0 else math.inf
    description = (f"{name} level (rolling median of {settings.rise_smooth}) >= "
                   f"{settings.divergence_factor:g}x the initial level {fmt_number(base)} on {points} values "
                   f"in a row since step {first}, now {fmt_number(level)} = {ratio:.3g}x, with no non-finite "
                   f"loss or gradient after the gradient norm's climb")
    return Finding(
        "loss", "divergence", NUMERIC_KEY, rank.rank, first, began_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id,
        evidence=[Evidence(rule="loss.divergence", description=description, step=first, time_ns=began_ns,
                           rank=rank.rank, metric=name, threshold=settings.divergence_factor,
                           value=finite_or_none(ratio),
                           window=window(rank, name, step, settings.evidence_window), event_id=event_id)],
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: {name} has stayed out of its band on {points} "
                                     f"values in a row with nothing non-finite: the climb was the loss "
                                     f"diverging")],
        values={"step": first, "detail": f"{fmt_number(level)}, {ratio:.3g}x its start",
                "value": fmt_number(series[-1][1]), "rank": rank.rank},
        relabel=True, update_values=True,
        summary=(f"On rank {rank.rank}, {name} left its starting band at step {first} and has stayed out of "
                 f"it: it is at {fmt_number(level)}, {ratio:.3g}x where it started ({fmt_number(base)})"
                 + lr_span(rank, first, step)
                 + f". The gradient norm's climb flagged earlier was this divergence's: nothing became "
                   f"non-finite over {points} values since. Most often a learning rate far too high for "
                   f"this model and optimiser (or a warmup to a too-high peak, or an LR schedule that "
                   f"increases)."))


def _count_hold(state: Dict[str, Any], kind: str, since: int) -> int:
    """One more value in a row on which ``kind``'s rule holds: its streak, returned (the streak's first
    value sets ``state["since"][kind]`` to ``since``)."""
    streaks: Dict[str, int] = state.setdefault("streak", {})
    if streaks.get(kind, 0) == 0:
        state.setdefault("since", {})[kind] = since
    streaks[kind] = streaks.get(kind, 0) + 1
    return streaks[kind]


def _divergence_settled(run: RunState, rank: RankState, name: str, series: Sequence[Tuple[int, float, int]],
                        win: _Window, initial: float, state: Dict[str, Any], step: int, time_ns: int,
                        settings: DetectionSettings) -> bool:
    """Whether the open divergence of ``rank`` has settled into an oscillation, resolving it then: over a
    full ``loss_window`` the loss swings with no trend (the oscillation rule holds) and no longer rises
    (the divergence rule does not hold: jumping from value to value with no upward trend since it left
    the band), at a level at most ``oscillation_max_rise`` x the level of the run's first full
    ``loss_window`` (``state["start_level"]``: swings with no trend relative to where the run started; a
    loss that climbed far above its early level and swings there has not stopped diverging), and the
    LR did not grow over the window (a warmup still raising the LR drives the loss up: a rough loss
    without a significant trend in between has not stopped rising), on ``confirm_checks`` values in a
    row. A far-too-high LR often throws the loss up within
    its first steps and then keeps it swinging there: what goes on is the oscillation, at a high level
    (the divergence stays in the run's history, resolved). The oscillation rule's streak is counted here,
    so the caller's oscillation check opens it on the next hold."""
    streaks: Dict[str, int] = state.setdefault("streak", {})
    swings = _check_oscillation(rank, name, series, win, initial, state, settings, settings, False)
    rises = _check_divergence(rank, name, series, win, initial, state, settings, settings, False)
    opened = state.get("opened") or {}
    if not swings.holds or rises.holds or not opened.get("level") or \
            win.median > settings.oscillation_max_rise * state.get("start_level", opened["level"]) or \
            _lr_grew(rank, win.first_step, win.last_step):
        streaks["oscillation"] = 0
        return False
    if _count_hold(state, "oscillation", swings.since) < settings.confirm_checks:
        return False
    streaks["oscillation"] -= 1  # the caller's check counts this value again
    st = run.incidents.get(NUMERIC_KEY)
    if st is None or st.record.subtype != "divergence":
        return False
    resolve(st, time_ns, step, rank.rank, f"rank {rank.rank}: the loss stopped rising -- it swings with no "
            f"trend at {fmt_number(win.median)} (the loss/oscillation incident goes on from here)", settings)
    state.pop("opened", None)
    streaks["divergence"] = 0
    return True


def _lr_grew(rank: RankState, lo: int, hi: int) -> bool:
    """Whether the rank's LR (``opt/lr`` or ``lr``) is higher at the end of steps [lo, hi] than at their
    start (a warmup or a schedule that increases); False when no LR is reported."""
    for name in ("opt/lr", "lr"):
        if name in rank.history:
            lrs = finite_series(rank, name, lo, hi)
            return len(lrs) >= 2 and lrs[-1][1] > lrs[0][1]
    return False


def _swings_on_a_rebound(run: RunState, rank: RankState, name: str, series: Sequence[Tuple[int, float, int]],
                         win: _Window, initial: float, state: Dict[str, Any], step: int, time_ns: int,
                         settings: DetectionSettings) -> bool:
    """Whether the open oscillation of ``rank`` gives way to a rise after a fall, resolving it then: the
    rise-after-fall rule holds (the level fell by >= ``rise_min_fall`` from where it started, then rose
    back by >= ``rise_min_rise`` of that fall with a significant trend) on ``rise_min_points`` values in
    a row -- the swings sit on a rebound from a level the run had already reached (it learned, then lost
    it). The rise rule's streak is counted here, so the caller's rise check opens it on the next hold."""
    streaks: Dict[str, int] = state.setdefault("streak", {})
    rise = _check_rise(rank, name, series, win, initial, state, settings, settings, False)
    if rise.deferred:
        return False
    if not rise.holds:
        streaks["rise-after-fall"] = 0
        return False
    if _count_hold(state, "rise-after-fall", rise.since) < settings.rise_min_points:
        return False
    streaks["rise-after-fall"] -= 1  # the caller's check counts this value again
    return _oscillation_gives_way(run, state, time_ns, step, rank.rank, f"rank {rank.rank}: the swings sit "
                                  f"on a rebound from a level the run had reached (the loss/rise-after-fall "
                                  f"incident goes on from here)", settings)


def _oscillation_gives_way(run: RunState, state: Dict[str, Any], time_ns: int, step: int, rank: int,
                           why: str, settings: DetectionSettings) -> bool:
    """Resolve the run's open oscillation (``why``: the resolution's text) so that another loss-shape
    incident goes on from here; False when none is open."""
    st = run.incidents.get(CURVE_KEYS["oscillation"])
    if st is None or not st.is_open or st.record.subtype != "oscillation":
        return False
    resolve(st, time_ns, step, rank, why, settings)
    state.pop("opened", None)
    state.setdefault("streak", {})["oscillation"] = 0
    return True


def _oscillation_held_high(run: RunState, rank: RankState, name: str,
                           series: Sequence[Tuple[int, float, int]], win: _Window, initial: float,
                           state: Dict[str, Any], step: int, time_ns: int,
                           settings: DetectionSettings) -> bool:
    """Whether the open oscillation of ``rank`` gives way to a divergence, resolving it then -- the
    counterpart of :func:`_divergence_settled`: the oscillation rule no longer holds (the window stopped
    swinging, or trends) while the divergence rule does (the level >= ``divergence_factor`` x the base,
    calm or rising), on ``oscillation_held_points`` values in a row. A far-too-high LR often throws the loss
    about at first and then holds it far above where it started: what goes on is a loss diverged from its
    start, not swings around it (the oscillation stays in the run's history, resolved). Another window of
    swings ends the streak. The divergence rule's streak is counted here, so the caller's divergence check
    opens it on the next hold."""
    streaks: Dict[str, int] = state.setdefault("streak", {})
    if not win.full:
        return False
    swings = _check_oscillation(rank, name, series, win, initial, state, settings, settings, False)
    rises = _check_divergence(rank, name, series, win, initial, state, settings, settings, False)
    if swings.holds or not rises.holds:
        streaks["divergence"] = 0
        return False
    if _count_hold(state, "divergence", rises.since) < settings.oscillation_held_points:
        return False
    streaks["divergence"] -= 1  # the caller's check counts this value again
    why = (f"rank {rank.rank}: the loss stopped swinging around a level -- it has stayed at "
           f"{fmt_number(win.median)}, far above where it started, for {settings.oscillation_held_points} "
           f"values (the loss/divergence incident goes on from here)")
    return _oscillation_gives_way(run, state, time_ns, step, rank.rank, why, settings)


def _flat_stretch(state: Dict[str, Any], check: _Check, win: _Window, initial: float,
                  tuned: LossGradientSettings) -> bool:
    """Track the flat stretch the plateau rule opens on: it starts at a window the rule holds for and lasts
    while the window's level stays within ``plateau_resolve_drop`` of the stretch's level -- a noisy
    window where the slope test fails does not end it (the rule's own level test still gates each hold).
    ``state["flat"]`` = {since, level, holds}; whether the rule holds now within a stretch."""
    flat = state.get("flat")
    if flat is not None and win.full:
        drift = tuned.plateau_resolve_drop * flat["level"]
        if abs(win.median - flat["level"]) > drift:
            flat = None
    if flat is None:
        state.pop("flat", None)
        if not check.holds:
            return False
        flat = state["flat"] = {"since": check.since, "level": win.median, "holds": 0}
    if check.holds:
        flat["holds"] += 1
    return check.holds


def _plateau_min_steps(state: Dict[str, Any], since: int, tuned: LossGradientSettings) -> int:
    """How many steps a flat stretch that began at ``since`` must span before the plateau opens:
    ``plateau_moved_min_steps`` when the loss had been away from its start before the stretch began
    (``state["moved_at"]``: the last step at which the median of the last ``rise_held_points`` values was
    more than ``plateau_resolve_drop`` from the initial level) -- it moved and came back to sit where it
    began, no slow start -- else ``plateau_min_steps``. A stretch flat from the first steps (a warmup
    from ~0 LR) began before any such step, so it always waits the full ``plateau_min_steps``."""
    moved = state.get("moved_at")
    if moved is not None and moved <= since:
        return min(tuned.plateau_moved_min_steps, tuned.plateau_min_steps)
    return tuned.plateau_min_steps


GATES_MEMO = "loss.gates"
"""The key of :func:`_gates`' memo in the rank's derived state (``RankState.derived``: per rank, never
serialized): [the run's incident-change count, its number of incidents, (muted, final, open kind)]."""

_NO_GATES: Tuple[bool, bool, Optional[str]] = (False, False, None)


def _gates(run: RunState, rank: RankState) -> Tuple[bool, bool, Optional[str]]:
    """What the run's incidents say to the loss curve of ``rank``: (muted -- an open vanishing, clip-stale
    or adapter incident lists the rank; :func:`~.numeric.numeric_final`; :func:`_open_curve_kind`). They
    read only the incidents' status, kind and ranks, so they are taken again only when an incident
    opened or one of those changed since they were last taken for the rank (``RunState.changes`` and the
    number of incidents: :mod:`..incidents` counts every such change); else the rank's memo answers, the
    same three values. A run with no incident answers at once."""
    incidents = run.incidents
    if not incidents:
        return _NO_GATES
    changes = run.changes[0]
    memo: Optional[List[Any]] = rank.derived.get(GATES_MEMO)
    if memo is not None and memo[0] == changes and memo[1] == len(incidents):
        gates: Tuple[bool, bool, Optional[str]] = memo[2]
        return gates
    gates = (rank_has_open(run, rank, VANISHING_KEY, CLIP_STALE_KEY, ADAPTER_KEY), numeric_final(run, rank),
             _open_curve_kind(run, rank))
    rank.derived[GATES_MEMO] = [changes, len(incidents), gates]
    return gates


def _open_curve_kind(run: RunState, rank: RankState) -> Optional[str]:
    """The loss-curve kind of the open curve incident ``rank`` is in (None: none)."""
    for key in ("loss:oscillation", NUMERIC_KEY, "loss:plateau"):
        st = run.incidents.get(key)
        if st is None or not st.is_open or rank.rank not in st.rank_first:
            continue
        if key != NUMERIC_KEY:
            return key.split(":", 1)[1]
        if (st.record.category, st.record.subtype) in ESCALATING:
            return st.record.subtype
    return None


def _curve_cleared(run: RunState, rank: RankState, kind: str, state: Dict[str, Any], initial: float,
                   step: int, time_ns: int, settings: DetectionSettings,
                   series: Sequence[Tuple[int, float, int]] = (), tail: Optional[SeriesTail] = None) -> bool:
    """Resolve the open curve incident of ``kind`` when its condition cleared (the run's health recovers);
    whether it did. The loss level (rolling median of ``rise_smooth``) against what it was when the
    incident opened (``state["opened"]``): a plateau or an oscillation whose level fell
    ``plateau_resolve_drop`` below it (the optimiser got going / the swings settled lower), a plateau
    whose last ``loss_window`` values' median is under ``plateau_min_level`` x the initial level (the
    negation of the rule's own level test: the run has fallen from where it started, it is converging),
    a rise that gave back half of its rise, a divergence back under ``divergence_factor`` x the initial
    level. A plateau never clears while nothing moves the weights. ``tail``: ``series``'s exact tail
    (:func:`_exact_tail`), whose sorted window gives the full window's median without a sort."""
    opened, level = state.get("opened"), state.get("level")
    if not opened or opened.get("kind") != kind or level is None:
        return False
    at = opened["level"]
    if kind in ("plateau", "oscillation"):
        cleared = level <= (1.0 - settings.plateau_resolve_drop) * at
        if cleared and kind == "oscillation" and len(series) >= settings.loss_window:  # and so over a full
            cleared = _median_last(series, settings.loss_window, tail) <= \
                (1.0 - settings.plateau_resolve_drop) * at
            #           window: a run of low batches dips a swinging loss's rolling level that far
        if not cleared and kind == "plateau" and len(series) >= settings.loss_window and \
                not opened.get("low"):
            # (a plateau found under plateau_min_level -- its fall not significant, _fell_from_start --
            # does not clear by the level test it already failed when it opened: that would flap)
            bar = settings.plateau_min_level * initial
            if not _level_held(tail, bar, settings):
                window_level = _median_last(series, settings.loss_window, tail)
                cleared = window_level < bar and not _stalled(
                    rank, state, window_level / initial, step - settings.loss_window, step, settings)
                if tail is not None and not cleared:
                    _hold_level(tail, bar, settings)
        if cleared and kind == "plateau":  # a lower level while nothing moves the weights is noise
            cleared = not _optimisation_stuck(rank, state, step - settings.loss_window, step, settings)
    elif kind == "rise-after-fall":
        best = opened.get("best", at)
        cleared = level <= best + 0.5 * max(0.0, at - best)
        if cleared and len(series) >= settings.loss_window:  # and so over a full window: one dip of a
            cleared = _median_last(series, settings.loss_window, tail) <= best + 0.5 * max(0.0, at - best)
            #           swinging loss's rolling level is not the rise given back
    else:  # divergence
        bar = settings.divergence_factor * divergence_base(initial, state["init"][0], settings)
        cleared = level < bar
        if cleared and len(series) >= settings.loss_window:  # and so over a full window: a run of low
            cleared = _median_last(series, settings.loss_window, tail) < bar  # batches of a loss swinging far
            #           above the band dips the rolling level under the bar without the loss coming back
    if not cleared:
        return False
    st = run.incidents.get(CURVE_KEYS[kind])
    if st is None or st.record.subtype != kind:
        return False
    resolve(st, time_ns, step, rank.rank, f"rank {rank.rank}: the loss level is {fmt_number(level)} (it was "
            f"{fmt_number(at)} when this opened): the condition cleared", settings)
    state.pop("opened", None)
    state.pop("flat", None)
    state.setdefault("streak", {})[kind] = 0
    return True


def _hold_level(tail: SeriesTail, bar: float, settings: DetectionSettings) -> None:
    """After an open plateau's full window was found at or over ``bar`` (plateau_min_level x the initial
    level; the caller's :func:`_curve_cleared`, on the tail's exact last ``loss_window`` points): for how many
    more points of the tail its median stays there whatever the values -- each new point replaces one window
    value, so after ``m`` of them the median is at least ``ordered[(w - 1) // 2 - m]`` (the lower middle
    value moved down ``m`` places; the median, or the rounded mean of the two middle ones, is at least it).
    Kept beside the tail (``_Derived.held``: [settings, bar, the tail's length, how many more points]),
    derived, never serialized; none kept when no point is proven."""
    w = settings.loss_window
    kept = _derived(tail)
    ordered = kept.sorted.get(w) if kept.ends.get(w) == len(tail.points) else None
    if ordered is None or len(ordered) != w:
        kept.held = None
        return
    most = -1
    for m in range(0, (w - 1) // 2 + 1):
        if not ordered[(w - 1) // 2 - m] >= bar:
            break
        most = m
    kept.held = [settings, bar, len(tail.points), most] if most >= 1 else None


def _level_held(tail: Optional[SeriesTail], bar: float, settings: DetectionSettings) -> bool:
    """Whether :func:`_hold_level`'s bound covers the tail's last ``loss_window`` points now: the same
    tail, settings and bar, at most that many points taken in since -- then the window's median is at
    least ``bar`` and :func:`_curve_cleared`'s window test cannot clear the plateau (its median and the
    kept sorted window are not needed: the window is sorted anew when a rule next reads it)."""
    if tail is None:
        return False
    kept: Optional[_Derived] = tail.windows.get("loss")
    held = kept.held if kept is not None else None
    if kept is None or held is None:
        return False
    if held[0] is settings and held[1] == bar and held[2] < len(tail.points) <= held[2] + held[3]:
        return True
    kept.held = None
    return False


def _track_level(state: Dict[str, Any], series: Sequence[Tuple[int, float, int]],
                 tuned: LossGradientSettings) -> None:
    """Fold the newest rolling-median level into the lowest level seen (streaming: a few numbers). The
    level is :func:`_median_of` the last ``rise_smooth`` points, bit for bit (the same sort, the middle
    value or the mean of the two middle ones), taken inline: once per loss value."""
    width = tuned.rise_smooth
    if len(series) < width:
        return
    ordered = sorted(map(_VALUE, series[-width:]))
    half = width // 2
    level = ordered[half] if width % 2 else (ordered[half - 1] + ordered[half]) / 2
    state["levels"] = state.get("levels", 0) + 1
    best = state.get("best")
    if best is None or level < best:
        state["best"], state["best_step"] = level, series[-half - 1][0]
    state["level"] = level


_VALUE: Final = itemgetter(1)


def _median_of(points: Sequence[Tuple[int, float, int]]) -> float:
    """``statistics.median`` of the points' values, bit for bit (the same stable sort of the values in
    time order, the same middle or mean of the two middle ones), without building the value list first;
    NaN when empty, as :func:`robust.median`."""
    return robust.median_sorted(sorted(map(_VALUE, points)))


def _loss_series(rank: RankState, name: str, most: int, upto: int, init: List[float]
                 ) -> Tuple[Sequence[Tuple[int, float, int]], Optional[SeriesTail], float]:
    """``recent(rank, name, most, upto)``, its :func:`_exact_tail` and :func:`_initial` of ``init`` (the
    run's initial level), in one pass when recent() would answer with a plain slice of the series' tail
    (its fast path: the tail current, its last ``most`` points finite and in step order, none past
    ``upto``) -- then that tail is the exact one -- and the tail keeps the level of this ``init``; else
    the three calls. Once per loss value."""
    tail = rank.tails.get(name)
    if tail is not None and most >= 1:  # (recent()'s own guard: most < 1 answers nothing -- hR2's L2)
        points = tail.points
        n = len(points)
        if n and n == len(tail.data) and tail.data is rank.history.get(name):
            start = n - most if n > most else 0
            if start >= tail.bad_end and start >= tail.descent and points[-1][0] <= upto:
                kept: Optional[_Derived] = tail.windows.get("loss")
                if kept is not None and kept.init is init and kept.init_len == len(init):
                    return points[-most:], tail, kept.initial
                return points[-most:], tail, _initial(init, tail)
    series = recent(rank, name, most, upto)
    tail = _exact_tail(rank, name, series)
    return series, tail, _initial(init, tail)


def _exact_tail(rank: RankState, name: str, series: Sequence[Tuple[int, float, int]]) -> Optional[SeriesTail]:
    """The tail of ``name`` when ``series`` -- :func:`recent`'s answer for it -- is exactly the tail's last
    ``len(series)`` points (the usual case: no non-finite or out-of-order point among them), else None.
    (Those points are finite, in step order and at steps <= the last one's, so recent() kept every one of
    them, in that order, and no other.)"""
    tail = rank.tails.get(name)
    if tail is None or not series:
        return None
    points = tail.points
    start = len(points) - len(series)
    if start < tail.bad_end or start < tail.descent or series[-1] is not points[-1]:
        return None
    return tail


class _Derived(Shiftable):
    """What the loss curve keeps beside its series' tail (``SeriesTail.windows["loss"]``; derived, never
    serialized, dropped with the tail): per window width, the sorted values of the tail's last ``width``
    points as of ``len(points)`` = ``ends[width]``, updated point by point; and the initial level with
    the ``init`` list (and length) it was taken from; per window width whose trend was asked for,
    ``kendall[width]`` = [``len(points)`` it holds for, the Mann-Kendall S, the tie correction, points slid
    since last asked for] of that window, slid along with the sorted values (:func:`_sorted_window`,
    :func:`_kept_trend`) until ``KENDALL_IDLE`` points passed unasked; ``blocks``: the plateau rule's
    block medians by the index of the block's first point (:func:`_kept_block_slope`)."""

    def __init__(self) -> None:
        self.quiet: Optional[_Quiet] = None
        self.blocks: Dict[int, Tuple[float, float]] = {}
        self.held: Optional[List[Any]] = None
        self.ends: Dict[int, int] = {}
        self.sorted: Dict[int, List[float]] = {}
        self.kendall: Dict[int, List[int]] = {}
        self.init: Optional[List[float]] = None
        self.init_len = 0
        self.initial = math.nan


    def shifted(self, drop: int) -> bool:
        """After a trim of the history (:meth:`SeriesTail.trimmed`: the tail's first ``drop`` points gone,
        the others as they were): every kept index moved back by ``drop``. A sorted window (and its S) or a
        held level whose window reached into the dropped points, a quiet certificate taken on such a window
        and the blocks that began there go (they would be taken anew); the rest stays valid as it was -- it
        depends only on the points' values and order, and those did not change. True: keep it."""
        for width in [w for w, end in self.ends.items() if end - drop < w]:
            del self.ends[width]
            del self.sorted[width]
        for width, end in self.ends.items():
            self.ends[width] = end - drop
        for width in list(self.kendall):
            mk = self.kendall[width]
            if mk[0] - drop < width:
                del self.kendall[width]
            else:
                mk[0] -= drop
        quiet = self.quiet
        if quiet is not None:
            if quiet.at - drop < quiet.settings.loss_window:
                self.quiet = None
            else:
                quiet.at -= drop
                quiet.checked -= drop
        held = self.held
        if held is not None:
            if held[2] - drop < held[0].loss_window:
                self.held = None
            else:
                held[2] -= drop
        if self.blocks:
            self.blocks = {at - drop: block for at, block in self.blocks.items() if at >= drop}
        return True


def _derived(tail: SeriesTail) -> _Derived:
    kept: Optional[_Derived] = tail.windows.get("loss")
    if kept is None:
        kept = tail.windows["loss"] = _Derived()
    return kept


def _sorted_window(tail: SeriesTail, width: int) -> List[float]:
    """``sorted()`` of the values of the tail's last ``width`` points, bit for bit, for a tail whose last
    ``width`` points are finite (the caller's :func:`_exact_tail`): kept from the last one asked for by one
    removal and one insertion per point that arrived since (each of them in the window; one, when asked on
    every point -- an open plateau's window test may skip points, :func:`_level_held`), else sorted anew.
    The same list as sorted()'s, order of equal values included (0.0 / -0.0): sorted() is stable (equal
    values in time order), the value that leaves is the window's oldest -- the first of its equals, where
    bisect_left finds it -- and the one that enters is the newest, placed after its equals (insort_right).
    The list is the cache's: read it, never keep or change it (the next point changes it). A Mann-Kendall S
    kept for the width (:func:`_kept_trend`) slides with it (the comment below says how)."""
    kept: _Derived = tail.windows.get("loss") or _derived(tail)  # (typed: its fields read natively)
    points = tail.points
    n = len(points)
    end = kept.ends.get(width)
    if end is not None:
        ordered = kept.sorted[width]
        if end == n:
            return ordered
        if end >= width and n - end <= width:  # (the points since are in the window: finite)
            mk = kept.kendall.get(width)
            for at_end in range(end, n):  # one slide a point taken in since (one, when asked every point)
                new = points[at_end][1]
                if new - new != 0.0:  # (cannot be in a window of finite points; sorted anew below)
                    break
                old = points[at_end - width][1]
                at = robust.bisect_left_of(ordered, old)
                del ordered[at]
                if mk is None:
                    ordered.insert(robust.bisect_right_of(ordered, new), new)  # (insort_right)
                elif mk[0] == at_end and mk[3] < KENDALL_IDLE:
                    # slide the kept [_, S, ties, _] by one point, inline (once per loss value): ``ordered``
                    # now holds the values both windows share. S of a window is S of those plus each end
                    # value's signs against them (the oldest value comes before every other, the newest
                    # after): S' = S - (#above old - #below old) + (#below new - #above new), counted by
                    # bisection -- for finite floats a - b > 0 exactly when a > b, as robust.kendall_s
                    # counts. The tie correction moves by the two values' groups, counted the same way
                    # (equal under <: the same groups as a dict's keys, 0.0 and -0.0 together): a group of
                    # t equal shared values weighs (t + 1) t (2 t + 7) - t (t - 1) (2 t + 5) = 6 t (t + 2)
                    # more with the end value than without it.
                    m = len(ordered)
                    old_hi = robust.bisect_right_of(ordered, old, at)
                    new_lo = robust.bisect_left_of(ordered, new)
                    new_hi = robust.bisect_right_of(ordered, new, new_lo)
                    mk[1] += new_lo - (m - new_hi) - (m - old_hi) + at
                    old_ties, new_ties = old_hi - at, new_hi - new_lo
                    if old_ties or new_ties:
                        mk[2] += 6 * (new_ties * (new_ties + 2) - old_ties * (old_ties + 2))
                    mk[0] = at_end + 1
                    mk[3] += 1
                    ordered.insert(new_hi, new)  # insort_right's place
                else:  # stale, or not asked for lately: counted anew if asked again
                    del kept.kendall[width]
                    mk = None
                    ordered.insert(robust.bisect_right_of(ordered, new), new)  # (insort_right)
            else:
                kept.ends[width] = n
                return ordered
    ordered = kept.sorted[width] = sorted(map(_VALUE, points[-width:]))
    kept.ends[width] = n
    return ordered


def _kept_trend(tail: SeriesTail, width: int) -> robust.MannKendall:
    """``robust.mann_kendall`` of the values of the tail's last ``width`` points (``width`` >=
    ``SORTED_WINDOW_MIN``, a tail whose last ``width`` points are finite: :func:`_last_sorted`'s case), bit
    for bit: the same S and tie correction (integers), kept from the previous point's window by
    :func:`_sorted_window` once asked for, else counted anew."""
    _sorted_window(tail, width)  # (slides a kept S to the tail's end)
    kept = _derived(tail)
    n = len(tail.points)
    mk = kept.kendall.get(width)
    if mk is None or mk[0] != n:
        values = list(map(_VALUE, tail.points[-width:]))
        mk = kept.kendall[width] = [n, robust.kendall_s(values), robust.kendall_ties(values), 0]
    else:
        mk[3] = 0
    return robust.mann_kendall_of(width, mk[1], mk[2])


KENDALL_IDLE: Final = 16
"""Points a kept Mann-Kendall S slides unasked before it is let go (:func:`_sorted_window`). An open curve
incident's trend is asked every ``loss_window // 4`` values (10 by default): sliding S that far costs less
than counting it anew over a window of 40 (callgrind, env500); much further, more."""

SORTED_WINDOW_MIN = 16
"""Windows at least this wide are kept sorted point by point (:func:`_sorted_window`); a narrower one
(the rolling level's ``rise_smooth`` values) sorts faster than the bookkeeping costs."""


def _last_sorted(series: Sequence[Tuple[int, float, int]], width: int, tail: Optional[SeriesTail]
                 ) -> List[float]:
    """The values of ``series[-width:]``, sorted: :func:`_sorted_window`'s list (read only) when ``tail``
    is ``series``'s exact tail, the series has ``width`` points and ``width`` >= ``SORTED_WINDOW_MIN``,
    else a new sorted list."""
    if tail is not None and width >= SORTED_WINDOW_MIN and len(series) >= width:
        return _sorted_window(tail, width)
    return sorted(map(_VALUE, series[-width:]))


def _median_last(series: Sequence[Tuple[int, float, int]], width: int, tail: Optional[SeriesTail]) -> float:
    """``_median_of(series[-width:])``, bit for bit (:func:`_last_sorted`)."""
    return robust.median_sorted(_last_sorted(series, width, tail))


def _initial(init: List[float], tail: Optional[SeriesTail]) -> float:
    """``robust.median(init)`` (the run's initial loss level), taken once per ``init`` list and length
    while the series' tail lasts (``init`` stops growing once it holds ``loss_baseline_points`` values)."""
    if tail is None:
        return robust.median(init)
    kept: _Derived = tail.windows.get("loss") or _derived(tail)  # (typed: its fields read natively)
    if kept.init is not init or kept.init_len != len(init):
        kept.init, kept.init_len, kept.initial = init, len(init), robust.median(init)
    return kept.initial


class _Window:
    """The last ``size`` loss values, with their statistics -- and their step and value lists -- computed
    once, when first asked for (most values are judged on the median and the first and last steps).
    ``source``: ``series``'s exact tail (:func:`_exact_tail`), whose sorted window is taken for
    :attr:`ordered` instead of a sort."""

    def __init__(self, series: Sequence[Tuple[int, float, int]], size: int,
                 source: Optional[SeriesTail] = None) -> None:
        n = len(series)
        self.full = n >= size
        self._series = series
        self._size = size
        self._source = source
        self._points: Optional[Sequence[Tuple[int, float, int]]] = None
        self.first_step = series[-size][0] if self.full else (series[0][0] if n else -1)
        self.last_step = series[-1][0] if n else -1
        self._steps: Optional[List[int]] = None
        self._values: Optional[List[float]] = None
        self._median: Optional[float] = None
        self._ordered: Optional[List[float]] = None
        self._cv: Optional[float] = None
        self._trend: Optional[robust.MannKendall] = None

    @property
    def _tail(self) -> Sequence[Tuple[int, float, int]]:
        if self._points is None:
            self._points = self._series[-self._size:]
        return self._points

    @property
    def steps(self) -> List[int]:
        if self._steps is None:
            self._steps = [s for s, _v, _t in self._tail]
        return self._steps

    @property
    def values(self) -> List[float]:
        if self._values is None:
            self._values = [v for _s, v, _t in self._tail]
        return self._values

    @property
    def median(self) -> float:
        if self._median is None:
            # _median_of's value, bit for bit, from the sorted values kept for the rank test
            self._median = robust.median_sorted(self.ordered)
        return self._median

    @property
    def ordered(self) -> List[float]:
        """The window's values, sorted (once; read only)."""
        if self._ordered is None:
            self._ordered = _last_sorted(self._series, self._size, self._source) if self.full else \
                sorted(map(_VALUE, self._tail))
        return self._ordered

    @property
    def cv(self) -> float:
        """``robust.robust_cv(self.values)``, bit for bit, from the sorted values (the median and the
        sorted absolute deviations of a multiset of finite values do not depend on its order)."""
        if self._cv is None:
            ordered = self.ordered
            med = robust.median_sorted(ordered)
            spread = robust.MAD_TO_SIGMA * robust.median_sorted(sorted([abs(v - med) for v in ordered]))
            self._cv = 0.0 if spread == 0.0 else (spread / abs(med) if med != 0.0 else math.inf)
        return self._cv

    def cv_under(self, bar: float) -> bool:
        """True when :attr:`cv` < ``bar`` is certain from the window's range, without the sorted
        deviations (False: not proven -- ask :attr:`cv`). Each deviation |v - median| is at most
        ``d`` = max(largest - median, median - smallest) (float subtraction is monotone, and its
        rounding symmetric), so is their median (the middle one, or the mean of two such: at most
        ``d``), and MAD_TO_SIGMA x it / |median| is at most MAD_TO_SIGMA x ``d`` / |median| (products and
        quotients of positives round monotonically); cv is that, or 0.0 when the spread is 0."""
        if self._cv is not None:
            return self._cv < bar
        ordered = self.ordered
        med = self.median
        if not med != 0.0 or not ordered:
            return False
        d = max(ordered[-1] - med, med - ordered[0])
        return (robust.MAD_TO_SIGMA * d) / abs(med) < bar

    def slope_bound(self) -> float:
        """An upper bound on abs(:attr:`block_slope`) without the pairwise slopes (the plateau rule's
        size test needs only "at most this"): from the kept blocks (:func:`_kept_block_slope_bound`)
        when ``source`` is the series' exact tail and the window is full, else inf (not proven)."""
        source = self._source
        if source is not None and self.full:
            return _kept_block_slope_bound(source, self._size)
        return math.inf

    @property
    def block_slope(self) -> float:
        """``_block_slope(self.steps, self.values)``, bit for bit: from the tail's kept block medians
        (:func:`_kept_block_slope`) when ``source`` is the series' exact tail and the window is full, else
        from the window's step and value lists."""
        source = self._source
        if source is not None and self.full:
            return _kept_block_slope(source, self._size)
        return _block_slope(self.steps, self.values)

    @property
    def trend(self) -> robust.MannKendall:
        if self._trend is None:
            source = self._source
            self._trend = _kept_trend(source, self._size) if source is not None and self.full and \
                self._size >= SORTED_WINDOW_MIN else robust.mann_kendall(self.values)
        return self._trend


def _median4(four: Sequence[float]) -> float:
    """``statistics.median`` of exactly four numbers, bit for bit (the mean of the two middle ones of the
    same sort), without its call overhead: the plateau rule takes ~20 of these per judged window."""
    ordered = sorted(four)
    return (ordered[1] + ordered[2]) / 2


def _block_slope(steps: Sequence[int], values: Sequence[float]) -> float:
    """``robust.theil_sen``'s slope, bit for bit, through the medians (:func:`_median4`) of the blocks of 4
    of ``steps`` / ``values`` (a trailing part block left out), without its intercept. ``steps`` rise
    strictly (a loss series is by step, one value a step), so a block's step median is the mean of its
    two middle steps as they stand, and no two blocks share a step median."""
    xs = [(steps[i + 1] + steps[i + 2]) / 2 for i in range(0, len(values) - 3, 4)]
    ys = [_median4(values[i:i + 4]) for i in range(0, len(values) - 3, 4)]
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs) - 1) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return robust.median(slopes) if slopes else 0.0


def _kept_blocks(tail: SeriesTail, width: int) -> Tuple[List[float], List[float]]:
    """The block step medians ``xs`` and value medians ``ys`` of the tail's last ``width`` points, in
    :func:`_block_slope`'s order, from the blocks kept beside the tail (``_Derived.blocks``, by the index of
    a block's first point; a block not met before is taken and kept; those before the window dropped once
    more than the four alignments of a window are kept)."""
    blocks = _derived(tail).blocks
    points = tail.points
    n = len(points)
    start = n - width
    if len(blocks) > 4 * (width // 4) + 4:  # (the blocks of the four alignments of a window, at most)
        for old in [k for k in blocks if k < start]:
            del blocks[old]
    xs: List[Any] = []  # (floats)
    ys: List[Any] = []
    kept: Dict[Any, Any] = blocks  # (each block's two floats read as the objects kept: none made again)
    for at in range(start, n - 3, 4):
        block = kept.get(at)
        if block is None:
            p0, p1, p2, p3 = points[at:at + 4]
            block = blocks[at] = ((p1[0] + p2[0]) / 2, _median4((p0[1], p1[1], p2[1], p3[1])))
        xs.append(block[0])
        ys.append(block[1])
    return xs, ys


def _kept_block_slope(tail: SeriesTail, width: int) -> float:
    """:func:`_block_slope` of the steps and values of the tail's last ``width`` points (a tail whose last
    ``width`` points are finite and in step order: :func:`_exact_tail`), bit for bit. A block's step and
    value medians depend on its 4 points alone, so they are kept beside the tail by the index of the
    block's first point (``_Derived.blocks``; the tail's points never move while it lasts) and taken
    again only for a block not met before: a window that moved on by a multiple of 4 points shares the
    blocks of the overlap (an open incident's window, judged every ``loss_window // 4`` values, every
    second time; a window judged on every value, every fourth). The same xs and ys in the same order as
    :func:`_block_slope` builds them, then the same slopes and median."""
    xs, ys = _kept_blocks(tail, width)
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs) - 1) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return robust.median(slopes) if slopes else 0.0


def _kept_block_slope_bound(tail: SeriesTail, width: int) -> float:
    """An upper bound on abs(:func:`_kept_block_slope` (tail, width)), from the same kept blocks (taken, and
    dropped, as it takes them): the block step medians ``xs`` and value medians ``ys`` it would read; when
    ``xs`` rise strictly, every pair's step gap is at least the smallest gap of neighbours, ``g`` (float
    subtraction is monotone), every pair's value change at most max(ys) - min(ys), so every slope is at
    most (max(ys) - min(ys)) / ``g`` in size (quotients of positives round monotonically) and so is their
    median (one of them, or the mean of two: between them). 0.0 with fewer than two blocks (no slope: the
    slope is 0.0); inf when ``xs`` do not rise strictly (not proven)."""
    xs, ys = _kept_blocks(tail, width)
    if len(xs) < 2:
        return 0.0
    gap = math.inf
    for i in range(len(xs) - 1):
        step = xs[i + 1] - xs[i]
        if not step > 0:
            return math.inf
        if step < gap:
            gap = step
    return (max(ys) - min(ys)) / gap


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _oscillation_calmed(run: RunState, rank: RankState, win: _Window, initial: float, state: Dict[str, Any],
                        step: int, time_ns: int, settings: DetectionSettings) -> bool:
    """Whether the open oscillation of ``rank`` has stopped, resolving it then (the condition cleared): a
    full ``loss_window``'s robust spread under ``oscillation_calm_min_cv`` (the lowest spread that swings,
    whatever the run's own noise: a spread just under the run's swing bar is still swings, dev r611) on
    ``oscillation_held_points`` values in a row, with the window's level back in the band (under
    ``divergence_factor`` x the initial level: calm far above it is :func:`_oscillation_held_high`'s).
    The level test alone (:func:`_curve_cleared`) asks the level to fall 20 % below where it was when the
    swings opened -- a loss whose swings die down back near its start (a warmup's peak LR passed) may
    settle only a little lower, and the oscillation stayed open to the end. Then every curve rule is
    judged again (a flat loss there is the plateau rule's)."""
    if not win.full:
        return False
    calm = win.cv < settings.oscillation_calm_min_cv and win.median < settings.divergence_factor * initial
    count = state["calm"] = state.get("calm", 0) + 1 if calm else 0
    if count < settings.oscillation_held_points:
        return False
    state["calm"] = 0
    why = (f"rank {rank.rank}: the loss stopped swinging -- its robust spread has stayed under "
           f"{settings.oscillation_calm_min_cv:.3g} of its level for {settings.oscillation_held_points} "
           f"values, at {fmt_number(win.median)}: the condition cleared")
    return _oscillation_gives_way(run, state, time_ns, step, rank.rank, why, settings)


def _check_oscillation(rank: RankState, name: str, series: Sequence[Tuple[int, float, int]], win: _Window,
                       initial: float, state: Dict[str, Any], settings: DetectionSettings,
                       tuned: LossGradientSettings, explain: bool) -> _Check:
    if not win.full:
        return _NOT_HOLDING
    # the first value is the untrained model's loss: a far-too-high LR moves the loss from the first
    # update on, so the initial median may already be part of the swings -- unless the loss's level has
    # since been at or below that first value: then it was one lucky batch (a small, noisy batch), not a
    # level the run swings above
    first = state["init"][0]
    if state.get("best", math.inf) > first:
        initial = min(initial, first)
    if win.median < tuned.oscillation_min_level * initial or win.cv < _swing_bar(state, tuned):
        return _NOT_HOLDING
    if _held_out_of_band(rank, name, win, state, tuned):
        return _NOT_HOLDING  # swings that never come back into the band: the divergence rule's
    if _rose_from_start(state, win, tuned):
        return _NOT_HOLDING  # swings on a level that keeps climbing: a rising loss, not one that swings
    if _fell_since_swings_began(state, win, tuned):
        return _NOT_HOLDING  # noise on a level still falling: a loss converging, not one that swings
    trend = win.trend
    ratio = win.median / initial if initial > 0 else math.inf
    if abs(trend.z) >= tuned.trend_z or _optimisation_stuck(rank, state, win.first_step, win.last_step,
                                                             settings, ratio, swings=True):
        return _NOT_HOLDING  # swings while nothing moves the weights are the batches' noise: a plateau
    if not explain:
        return _Check(True, since=win.first_step)
    steps, values, med, cv = win.steps, win.values, win.median, win.cv
    lo, hi = min(values), max(values)
    level = med / initial if initial else math.inf  # an initial loss of exactly 0: any level is above it
    bar = _swing_bar(state, tuned)
    own = (f", {tuned.oscillation_noise_factor:g}x the run's early spread {state['early_cv']:.3f}"
           if bar < tuned.oscillation_min_cv else "")
    description = (f"{name} over steps {steps[0]}-{steps[-1]}: robust spread {cv:.2f} of its median "
                   f"{fmt_number(med)} (>= {bar:.3g}{own}), median {level:.2f}x the initial "
                   f"level {fmt_number(initial)} (>= {tuned.oscillation_min_level:g}x), no trend "
                   f"(Mann-Kendall z = {trend.z:.2f}, |z| < {tuned.trend_z:g})")
    summary = (f"{name} has been swinging between {fmt_number(lo)} and {fmt_number(hi)} (spread {cv:.2f} of "
               f"its level) since step {{since}} without a downward trend, at {level:.2f}x where it started"
               + _braces(lr_span(rank, steps[0], steps[-1]))
               + ": typical of a learning rate too high for the batch size, or of label noise.")
    return _Check(True, since=steps[0], detail=f"swinging {fmt_number(lo)}-{fmt_number(hi)}", summary=summary,
                  evidence=[Evidence(rule="loss.oscillation", description=description, step=steps[0],
                                     time_ns=point_time(rank, name, steps[0], 0), rank=rank.rank, metric=name,
                                     threshold=bar, value=wire_float(cv),
                                     window=window(rank, name, steps[-1], settings.evidence_window))])


def _swings_shaped(win: _Window, initial: float, state: Dict[str, Any], tuned: LossGradientSettings,
                   rank: Optional[RankState] = None) -> bool:
    """Whether a window on which the oscillation rule holds swings with a shape, so that it may OPEN an
    oscillation: a window whose upper tail is light (its 0.9 quantile under ``oscillation_heavy_tail`` x its
    median) swings as before; a heavy-tailed one only when the lag-1 autocorrelation of its values' ranks
    (in step order) is at least ``oscillation_min_serial`` in size -- the loss wanders in runs or
    alternates -- or its lower quartile is at least ``oscillation_iid_level`` x the rule's initial level
    (the lower of the initial level and the first value unless the loss has been at or below that value).
    Off unless ``oscillation_min_serial`` > 0 (the default is off: docs/detectors.md). Independent draws
    of a heavy-tailed loss (tiny batches, noisy labels, sparse rewards) near where the run started
    spread as wide as an LR's swings but have no such order (stop 44). Judged only when the rest of the
    rule holds (rare): one sort of ``loss_window`` values."""
    bar = tuned.oscillation_min_serial
    if not bar > 0:
        return True
    ordered = win.ordered
    n = len(ordered)
    if ordered[min(n - 1, int(0.9 * n))] < tuned.oscillation_heavy_tail * win.median:
        return True  # a spread without a heavy upper tail: swings as before stop 44 (the corpus's LR swings)
    first = state["init"][0]
    if state.get("best", math.inf) > first:
        initial = min(initial, first)
    if ordered[n // 4] >= tuned.oscillation_iid_level * initial:
        return True  # its lower quartile that far above the start: the whole window was thrown up
    early = state.get("early_cv")
    new_bar = tuned.oscillation_shape_new_factor
    if new_bar > 0 and (early is None or win.cv >= new_bar * early):
        return True  # a run that started calmer than it swings now: the swings are new, not its own noise
    layers: Optional[Dict[str, Any]] = rank_state(rank).get("layers") if rank is not None else None
    if new_bar > 0 and layers and layers.get("zero") and layers.get("died"):
        return True  # units the updates killed: steps too large, which throw the live layers about too
    return abs(_lag1_rank_autocorrelation(win.values)) >= bar


def _lag1_rank_autocorrelation(values: Sequence[float]) -> float:
    """The lag-1 autocorrelation of the ranks of ``values`` (ties broken by position): ~0 for independent
    draws whatever their distribution, > 0 when the values run in stretches, < 0 when they alternate.
    0.0 for fewer than 3 values."""
    n = len(values)
    if n < 3:
        return 0.0
    ranks = [0.0] * n
    for r, i in enumerate(sorted(range(n), key=values.__getitem__)):
        ranks[i] = r - (n - 1) / 2.0
    den = sum(r * r for r in ranks)
    return sum(ranks[i] * ranks[i + 1] for i in range(n - 1)) / den if den > 0 else 0.0


def _rose_from_start(state: Dict[str, Any], win: _Window, tuned: LossGradientSettings) -> bool:
    """Whether the window's level rose from where the run started swinging: its median above
    ``oscillation_max_rise`` x the level of the run's first full ``loss_window`` (``state["start_level"]``)
    and x its initial level (a first window of lucky batches near 0, dev r678, is not where it started),
    and its values significantly higher than that window's (``state["start_values"]``; a one-sided
    Mann-Whitney rank test, z >= ``trend_z``). Inside one window a loss swinging on a climbing level shows
    no trend -- the swings (a cyclic LR's cycles, an LR far too high) hide it -- but window after window it
    climbs: it is still rising, not swinging around a level (the same "no trend relative to where the run
    started" that :func:`_divergence_settled` asks of a divergence that settles into swings, and the
    corpus label's oscillation rule asks of its second half against its early steps)."""
    start, ref = state.get("start_level"), state.get("start_values")
    if start is None or not ref or not win.median > tuned.oscillation_max_rise * max(start, robust.median(
            state["init"])):
        return False
    return _rank_z_above(ref, win.ordered) >= tuned.trend_z


def _fell_since_swings_began(state: Dict[str, Any], win: _Window, tuned: LossGradientSettings) -> bool:
    """Whether the window's level fell from the run's first full ``loss_window``: its median under
    ``oscillation_min_fall`` x that window's level (``state["start_level"]``) and its values significantly
    lower than that window's (rank test, z >= ``trend_z``) -- the downward counterpart of
    :func:`_rose_from_start`. A classifier that learns slowly on tiny batches gets noisier as it learns
    (its per-batch loss spreads as predictions sharpen): window by window the level falls, inside one
    window the noise hides it. A loss still falling is converging, not swinging around a level (the
    corpus label's "no downward trend" of its second half against its early steps)."""
    start, ref = state.get("start_level"), state.get("start_values")
    if start is None or not ref or not win.median < tuned.oscillation_min_fall * start:
        return False
    return _rank_z_above(ref, win.ordered) <= -tuned.trend_z


def _rank_z_above(ref: Sequence[float], ordered: Sequence[float]) -> float:
    """Mann-Whitney z of the sorted values ``ordered`` against the sorted ``ref``: > 0 when they tend
    higher, < 0 lower, 0.0 when either is empty (the one rank test of _fell_from_start, _rose_from_start
    and _fell_since_swings_began)."""
    n1, n2 = len(ref), len(ordered)
    spread = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)
    if not spread > 0:
        return 0.0
    return (_rank_higher(ref, ordered) - n1 * n2 / 2.0) / spread


def _rank_higher(ref: Sequence[float], ordered: Sequence[float]) -> float:
    """The pairs (reference value, value) of the sorted ``ref`` and ``ordered`` in which the value is the
    higher one, ties counting a half (the Mann-Whitney count of :func:`_rank_z_above`; exact: a sum of
    halves). One value of ``ordered`` is in at most ``len(ref)`` of them."""
    n2 = len(ordered)
    higher = 0.0
    if ordered[-1] >= ref[0]:  # else every value is under every reference value: no such pair
        for v in ref:  # a few bisections of the sorted values, not one per value
            hi = bisect_right(ordered, v)
            higher += (n2 - hi) + 0.5 * (hi - bisect_left(ordered, v))
    return higher


def _swing_bar(state: Dict[str, Any], tuned: LossGradientSettings) -> float:
    """The robust spread from which a loss window swings (the oscillation rule's, and what keeps the
    plateau rule off): ``oscillation_min_cv`` -- or, judged against the run's own noise, as low as
    ``oscillation_noise_factor`` x the robust spread of its first 2 x ``loss_baseline_points`` values
    (``state["early_cv"]``), never below ``oscillation_calm_min_cv``: a run whose loss was calm at the
    start and swings at 4x that spread swings, even under the fixed bar."""
    early = state.get("early_cv")
    if early is None:
        return tuned.oscillation_min_cv
    own = tuned.oscillation_noise_factor * early
    return max(tuned.oscillation_calm_min_cv, min(tuned.oscillation_min_cv, own))


def _check_rise(rank: RankState, name: str, series: Sequence[Tuple[int, float, int]], win: _Window,
                initial: float, state: Dict[str, Any], settings: DetectionSettings,
                tuned: LossGradientSettings, explain: bool) -> _Check:
    best, best_step, level = state.get("best"), state.get("best_step", -1), state.get("level")
    if best is None or level is None:
        return _NOT_HOLDING
    # where it started: the first value (the untrained model) when the first values already fell fast
    initial = max(initial, state["init"][0])
    fall = initial - best
    rise = level - best
    if fall < tuned.rise_min_fall * initial or rise < tuned.rise_min_rise * fall:
        return _NOT_HOLDING
    # a rebound from a level the run reached: the fall held over rise_held_points values (the lowest
    # median of that many in a row), not only in the rolling level -- a swinging loss's rolling median
    # dips far on a run of low batches without the run ever having been there. A held rebound (below:
    # a calm window) needs only rise_calm_min_fall of it: calm after a fall held that far is a level the
    # run reached and lost, which a swinging loss's dip is not (its window is not calm)
    held_fall = initial - state.get("best_held", initial)
    if held_fall < min(tuned.rise_min_fall, tuned.rise_calm_min_fall) * initial:
        return _NOT_HOLDING
    longer = recent(rank, name, 2 * tuned.loss_window, series[-1][0])
    after = [(s, v) for s, v, _t in longer if s >= best_step]
    if len(after) < tuned.rise_min_points:
        return _NOT_HOLDING
    most = 2 * tuned.loss_window
    if len(after) > most:  # keep the test bounded: an even subsample, first and last kept
        after = [after[round(i * (len(after) - 1) / (most - 1))] for i in range(most)]
    trend = robust.mann_kendall([v for _s, v in after])
    # or a rebound the trend test no longer sees (a step up, or a spike settling on a high level, older
    # than the window): the whole window sits calm above the bar -- its lower quartile >= best +
    # rise_min_rise x the fall, its spread under the oscillation rule's bar (swings there are that rule's)
    # -- a level the run had fallen far below, held (it learned, then lost it), not a plateau
    held = trend.z < tuned.trend_z and win.full and best_step < win.first_step and \
        _lower_quartile(win.values) >= best + tuned.rise_min_rise * fall and win.cv < _swing_bar(state, tuned)
    if trend.z < tuned.trend_z and not held:
        return _NOT_HOLDING
    if held_fall < tuned.rise_min_fall * initial and not held:
        return _NOT_HOLDING
    if _grad_climbing(rank, series[-1][0], settings, tuned):
        return _Check(False, deferred=True)  # a rising loss with a climbing gradient: the explosion rule's
    if not explain:
        return _Check(True, since=best_step, held=held)
    now = series[-1][0]
    low = fmt_number(_lower_quartile(win.values))
    how = (f"the lower quartile of its last {len(win.values)} values {low} >= "
           f"{fmt_number(best + tuned.rise_min_rise * fall)}: held since before them" if held else
           f"Mann-Kendall z = {trend.z:.2f} >= {tuned.trend_z:g} over {trend.n} values")
    description = (f"{name} level (rolling median of {tuned.rise_smooth}) fell from {fmt_number(initial)} to "
                   f"{fmt_number(best)} at step {best_step} (a fall of {fall / initial:.0%} >= "
                   f"{tuned.rise_min_fall:.0%}), then rose to {fmt_number(level)} by step {now} "
                   f"({rise / fall:.2f}x the fall >= {tuned.rise_min_rise:g}x; {how})")
    summary = (f"{name} fell from {fmt_number(initial)} to {fmt_number(best)} by step {best_step}, then "
               f"turned and rose to {fmt_number(level)}" + _braces(lr_span(rank, best_step, now))
               + ": a too-high peak learning rate after warmup, a schedule that increases the LR, or "
                 "overfitting of noisy samples.")
    return _Check(True, since=best_step, held=held,
                  detail=f"up from {fmt_number(best)} to {fmt_number(level)}", summary=summary,
                  evidence=[Evidence(rule="loss.rise_after_fall", description=description, step=best_step,
                                     time_ns=point_time(rank, name, best_step, 0), rank=rank.rank,
                                     metric=name,
                                     threshold=tuned.rise_min_rise, value=rise / fall,
                                     window=window(rank, name, now, settings.evidence_window))])


def _lower_quartile(values: Sequence[float]) -> float:
    """The value a quarter of the way up the sorted ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 4]


def _check_divergence(rank: RankState, name: str, series: Sequence[Tuple[int, float, int]], win: _Window,
                      initial: float, state: Dict[str, Any], settings: DetectionSettings,
                      tuned: LossGradientSettings, explain: bool) -> _Check:
    level = state.get("level")
    base = divergence_base(initial, state["init"][0], tuned)
    blown = _blown_up(win, base, tuned)
    if blown is not None and not spike_claims(rank, blown[0], win.values[-1], settings):
        return _blowup_check(rank, name, blown, win, base, settings, tuned, explain)
    blown = _early_blowup_left_dead(state, win, base, tuned)
    if blown is not None:
        return _blowup_check(rank, name, blown, win, base, settings, tuned, explain, early=True)
    if level is None or base <= 0 or level < tuned.divergence_factor * base:
        return _NOT_HOLDING
    trend, cv = win.trend, win.cv
    bar = tuned.divergence_factor * base
    out_of_band = win.values[next((i for i, v in enumerate(win.values) if v >= bar), len(win.values)):]
    far = level >= tuned.divergence_far_factor * base and _grad_corroborates(rank, series[-1][0], settings) \
        and (_rising_since_left(win.values, bar) or (
            (state.get("opened") or {}).get("kind") != "divergence"
            and _grad_corroborates(rank, series[-1][0], settings, settings.explosion_jump_factor)))
    if not far and _roughness(out_of_band) >= tuned.oscillation_min_cv and (
            len(out_of_band) < 3 or robust.mann_kendall(out_of_band).z < tuned.trend_z) and \
            not _held_out_of_band(rank, name, win, state, tuned):
        return _NOT_HOLDING  # jumping from value to value with no upward trend since it left the band,
        #                       and back into it at times: the oscillation rule's (the jump itself is not
        #                       a trend, nor the swings' decay from a first far-too-large update)
    # (a loss coming back down but still far above its band is diverged until it is back: a spike of
    # a few bad batches does not hold the rolling level up for divergence_min_points values)
    if trend.z < tuned.trend_z and _optimisation_stuck(
            rank, state, win.first_step, win.last_step, settings,
            level / base if _held_out_of_band(rank, name, win, state, tuned) else 0.0):
        return _NOT_HOLDING  # nothing moves the weights (LR 0, dead units): the level is batch noise --
        #                       unless it rises significantly: noise has no trend (a too-high LR that
        #                       killed some units still drives the rest, and the loss, up). Nor do dead
        #                       units alone once the loss has not been back in its band for 2 windows
        #                       (_held_out_of_band, level / base >= divergence_factor: _optimisation_stuck):
        #                       a constant predictor sits about where it started (dev r717)
    centre = series[-(tuned.rise_smooth // 2) - 1][0] if len(series) > tuned.rise_smooth else series[-1][0]
    if not explain:
        return _Check(True, since=centre)
    now = series[-1][0]
    peak = max(win.values)
    clipped = ""
    if rank.history.get("grad/clip_triggered"):
        flags = [v for _s, v, _t in finite_series(rank, "grad/clip_triggered", now - 20, now)]
        if flags and sum(1 for v in flags if v >= 0.5) >= 0.5 * len(flags):
            clipped = (" Gradient clipping is on and triggers on most steps: it bounds each update's size, "
                       "not the damage of a far-too-high LR (do not raise max_norm).")
    description = (f"{name} level (rolling median of {tuned.rise_smooth}) {fmt_number(level)} = "
                   f"{level / base:.2f}x the initial level {fmt_number(base)} "
                   f"(>= {tuned.divergence_factor:g}x) on {tuned.divergence_min_points}+ values in a row, "
                   f"peak {fmt_number(peak)}; over the last {len(win.values)} values Mann-Kendall "
                   f"z = {trend.z:.2f}, robust spread {cv:.2f}")
    summary = (f"{name} left its starting band at step {{since}}: it is at {fmt_number(level)}, "
               f"{level / base:.1f}x where it started ({fmt_number(base)})"
               + _braces(lr_span(rank, win.steps[0], now))
               + ": the run is diverging -- most often a learning rate far too high for this model and "
                 "optimiser (or a warmup to a too-high peak, or an LR schedule that increases)." + clipped)
    return _Check(True, since=centre, detail=f"{fmt_number(level)}, {level / base:.1f}x its start",
                  summary=summary,
                  evidence=[Evidence(rule="loss.divergence", description=description, step=centre,
                                     time_ns=point_time(rank, name, centre, 0), rank=rank.rank, metric=name,
                                     threshold=tuned.divergence_factor, value=finite_or_none(level / base),
                                     window=window(rank, name, now, settings.evidence_window))])


def _blown_up(win: _Window, base: float, tuned: LossGradientSettings) -> Optional[Tuple[int, float]]:
    """The first ``(step, value)`` of the window whose loss is >= ``divergence_blowup_factor`` x ``base``
    (the run's first values included while they are in the window) once the latest value is back under
    that bar -- a blow-up the loss came back from -- or None (off at 0). A loss still up there is the far
    divergence's, the explosion's or, when it overflows, the non-finite rule's."""
    factor = tuned.divergence_blowup_factor
    if not factor > 0 or not base > 0:
        return None
    bar = factor * base
    if win.full and not win.ordered[-1] >= bar:
        return None  # the full window's largest value (its sorted values, kept) is under the bar: the scan's
        #              answer without building the window's step and value lists
    values = win.values
    if not values or not values[-1] < bar:
        return None
    return next(((s, v) for s, v in zip(win.steps, values) if v >= bar), None)


def _note_early_blowup(state: Dict[str, Any], step: int, value: float, tuned: LossGradientSettings,
                       base: float) -> None:
    """Count one of the run's first ``divergence_early_blowup_values`` loss values and remember the last one
    >= ``divergence_early_blowup_factor`` x the run's divergence ``base`` (``state["early_blowup"]``: [step,
    value, the step it was judged at or -1, whether it held]); the base is known once the first values are
    (the caller's: taken once for the first values, then from the kept initial level)."""
    state["seen"] = state.get("seen", 0) + 1
    factor = tuned.divergence_early_blowup_factor
    if not factor > 0 or not value - value == 0.0:
        return
    if base > 0 and value >= factor * base:
        state["early_blowup"] = [step, value, -1, False]


def _early_blowup_left_dead(state: Dict[str, Any], win: _Window, base: float,
                            tuned: LossGradientSettings) -> Optional[Tuple[int, float]]:
    """The early blow-up (:func:`_note_early_blowup`) when the first full window of values after it sat dead
    near the start -- its lower quartile >= ``plateau_min_level`` x ``base``, its median under
    ``divergence_factor`` x ``base`` -- judged once, on that window (the same answer for every rule that asks
    at that step), else None."""
    early = state.get("early_blowup")
    if early is None or not win.full or not win.steps[0] > early[0] or not base > 0:
        return None
    now = win.steps[-1]
    if early[2] < 0:
        ordered = win.ordered
        early[2] = now
        early[3] = ordered[len(ordered) // 4] >= tuned.plateau_min_level * base and \
            robust.median_sorted(ordered) < tuned.divergence_factor * base
    return (early[0], early[1]) if early[2] == now and early[3] else None


def _blowup_check(rank: RankState, name: str, blown: Tuple[int, float], win: _Window, base: float,
                  settings: DetectionSettings, tuned: LossGradientSettings, explain: bool,
                  early: bool = False) -> _Check:
    """The divergence rule's verdict on a blow-up: holds at once, from the blown-up value's step (``early``:
    one of the first updates', the loss left dead after it: :func:`_early_blowup_left_dead`)."""
    at, value = blown
    if not explain:
        return _Check(True, since=at, at_once=True)
    now = win.steps[-1]
    ratio = value / base
    if early:
        bar = (f"divergence_early_blowup_factor {tuned.divergence_early_blowup_factor:g}x on the run's first "
               f"{tuned.divergence_early_blowup_values} values; the {len(win.values)} values since sat dead "
               f"near it, median {fmt_number(robust.median_sorted(win.ordered))}, never under "
               f"{tuned.plateau_min_level:g}x it for a quarter of them")
    else:
        bar = f"divergence_blowup_factor {tuned.divergence_blowup_factor:g}x"
    description = (f"{name} reached {fmt_number(value)} at step {at} = {fmt_number(ratio)}x the run's "
                   f"initial level {fmt_number(base)} (>= {bar}): one value that far out is a blow-up, not "
                   f"noise; the loss is now {fmt_number(win.values[-1])}")
    summary = (f"{name} blew up at step {{since}}: {fmt_number(value)}, {fmt_number(ratio)}x where it "
               f"started ({fmt_number(base)})" + _braces(lr_span(rank, win.steps[0], now))
               + ": the updates were far too large for the model -- most often a learning rate far too high "
                 "for this model and optimiser. A loss that came back from it to a flat level near its start "
                 "is usually a dead model (saturated or dead units), not one that recovered.")
    return _Check(True, since=at, at_once=True, detail=f"blew up to {fmt_number(ratio)}x its start",
                  summary=summary,
                  evidence=[Evidence(rule="loss.blowup", description=description, step=at,
                                     time_ns=point_time(rank, name, at, 0), rank=rank.rank, metric=name,
                                     threshold=tuned.divergence_early_blowup_factor if early else
                                     tuned.divergence_blowup_factor, value=finite_or_none(ratio),
                                     window=window(rank, name, now, settings.evidence_window))])


def _held_out_of_band(rank: RankState, name: str, win: _Window, state: Dict[str, Any],
                      tuned: LossGradientSettings) -> bool:
    """Whether the loss has stayed out of its starting band -- every value >= ``divergence_factor`` x the
    run's :func:`divergence_base` -- over the window and the one before it (2 x ``loss_window`` values, as
    many as there are). Swings up there, however large, are not an oscillation: an oscillation swings
    around a level the run can still reach, back into the band at times (the corpus label rule, decided at
    stop 31); a loss thrown far above its start that swings there without ever coming back has diverged."""
    init = state["init"]
    bar = tuned.divergence_factor * divergence_base(robust.median(init), init[0], tuned)
    if not bar > 0 or min(win.values) < bar:
        return False
    return min(v for _s, v, _t in recent(rank, name, 2 * tuned.loss_window, win.last_step)) >= bar


def _rising_since_left(values: Sequence[float], bar: float, least: int = 3) -> bool:
    """Whether the trailing values at or above ``bar`` (since the loss last was below it) are at least
    ``least`` and each one higher than the one before: a loss climbing away from its band step after
    step (a geometric blow-up is rough -- each step ~doubles it -- but it is not swinging)."""
    n = 0
    for i in range(len(values) - 1, -1, -1):
        if values[i] < bar:
            break
        if i < len(values) - 1 and values[i] >= values[i + 1]:
            return False
        n += 1
    return n >= least


def _roughness(values: Sequence[float]) -> float:
    """Median |step-to-step change| / median level of ``values``: ~0.1 for a loss that moves smoothly
    (diverging, or coming back from a jump), >= 0.3 for one that swings from value to value."""
    if len(values) < 3:
        return 0.0
    level = robust.median(list(values))
    if level <= 0:
        return math.inf
    return robust.median([abs(b - a) for a, b in zip(values, values[1:])]) / level


def _divergence_points(rank: RankState, step: int, settings: DetectionSettings) -> int:
    """Values in a row a divergence must hold: ``divergence_corroborated_points`` when the rank's global
    grad norm grows with the loss (its latest reading >= ``explosion_onset_factor`` x the median of the
    earlier half of its readings in the last ``explosion_window_steps``, at least
    ``explosion_min_points`` of them), else ``divergence_min_points``. Two signals agreeing need less
    confirmation than one; a norm read every few steps gives the explosion rule too few readings to
    confirm a climb early, the loss's every-step level does not."""
    if _grad_corroborates(rank, step, settings):
        return min(settings.divergence_corroborated_points, settings.divergence_min_points)
    return settings.divergence_min_points


def _grad_corroborates(rank: RankState, step: int, settings: DetectionSettings,
                       factor: Optional[float] = None) -> bool:
    """Whether the rank's global grad norm grows with the loss at ``step``: its latest reading >=
    ``factor`` (default ``explosion_onset_factor``) x the median of the earlier half of its readings in
    the last ``explosion_window_steps`` (at least ``explosion_min_points`` of them)."""
    values = _grad_window(rank, step, settings)
    if len(values) < settings.explosion_min_points:
        return False
    baseline = climb_baseline(values)
    return baseline > 0 and values[-1] >= (factor or settings.explosion_onset_factor) * baseline


def _grad_window(rank: RankState, step: int, settings: DetectionSettings) -> List[float]:
    """The rank's global grad norm readings of the last ``explosion_window_steps`` up to ``step`` (empty
    when it reports none)."""
    gname = grad_metric(rank, settings)
    if gname is None:
        return []
    lo = step - settings.explosion_window_steps
    return [v for s, v, _t in recent(rank, gname, settings.explosion_window_steps + 1, step) if s >= lo]


def _grad_climbing(rank: RankState, step: int, settings: DetectionSettings,
                   tuned: LossGradientSettings) -> bool:
    """Whether the rank's gradient norm is climbing: the latest >= explosion_onset_factor x its running
    median, rising over the last explosion_trend_points values."""
    values = _grad_window(rank, step, settings)
    if len(values) < tuned.explosion_trend_points:
        return False
    baseline = climb_baseline(values)
    return baseline > 0 and values[-1] >= tuned.explosion_onset_factor * baseline and \
        robust.mann_kendall(values[-tuned.explosion_trend_points:]).z >= tuned.trend_z


def _check_plateau(rank: RankState, name: str, series: Sequence[Tuple[int, float, int]], win: _Window,
                   initial: float, state: Dict[str, Any], settings: DetectionSettings,
                   tuned: LossGradientSettings, explain: bool) -> _Check:
    if not win.full:
        return _NOT_HOLDING
    med = win.median
    start = min(initial, state["init"][0]) if state.get("init") else initial  # a spike at the start: no start
    if start > 0 and med <= tuned.plateau_converged_level * start:
        return _NOT_HOLDING  # converged: at a minimum the gradients vanish too (not "optimisation stuck")
    # a plateau unless it fell since the start (converging) or swings (the oscillation rule's) -- either
    # of which stands only while something moves the weights: with dead units or an LR of 0 what fell was
    # a bias finding the targets' mean, and the swings are the batches' noise
    fell = _fell_from_start(state, win.ordered, med, initial, tuned) and \
        not _stalled(rank, state, med / initial, win.first_step, win.last_step, settings)
    if fell and not _optimisation_stuck(rank, state, win.first_step, win.last_step, settings, med / initial):
        return _NOT_HOLDING
    swing = _swing_bar(state, tuned)  # (a spread surely under it: no sorted deviations, win.cv_under)
    if not win.cv_under(swing) and win.cv >= swing and not _optimisation_stuck(
            rank, state, win.first_step, win.last_step, settings, med / initial, swings=True):
        return _NOT_HOLDING
    trend = win.trend
    returned = _returned(state, win, initial, tuned)
    if abs(trend.z) >= tuned.trend_z and not (returned and trend.z < 0):
        return _NOT_HOLDING
    first, last = win.first_step, win.last_step  # (the window's first and last steps: it is full)
    if not explain and _change_within(win, first, last, tuned.plateau_max_change * med):
        return _Check(True, since=first)  # the size test below passes whatever the slope (win.slope_bound)
    # Theil-Sen slope through the medians of blocks of 4 values: robust, and cheap on any window
    slope = win.block_slope
    change = abs(slope) * (last - first + 1)
    if change > tuned.plateau_max_change * med:
        return _NOT_HOLDING
    if not explain:
        return _Check(True, since=first)
    steps = win.steps
    verdict, grad_evidence = _plateau_verdict(rank, steps[0], steps[-1], settings, tuned)
    level = med / initial if initial else math.inf  # an initial loss of exactly 0: any level is above it
    share = change / med if med else 0.0  # a level of 0 passed the gate above only without any change
    description = (f"{name} over steps {steps[0]}-{steps[-1]}: median {fmt_number(med)} = {level:.2f}x the "
                   f"initial level (>= {tuned.plateau_min_level:g}x), trend {share:.1%} of the level "
                   f"over the window (<= {tuned.plateau_max_change:.0%}), Mann-Kendall z = {trend.z:.2f} "
                   + (f"(|z| < {tuned.trend_z:g})" if abs(trend.z) < tuned.trend_z else
                      "(back at its start after leaving it: a slow fall to where it began is no learning)"))
    evidence = [Evidence(rule="loss.plateau", description=description, step=steps[0],
                         time_ns=point_time(rank, name, steps[0], 0), rank=rank.rank, metric=name,
                         threshold=tuned.plateau_max_change, value=wire_float(share),
                         window=window(rank, name, steps[-1], settings.evidence_window)), *grad_evidence]
    summary = (f"{name} has stayed at {fmt_number(med)} ({level:.2f}x where it started) since step "
               f"{{since}}, neither falling nor rising. " + _braces(verdict))
    return _Check(True, since=steps[0], detail=f"at {fmt_number(med)}", evidence=evidence, summary=summary)


def _change_within(win: _Window, first: int, last: int, limit: float) -> bool:
    """True when the plateau rule's size test -- abs(block slope) x (last - first + 1) > ``limit`` -- is
    certain to fail (the change is within the limit) from :meth:`_Window.slope_bound` (a product of
    non-negatives rounds monotonically: the change is at most the bound's); False: not proven."""
    return win.slope_bound() * (last - first + 1) <= limit


def _returned(state: Dict[str, Any], win: _Window, initial: float, tuned: LossGradientSettings) -> bool:
    """Whether the loss window sits back at the run's start after having left it: the loss was away from
    its initial level before the window began (``state["moved_at"]``, see :func:`_plateau_min_steps`) and
    the window's median is within ``plateau_resolve_drop`` above it (its lower bound is the plateau rule's
    own ``plateau_min_level``). Such a window's slow downward drift is the loss settling back from where it
    was thrown, not learning: the plateau rule judges its flatness by the size of the change alone."""
    moved = state.get("moved_at")
    return moved is not None and moved <= win.first_step and \
        win.median <= (1.0 + tuned.plateau_resolve_drop) * initial


def _fell_from_start(state: Dict[str, Any], ordered: Sequence[float], med: float, initial: float,
                     tuned: LossGradientSettings) -> bool:
    """Whether a loss window (its values sorted, ``ordered``; median ``med``) fell since the run's start:
    its median under ``plateau_min_level`` x the initial level, and its values significantly lower than
    the run's first 2 x ``loss_baseline_points`` values (``state["early"]``; a one-sided Mann-Whitney rank
    test, z >= ``trend_z``). With small, noisy batches the median of the first few losses is itself
    uncertain by tens of percent: a loss whose batches scatter as much as at its start, around the same
    level, has not fallen -- it sits where it started (a plateau), however its first median landed."""
    if not med < tuned.plateau_min_level * initial:
        return False
    early: Optional[List[float]] = state.get("early")
    if not early or not ordered:
        return True
    return -_rank_z_above(early, ordered) >= tuned.trend_z


def _optimisation_stuck(rank: RankState, state: Dict[str, Any], lo: int, hi: int,
                        settings: DetectionSettings, level_ratio: float = 0.0, swings: bool = False) -> bool:
    """Whether nothing moves the weights over steps [lo, hi]: an LR of 0, a median global grad norm below
    ``plateau_small_grad``, or layers with exactly zero gradient on the last per-layer report (dead units,
    a detached part) (the last ``STUCK_RECENT`` LR and norm values in the range). Then the loss's
    swings are its batches' noise, not the optimiser's. Dead layers alone do not say so when the judged
    loss level is ``level_ratio`` >= ``divergence_factor`` x its initial level: a model whose dead units
    left it a constant predictor sits at most about where it started; far above that, the optimiser is
    throwing the live layers around (a far-too-high LR, which is also what killed the units). Nor, for
    ``swings`` (is a window's spread the batches' noise?), do layers that had a gradient on an earlier
    report and died during the run ("died"): units dead from the first report leave a constant predictor
    from the start, whose loss scatters only as its batches do; units killed by the updates died of steps
    too large (the usual way ReLUs die), and the same steps keep throwing the live layers around -- the
    swings are the optimiser's. Computed once per judged loss value (the rank's derived :data:`STUCK_MEMO`,
    keyed by ``hi``: the curve rules share it; never in the snapshot)."""
    memo = rank.derived.get(STUCK_MEMO)
    if memo is not None and memo[0] == hi:
        reason = memo[1]
    else:
        reason = _stuck_now(rank, lo, hi, settings)
        rank.derived[STUCK_MEMO] = (hi, reason)
    if reason in ("dead", "died") and level_ratio >= settings.divergence_factor:
        return False
    if reason == "died" and swings:
        return False
    return bool(reason)


def _track_grad_start(rank: RankState, state: Dict[str, Any], step: int, settings: DetectionSettings) -> None:
    """Keep the run's early global grad-norm level (``state["ginit"]``: the median of its first
    ``loss_baseline_points`` finite values), read from the history while the run is young (until that many
    were seen or ``loss_window`` steps passed since the loss's baseline was complete)."""
    if "ginit" in state:
        return
    first = state.setdefault("gfrom", step)
    gname = grad_metric(rank, settings)
    values = [v for _s, v, _t in finite_series(rank, gname, 0, step)] if gname is not None else []
    if len(values) >= settings.loss_baseline_points or (step - first >= settings.loss_window and values):
        state["ginit"] = robust.median(values[:settings.loss_baseline_points])
    elif step - first >= settings.loss_window:
        state["ginit"] = None  # no grad norm early on: the collapse test cannot be made


def _stalled(rank: RankState, state: Dict[str, Any], level_ratio: float, lo: int, hi: int,
             settings: DetectionSettings) -> bool:
    """Whether a loss that fell a little (window level >= ``plateau_stalled_min_level`` x its initial
    level) stopped learning: the median global grad norm over steps [lo, hi] <=
    ``plateau_grad_collapse`` x the norm's early level (:func:`_track_grad_start`), or the norm climbed
    into a gradient explosion (flagged before any non-finite value, :func:`_explosion_gave_way` marks
    ``state["climbed"]``) -- under clipping the updates are thrown around at a fixed size and the loss
    sits where the first steps left it: no more learning than a collapsed gradient gives."""
    if level_ratio < settings.plateau_stalled_min_level:
        return False
    if state.get("climbed"):
        return True
    early = state.get("ginit")
    gname = grad_metric(rank, settings)
    if not early or early <= 0 or gname is None:
        return False
    norms = [v for s, v, _t in recent(rank, gname, settings.loss_window, hi) if s >= lo]
    return bool(norms) and robust.median(norms) <= settings.plateau_grad_collapse * early


STUCK_RECENT: Final = 8
"""LR and grad-norm values (the rank's last ones) :func:`_optimisation_stuck` looks at."""

STUCK_MEMO: Final = "loss.stuck"
"""The key of :func:`_optimisation_stuck`'s memo in the rank's derived state (``RankState.derived``: per
rank, never serialized): (hi, reason) for the loss value being judged (:func:`on_curve` drops it on every
value). Until stop 40 it was ``state["loss"]["stuck"]``, rewritten in the snapshotted state on every value
(a restore drops that key: ``state.RETIRED_KEYS``); that memo was keyed by ``hi`` alone and kept from
value to value, but ``hi`` (the judged window's last step, or the value's own step) rises from one judged
value to the next whenever the value's point is in the rank's history, so it served only the value it was
taken on."""


def _stuck_now(rank: RankState, lo: int, hi: int, settings: DetectionSettings) -> str:
    """Why nothing moves the weights ("lr0", "small", "dead"; "died": every zero-gradient layer had a
    gradient on an earlier report), or "" (see :func:`_optimisation_stuck`)."""
    history = rank.history
    for name in ("opt/lr", "lr"):
        if name in history:
            newest = _newest_recent(rank, name, hi)
            if newest is not None and (newest[1] != 0 or newest[0] < lo):
                break  # recent()'s newest point decides (the usual case: no list built)
            lrs = recent(rank, name, STUCK_RECENT, hi)  # by step: the newest decides most values at once
            if lrs and lrs[-1][0] >= lo and lrs[-1][1] == 0 and all(v == 0 for s, v, _t in lrs if s >= lo):
                return "lr0"
            break
    gname = grad_metric(rank, settings)
    if gname is not None and _low_norm_recent(rank, gname, settings.plateau_small_grad):
        norms = recent(rank, gname, STUCK_RECENT, hi)
        if norms and norms[0][0] < lo:
            norms = [p for p in norms if p[0] >= lo]
        if norms and _median_of(norms) < settings.plateau_small_grad:
            return "small"
    layers: Optional[Dict[str, Any]] = rank_state(rank).get("layers")  # (no empty dict built per call)
    if not layers or not layers.get("zero"):
        return ""
    return "died" if layers.get("died") else "dead"


def _low_norm_recent(rank: RankState, gname: str, small: float) -> bool:
    """False when none of the last ``STUCK_RECENT`` points of ``gname``'s current tail is under ``small``
    -- then the median of any of them (:func:`_stuck_now`'s ``recent()`` answer: a subset of exactly those
    points, the finite ones at steps in [lo, hi]) is >= ``small`` (the middle value, or the rounded mean of
    two, of values all >= ``small``), so the grad norm is not "small", decided without a list or a sort;
    True when one is, or when the tail is not current (ask recent()). Kept incrementally beside the tail
    (``SeriesTail.windows``: derived, dropped with it): the index of the last point under ``small``, and up
    to where the points were looked at -- one point looked at per new reading."""
    data = rank.history.get(gname)  # (the tail is current: what recent() checks first)
    tail = rank.tails.get(gname)
    if not data or tail is None or tail.data is not data:
        return True
    points = tail.points
    n = len(points)
    if n != len(data):
        return True
    key = ("stuck-low", small)
    kept: Optional[List[int]] = tail.windows.get(key)
    if kept is None:
        kept = tail.windows[key] = [max(0, n - STUCK_RECENT), -1]
    at = kept[0]
    if at < n:
        low = kept[1]
        for i in range(max(at, n - STUCK_RECENT), n):
            if points[i][1] < small:  # (NaN is not; -inf is, and sends the call to recent())
                low = i
        kept[0], kept[1] = n, low
    return kept[1] >= 0 and kept[1] >= n - STUCK_RECENT


def _newest_recent(rank: RankState, name: str, hi: int) -> Optional[Tuple[int, float, int]]:
    """The last point of ``recent(rank, name, STUCK_RECENT, hi)`` without building that list, when recent()
    would answer with a plain slice of the series' tail (its fast path: the tail is current, its last
    ``STUCK_RECENT`` points finite and in step order, none past ``hi``) -- that slice's last point is the
    tail's; else None (ask recent())."""
    data = rank.history.get(name)  # (the tail is current: what recent() checks first)
    tail = rank.tails.get(name)
    if not data or tail is None or tail.data is not data:
        return None
    points = tail.points
    n = len(points)
    if n != len(data):
        return None
    start = n - STUCK_RECENT if n > STUCK_RECENT else 0
    last = points[-1]
    if start >= tail.bad_end and start >= tail.descent and last[0] <= hi:
        return last
    return None


def _plateau_verdict(rank: RankState, lo: int, hi: int, settings: DetectionSettings,
                     tuned: LossGradientSettings) -> Tuple[str, List[Evidence]]:
    """The seed's "capacity or optimisation?" from the gradient statistics of the window."""
    gname = grad_metric(rank, settings)
    lrs = next((finite_series(rank, n, lo, hi) for n in ("opt/lr", "lr") if n in rank.history), [])
    lr_zero = bool(lrs) and all(v == 0 for _s, v, _t in lrs)
    norms = finite_series(rank, gname, lo, hi) if gname is not None else []
    if not norms:
        return ("Optimisation: the learning rate is 0." if lr_zero else
                "No gradient norms were reported, so capacity and optimisation cannot be told apart."), []
    med = robust.median([v for _s, v, _t in norms])
    layers = rank_state(rank).get("layers", {})
    dead: List[str] = list(layers.get("zero", []))
    stuck = lr_zero or bool(dead) or med < tuned.plateau_small_grad
    if lr_zero:
        verdict = "Optimisation: the learning rate is 0."
    elif dead:
        verdict = (f"Optimisation, not capacity: {len(dead)} of {layers.get('count', '?')} layers have "
                   f"exactly zero gradient ({', '.join(dead[:8])}) on the last per-layer report (step "
                   f"{layers.get('last', '?')}): dead ReLUs (a bad initialisation or a too-high LR killed "
                   f"them) or a part of the model detached from the loss; only the rest learns (median "
                   f"{gname} {fmt_number(med)}).")
    elif stuck:
        verdict = (f"Optimisation, not capacity: the gradients are tiny (median {gname} {fmt_number(med)} < "
                   f"{tuned.plateau_small_grad:g}), so updates cannot move the loss: saturated sigmoid/tanh "
                   f"units or dead ReLUs (check the initialisation scale and normalisation), or sparse "
                   f"gradients.")
    else:
        verdict = (f"Gradients are not small (median {gname} {fmt_number(med)} >= "
                   f"{tuned.plateau_small_grad:g}): the optimiser is moving but the loss does not improve: "
                   f"model capacity, labels without signal, or a learning rate / momentum that cancels the "
                   f"updates.")
    dead_text = f"; zero-gradient layers: {', '.join(dead[:8])}" if dead else ""
    return verdict, [Evidence(
        rule="gradient.plateau_stats",
        description=(f"{gname} over steps {lo}-{hi}: median {fmt_number(med)} (threshold "
                     f"{tuned.plateau_small_grad:g}){dead_text}; verdict: "
                     f"{'optimisation' if stuck else 'capacity or data'}"),
        step=lo, rank=rank.rank, metric=gname or "", threshold=tuned.plateau_small_grad, value=med,
        window=window(rank, gname or "", hi, settings.evidence_window))]


# ----------------------------------------------------------------------------------------------------
# one bad batch: a single loss value far above the run's range


SPIKE_KEY: Final = "loss:spike"
"""The incident slot of loss/spike (one per run; a later spike opens it again)."""

SPIKE_START_MEMO: Final = "loss.spike_start"
"""The key of the run's start level for :func:`on_spike` in the rank's derived state (``RankState.derived``:
never serialized): computed once the loss curve's ``init`` values are all in (they never change after)."""


def _tail_bar(med: float, spread: float, power: float) -> float:
    """``med x spread ** power``, the heavy-tail bar of :func:`on_spike`; infinite where the power overflows a
    float (a window whose 0.9 quantile is ~1e154+ times its median: no value reaches that bar) -- it raised
    OverflowError there, and the run was quarantined (the fuzz suite's metric series found it, stop 47)."""
    try:
        return med * spread ** power
    except OverflowError:
        return math.inf


def on_spike(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], time_ns: int,
             event_id: str, settings: DetectionSettings) -> List[Finding]:
    """loss/spike for one metric batch of ``rank`` (already in its history; docs/detectors.md).

    A finite loss value >= ``spike_factor`` x the median of the ``spike_window`` values before it, >=
    ``spike_over_max`` x their largest and >= ``spike_start_level`` x the run's initial level (the median
    of its first ``loss_baseline_points`` values, or the first when lower) is a candidate; its bar is the
    larger of ``spike_over_max`` x that largest and 1/``spike_factor`` of the spike. The incident opens
    (dated at the spike) on the first later value back under the bar -- one bad batch the run absorbed --
    and resolves once ``spike_resolve_points`` values in a row are under it. A candidate is dropped when a
    non-finite loss comes first, when the rank's numeric slot (explosion, divergence, NaN) opens, or after
    ``spike_window`` values still above the bar: the first step of an explosion or a level change is the
    other rules' story. None is taken while the numeric slot or an oscillation is open on the rank.

    A heavy-tailed healthy loss (tiny batches, heavy-tailed targets, noisy labels, sparse rewards) has
    values far above its window now and then; two more bars measure the value against the run's own noise
    (stop 43): its ratio to the loss curve's rolling level (the median of ``rise_smooth`` values) must be
    >= ``spike_over_record`` x the largest such ratio of the run's earlier values (its record: every value
    judged here and not taken as a candidate, none while the numeric slot is open), and
    the value >= the window's median x (its ``spike_tail_quantile`` value / its median) **
    ``spike_tail_power``. A candidate that also reached the divergence blow-up bar
    (``divergence_blowup_factor`` x the run's divergence base) is the spike's when the value that confirms
    it is back under ``spike_over_max`` x the window's largest -- one bad batch: the blow-up rule does not
    claim it (:func:`spike_claims`), its reading is this incident's evidence -- and the blow-up's
    (loss/divergence) when it is not: the spike is dropped."""
    if not settings.spike_factor > 0:
        return []
    loss_names = family_names(settings)[1]
    for point in points:
        if point[0] in loss_names:
            name, step, value = point
            break
    else:
        return []
    lg_state = rank_state(rank)
    state: Optional[Dict[str, Any]] = lg_state.get("spike")  # (get, set when absent: no dict per value)
    if state is None:
        state = lg_state["spike"] = {}
    if state.setdefault("metric", name) != name or step <= state.get("last", -1):
        return []
    state["last"] = step
    if value - value != 0.0:  # non-finite: the NaN rules' (a candidate was the start of it)
        state.pop("pending", None)
        return []
    held = state.get("open")  # [bar, values in a row under it, step of the spike]
    if held is not None:
        st = run.incidents.get(SPIKE_KEY)
        if st is None or not st.is_open:
            state.pop("open")
        elif value < held[0]:
            held[1] += 1
            if held[1] >= settings.spike_resolve_points:
                state.pop("open")
                resolve(st, time_ns, step, rank.rank,
                        f"rank {rank.rank}: {name} back below {fmt_number(held[0])} on "
                        f"{settings.spike_resolve_points} values in a row since the spike at step {held[2]}: "
                        f"the run absorbed the bad batch", settings)
            return []
        else:
            held[1] = 0
    pending = state.get("pending")  # {step, value, median, top, bar, time_ns, event_id, waited}
    if pending is not None:
        if rank_has_open(run, rank, NUMERIC_KEY, "loss:oscillation"):
            state.pop("pending")
        elif value < pending["bar"]:
            state.pop("pending")
            blow = _spike_blowup_bar(rank, pending["value"], settings)
            if blow and not value < settings.spike_over_max * pending["top"]:
                return []  # blown up and not back in its range: the divergence blow-up's story
            if blow:
                state["claimed"] = pending["step"]  # (spike_claims: the blow-up rule leaves this value)
            state["open"] = [pending["bar"], 1, pending["step"]]
            return [_spike_finding(rank, name, pending, step, time_ns, settings, blow)]
        else:
            pending["waited"] += 1
            if pending["waited"] >= settings.spike_window:
                state.pop("pending")
            return []
    # The rejections below change nothing but the record, so the cheapest come first: a value within
    # spike_over_record x the run's record of its own excursions (most values), then one under the run's
    # start level (fixed once the curve's first values are in).
    curve = lg_state.get("loss")
    level = curve.get("level") if curve is not None else None  # (on_curve's rolling level, this value's)
    ratio = value / level if level is not None and level > 0 else 0.0
    record = state.get("record", 0.0)
    if ratio < settings.spike_over_record * record:
        if ratio > record:
            _fold_record(run, rank, state, ratio)
        return []
    start = rank.derived.get(SPIKE_START_MEMO)
    if start is None:
        init: List[float] = rank_state(rank).get("loss", {}).get("init") or []
        if len(init) < settings.loss_baseline_points:
            return []
        start = robust.median(init)
        if 0 < init[0] < start:
            start = init[0]
        rank.derived[SPIKE_START_MEMO] = start  # (init no longer changes; derived: rebuilt after a restore)
    if not value >= settings.spike_start_level * start:
        _fold_record(run, rank, state, ratio)
        return []  # a converged model's one hard batch: far above its collapsed median, not its start
    if rank_has_open(run, rank, NUMERIC_KEY, "loss:oscillation"):
        return []  # an explosion, divergence or swings already tell the story: their values are no spike
    before = recent(rank, name, settings.spike_window + 1, step)
    prior = [v for s, v, _t in before if s < step][-settings.spike_window:]
    if len(prior) < max(2, settings.spike_window // 2):
        _fold_record(run, rank, state, ratio)
        return []
    top = max(prior)
    if not (top > 0 and value >= settings.spike_over_max * top):
        _fold_record(run, rank, state, ratio)
        return []
    ordered = sorted(prior)
    med = robust.median_sorted(ordered)
    if not (med > 0 and value >= settings.spike_factor * med):
        _fold_record(run, rank, state, ratio)
        return []
    at_q = min(len(ordered) - 1, int(settings.spike_tail_quantile * (len(ordered) - 1) + 0.5))
    spread = ordered[at_q] / med
    if settings.spike_tail_power > 0 and not value >= _tail_bar(med, spread, settings.spike_tail_power):
        _fold_record(run, rank, state, ratio)
        return []  # the window's own spread reaches that far: a heavy-tailed loss's natural value
    state["pending"] = {"step": step, "value": value, "median": med, "top": top, "count": len(prior),
                        "bar": max(settings.spike_over_max * top, value / settings.spike_factor),
                        "time_ns": time_ns, "event_id": event_id, "waited": 0, "spread": spread,
                        "ratio": ratio, "record": state.get("record", 0.0)}
    return []


def _fold_record(run: RunState, rank: RankState, state: Dict[str, Any], ratio: float) -> None:
    """Fold a value's ratio to the rolling level into the run's record (:func:`on_spike`), unless the
    numeric slot is open on the rank (an explosion's climb or a divergence is not the run's noise; an
    oscillation's swings count: a heavy-tailed loss often reads as one)."""
    if ratio > state.get("record", 0.0) and not rank_has_open(run, rank, NUMERIC_KEY):
        state["record"] = ratio


def _spike_blowup_bar(rank: RankState, value: float, settings: DetectionSettings) -> float:
    """The divergence blow-up bar (``divergence_blowup_factor`` x the run's divergence base) when
    ``value`` reached it, else 0."""
    init: List[float] = rank_state(rank).get("loss", {}).get("init") or []
    factor = settings.divergence_blowup_factor
    if not init or not factor > 0:
        return 0.0
    bar = factor * divergence_base(robust.median(init), init[0], settings)
    return bar if bar > 0 and value >= bar else 0.0


def spike_claims(rank: RankState, at: int, latest: float, settings: DetectionSettings) -> bool:
    """Whether the loss value at step ``at`` -- one the divergence blow-up rule would read, the loss now
    ``latest`` -- is loss/spike's (:func:`on_spike`): a spike already opened on it past the blow-up bar, or
    the candidate at ``at`` that ``latest`` confirms, back under ``spike_over_max`` x the window's largest
    before it (one bad batch the run absorbed, not a run blown up)."""
    spike = rank_state(rank).get("spike")
    if not spike:
        return False
    if spike.get("claimed") == at:
        return True
    pending = spike.get("pending")
    return pending is not None and pending["step"] == at and latest < pending["bar"] and \
        latest < settings.spike_over_max * pending["top"]


def _spike_finding(rank: RankState, name: str, spike: Dict[str, Any], step: int, time_ns: int,
                   settings: DetectionSettings, blow: float = 0.0) -> Finding:
    """The loss/spike Finding for a candidate (:func:`on_spike`) confirmed at ``step`` (``blow``: the
    divergence blow-up bar it also reached, else 0)."""
    at, value, med, top = spike["step"], spike["value"], spike["median"], spike["top"]
    ratio = value / med
    evidence = [Evidence(
        rule="loss.spike",
        description=(f"{name} {fmt_number(value)} at step {at}: {ratio:.3g}x the median "
                     f"{fmt_number(med)} of the {spike['count']} values before it "
                     f"(>= {settings.spike_factor:g}x) and {value / top:.3g}x their largest "
                     f"{fmt_number(top)} (>= {settings.spike_over_max:g}x); back under "
                     f"{fmt_number(spike['bar'])} at step {step}"),
        step=at, time_ns=spike["time_ns"], rank=rank.rank, metric=name, threshold=settings.spike_factor,
        value=wire_float(ratio), window=window(rank, name, step, settings.evidence_window),
        event_id=spike["event_id"])]
    if "spread" in spike:  # (a candidate taken before stop 43's bars has none)
        evidence.append(Evidence(
            rule="loss.spike_noise",
            description=(f"the run's own noise: the value is {spike['ratio']:.3g}x the rolling level, "
                         f"the run's earlier values at most {spike['record']:.3g}x "
                         f"(>= {settings.spike_over_record:g}x that needed); the window's "
                         f"{settings.spike_tail_quantile:g} quantile is {spike['spread']:.3g}x its median "
                         f"(the value >= that ** {settings.spike_tail_power:g} x the median)"),
            step=at, time_ns=spike["time_ns"], rank=rank.rank, metric=name,
            threshold=settings.spike_over_record, value=wire_float(spike["ratio"]),
            event_id=spike["event_id"]))
    if blow:
        evidence.append(Evidence(
            rule="loss.spike_blowup",
            description=(f"{name} {fmt_number(value)} at step {at} is >= the divergence blow-up bar "
                         f"{fmt_number(blow)} (divergence_blowup_factor "
                         f"{settings.divergence_blowup_factor:g}x the run's start), but the next value "
                         f"was back under {settings.spike_over_max:g}x the largest before it: one bad "
                         f"batch the run absorbed, not a run the updates blew up (loss/divergence does "
                         f"not open for it)"),
            step=at, time_ns=spike["time_ns"], rank=rank.rank, metric=name,
            threshold=settings.divergence_blowup_factor, value=wire_float(value), event_id=spike["event_id"]))
    norm_text = ""
    gname = grad_metric(rank, settings)
    norm_at = rank.history.get(gname, {}).get(at) if gname else None
    if gname and norm_at is not None and math.isfinite(norm_at[0]):
        norms = [v for s, v, _t in recent(rank, gname, settings.spike_window + 1, at) if s < at]
        norm_med = robust.median(norms) if norms else 0.0
        if norm_med > 0:
            norm_ratio = norm_at[0] / norm_med
            norm_text = f"; {gname} {fmt_number(norm_at[0])}, {norm_ratio:.3g}x its median"
            evidence.append(Evidence(
                rule="loss.spike_grad_norm",
                description=(f"{gname} {fmt_number(norm_at[0])} at step {at}: {norm_ratio:.3g}x the median "
                             f"{fmt_number(norm_med)} of the {len(norms)} readings before it"),
                step=at, time_ns=spike["time_ns"], rank=rank.rank, metric=gname, value=wire_float(norm_ratio),
                window=window(rank, gname, step, settings.evidence_window), event_id=spike["event_id"]))
    return Finding(
        "loss", "spike", SPIKE_KEY, rank.rank, at, spike["time_ns"], host=rank.host, seen_ns=time_ns,
        seen_step=step, event_id=spike["event_id"], evidence=evidence,
        timeline=[TimelineEntry(time_ns=spike["time_ns"], step=at, rank=rank.rank,
                                what=f"rank {rank.rank}: {name} {fmt_number(value)} at step {at}, "
                                     f"{ratio:.3g}x its median{norm_text}"),
                  TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: {name} back under {fmt_number(spike['bar'])} "
                                     f"at step {step}")],
        values={"detail": f"{ratio:.3g}x its median", "value": fmt_number(value), "step": at, "metric": name,
                "rank": rank.rank},
        summary=(f"On rank {rank.rank}, {name} jumped to {fmt_number(value)} at step {at}, {ratio:.3g}x "
                 f"the median of the values before it and {value / top:.3g}x their largest{norm_text}, "
                 f"then came back: one bad batch (inputs or labels in other units, an outlier, a loss "
                 f"summed or weighted wrongly on that step). Look at that step's batch. It resolves once "
                 f"the loss stays back; if the run does not recover, the loss-curve and gradient incidents "
                 f"say how it goes on."))


_CHECKS = {"oscillation": _check_oscillation, "divergence": _check_divergence, "rise-after-fall": _check_rise,
           "plateau": _check_plateau}


class NonFiniteLoss(Detector):
    """A non-finite loss, judged first: a plain NaN/Inf loss, a gradient explosion that ended in it, or
    the NaN source (:func:`on_metrics`)."""

    name = "loss.non_finite"
    kinds: Tuple[str, ...] = ("loss/non_finite", "gradient/explosion", "gradient/nan-source")
    section = "loss_gradient"
    names_only = True  # wants() reads the batch's names and the settings only

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return not names.isdisjoint(settings.loss_metrics)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch.points, batch.time_ns, batch.event_id, settings)


class LossCurve(Detector):
    """The loss curve's shape once per new finite loss value (:func:`on_curve`); defers to the numeric
    detectors, so it runs after them."""

    name = "loss.curve"
    kinds: Tuple[str, ...] = ("loss/oscillation", "loss/divergence", "loss/rise-after-fall", "loss/plateau",
                              "loss/spike")
    section = "loss_gradient"
    names_only = True  # wants() reads the batch's names and the settings only

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return not names.isdisjoint(settings.loss_metrics)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        found = on_curve(run, rank, batch.points, batch.time_ns, batch.event_id, settings)
        spike = on_spike(run, rank, batch.points, batch.time_ns, batch.event_id, settings)
        return found + spike if spike else found
