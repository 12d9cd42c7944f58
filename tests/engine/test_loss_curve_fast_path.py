"""The loss curve's per-value path (issue 15, stop 43, hC) must change nothing: ``on_curve`` gets the rank's
``loss`` state, its ``init`` list and its ``streak`` / ``since`` dicts without building an empty dict or list
per value (get, set when absent: the same keys at the same place, so the snapshot's key order too) and calls
``_track_grad_start`` only while the early grad-norm level is unknown; ``_stuck_now`` reads the layers'
state without an empty dict per call; ``_low_norm_recent`` and ``_newest_recent`` test that the series'
tail is current inline (``_current_tail`` is gone).

Checked against the code before (HEAD 11a372a), kept here verbatim ON PURPOSE as the pre-change reference
(the fast path is inline code: no switch gives the old path back by patching) and run in a copy of the
module's namespace (its helpers are the module's own, unchanged; the replaced functions the old ones):
outputs and snapshots piece by piece with restores (tests/engine/fast_slow.py) on every corpus scenario and
on the synthetic loss streams of test_loss_quiet_stretch (levels about the rules' thresholds, jumps,
blow-ups, NaN, a collapsing grad norm, LR to 0, dead layers, late points and replays) under its four
settings variants (one with a short history: tails trimmed); and the two tail helpers against the old
ones, and ``_stuck_now`` against the old one (layers' state absent, empty, with zero-gradient layers that
died or were dead from the start), on ranks fed the same random points (late, replaced, non-finite,
trimmed; tails not current)."""

from __future__ import annotations

import math
import random
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterator, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import VARIANTS, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.state import RankState

PURE = pytest.mark.engine_pure("replaces loss._track_level with a counting copy")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]

BEFORE = r'''
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
    state: Dict[str, Any] = rank_state(rank).setdefault("loss", {})
    if state.setdefault("metric", name) != name or step <= state.get("last", -1):
        return []
    rank.derived.pop(STUCK_MEMO, None)  # (the memo serves this value only)
    state["last"] = step
    init: List[float] = state.setdefault("init", [])
    if len(init) < tuned.loss_baseline_points:
        init.append(value)
        state.setdefault("init_steps", []).append(step)
        if len(init) < tuned.loss_baseline_points:
            return []
        base = divergence_base(robust.median(init), init[0], tuned)  # known now: once for the first values
        for at, early in zip(state.pop("init_steps"), init):
            _note_early_blowup(state, at, early, tuned, base)
        return []
    _track_grad_start(rank, state, step, settings)
    series = recent(rank, name, tuned.loss_window, step)
    tail = _exact_tail(rank, name, series)
    initial = _initial(init, tail)  # statistics.median's value, bit for bit, cheaper
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
    streaks: Dict[str, int] = state.setdefault("streak", {})
    since: Dict[str, int] = state.setdefault("since", {})
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
    if free and _stays_quiet(rank, state, series, tail, initial, settings):  # type: ignore[arg-type]
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
                not _swings_shaped(win, initial, state, tuned, rank):  # (stop 44's rule change, mirrored)
            check = _NOT_HOLDING
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
    layers = rank_state(rank).get("layers", {})
    if not layers.get("zero"):
        return ""
    return "died" if layers.get("died") else "dead"


def _current_tail(rank: RankState, name: str) -> Optional[SeriesTail]:
    """The :class:`SeriesTail` of ``name`` when it is current -- the series is there and not empty, and its
    tail is of that series' dict and as long as it (what :func:`recent` checks before it reads a tail) --
    else None."""
    data = rank.history.get(name)
    tail = rank.tails.get(name)
    if not data or tail is None or tail.data is not data or len(tail.points) != len(data):
        return None
    return tail


def _low_norm_recent(rank: RankState, gname: str, small: float) -> bool:
    """False when none of the last ``STUCK_RECENT`` points of ``gname``'s current tail is under ``small``
    -- then the median of any of them (:func:`_stuck_now`'s ``recent()`` answer: a subset of exactly those
    points, the finite ones at steps in [lo, hi]) is >= ``small`` (the middle value, or the rounded mean of
    two, of values all >= ``small``), so the grad norm is not "small", decided without a list or a sort;
    True when one is, or when the tail is not current (ask recent()). Kept incrementally beside the tail
    (``SeriesTail.windows``: derived, dropped with it): the index of the last point under ``small``, and up
    to where the points were looked at -- one point looked at per new reading."""
    tail = _current_tail(rank, gname)
    if tail is None:
        return True
    points = tail.points
    n = len(points)
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
    tail = _current_tail(rank, name)
    if tail is None:
        return None
    points = tail.points
    n = len(points)
    start = n - STUCK_RECENT if n > STUCK_RECENT else 0
    last = points[-1]
    if start >= tail.bad_end and start >= tail.descent and last[0] <= hi:
        return last
    return None
'''
"""loss.py's on_curve, _stuck_now, _current_tail, _low_norm_recent and _newest_recent at 11a372a, verbatim."""

_BEFORE: Dict[str, Any] = dict(vars(loss))
exec(compile(BEFORE, "loss.py@11a372a", "exec"), _BEFORE)  # the reference code, verbatim
REPLACED = ("on_curve", "_stuck_now", "_low_norm_recent", "_newest_recent")


@contextmanager
def _before() -> Iterator[None]:
    with ExitStack() as stack:
        for name in REPLACED:
            stack.enter_context(patch.object(loss, name, _BEFORE[name]))
        yield


class _Counted:
    """Counts the loss values the fast on_curve took past its baseline (``_track_level``: once each;
    re-entered for every piece)."""

    def __init__(self) -> None:
        self.saved = loss._track_level
        self.judged = 0

    def __enter__(self) -> _Counted:
        def counted(*args: Any) -> None:
            self.judged += 1
            self.saved(*args)

        loss._track_level = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._track_level = self.saved  # type: ignore[assignment]


def _compare(events: List[Event], settings: DetectionSettings = SETTINGS, piece: int = 37,
             restore_every: int = 3) -> int:
    counted = _Counted()
    run_fast_and_slow(events, settings, counted, _before, piece, restore_every)
    return counted.judged


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, piece=41)


@pytest.mark.parametrize("seed", range(16))
def test_synthetic_loss_streams_are_unchanged(seed: int) -> None:
    _compare(list(_loss_stream(seed)), VARIANTS[seed % len(VARIANTS)], piece=29 + seed % 3 * 8,
             restore_every=2 + seed % 2)


@PURE
def test_the_streams_reach_the_judged_path() -> None:
    judged = sum(_compare(list(_loss_stream(seed)), SETTINGS) for seed in range(4))
    assert judged > 1000


TRIMMED = replace(DetectionSettings(), history_len=16)


@pytest.mark.parametrize("seed", range(12))
def test_the_tail_helpers_and_the_stuck_reason_answer_as_before(seed: int) -> None:
    rng = random.Random(seed)
    fast, slow = RankState(0), RankState(0)
    names = ("opt/lr", TRIMMED.grad_norm_metrics[seed % 2])
    small = TRIMMED.plateau_small_grad
    step = 0
    reasons = set()
    for i in range(500):
        if rng.random() < 0.06 and step > 3:
            at = step - rng.randint(0, 3)  # a late point, or one replaced
        else:
            step += rng.choice([1, 1, 2])
            at = step
        name = rng.choice(names)
        r = rng.random()
        value = rng.choice([math.nan, math.inf, -math.inf]) if r < 0.03 else \
            rng.choice([0.0, small * 0.5, small, small * 2, 0.01]) if r < 0.5 else rng.uniform(0.0, 3 * small)
        for rank in (fast, slow):
            rank.observe_points(((name, at, value),), (True,), 1000 + i, TRIMMED)
        if rng.random() < 0.3:  # recent() makes the tail current again (or a first one)
            made = rng.choice(names)
            for rank in (fast, slow):
                loss.recent(rank, made, loss.STUCK_RECENT, step)
        r = rng.random()
        if r < 0.08:  # a tail that is not current (what only other writers of the history make): the
            # series' dict replaced by a copy or emptied, or a point written past observe_points
            touched = rng.choice(names)
            for rank in (fast, slow):
                series = rank.history.get(touched)
                if series is None:
                    continue
                if r < 0.03:
                    rank.history[touched] = dict(series)
                elif r < 0.05:
                    rank.history[touched] = {}
                else:
                    series[step + 1] = (0.5, 0)
        layers = rng.choice([None, {}, {"zero": []}, {"zero": ["l0"]}, {"zero": ["l0"], "died": True},
                             {"zero": ["l0"], "died": False}])
        for rank in (fast, slow):
            family = loss.rank_state(rank)
            if layers is None:
                family.pop("layers", None)
            else:
                family["layers"] = dict(layers)
        hi = step - rng.choice([0, 0, 1, 3])
        lo = hi - rng.choice([0, 3, 8, 40])
        reason = loss._stuck_now(fast, lo, hi, TRIMMED)
        assert reason == _BEFORE["_stuck_now"](slow, lo, hi, TRIMMED), (i, lo, hi)
        reasons.add(reason)
        for name in names:
            assert loss._newest_recent(fast, name, hi) == _BEFORE["_newest_recent"](slow, name, hi), (i, name)
            assert loss._low_norm_recent(fast, name, small) == \
                _BEFORE["_low_norm_recent"](slow, name, small), (i, name)
    assert {"", "dead", "died"} <= reasons  # (and "small" / "lr0" on some seeds)
