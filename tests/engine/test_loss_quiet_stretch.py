"""The loss curve's quiet stretches (issue 15, stop 40): after a value on which no rule holds, the curve
proves for how many more points of the tail the oscillation and plateau rules cannot hold, whatever the
values (``loss._quiet_stretch``: bounds on the window's order statistics and on the rank test), and on
those values checks only what the other rules read (``loss._stays_quiet``) instead of judging the four
rules. It must change nothing: on every corpus scenario and on synthetic streams built to sit on the
rules' thresholds (levels about oscillation_min_level / plateau_min_level / plateau_stalled_min_level x
the start, a rank test at its bar, grad norms about plateau_small_grad, an LR dropping to 0, dead layers,
blow-ups, non-finite values, late points, replays, trims), delivered in pieces with snapshot restores,
the outputs and snapshots equal those of a pipeline that judges every value (the fast path off). And on
every value the fast path takes, an oracle judges the four rules on a copy of the state (each must say
"does not hold") and checks on the window itself what the certificate claimed (its median under each
level, the rank test, the blow-up bar) -- on the synthetic streams and on edge streams that make each
bound tight (a mutation of any bound, or of any per-value test, fails them). (Both pipelines are restored
at the same cuts: a restore keeps a series' late points in step order, not in arrival order, so recent()
may read other points after it than before -- true before this change too.)"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Dict, Iterator, List

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.pipeline import Pipeline

PURE = pytest.mark.engine_pure("replaces loss._stays_quiet with a counting copy")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
SMALL_HISTORY = DetectionSettings.from_overrides({"history_len": 48})
Event = Dict[str, Any]


class _Off:
    """The fast paths switched off (every value judged by the four rules; an open plateau's window median
    taken on every value), and a count of the quiet one's use."""

    def __init__(self) -> None:
        self.saved = loss._stays_quiet
        self.saved_held = loss._level_held
        self.taken = 0

    def counting(self, *args: Any) -> bool:
        answer = self.saved(*args)
        self.taken += answer
        return answer

    def __enter__(self) -> _Off:
        loss._stays_quiet = lambda *a: False  # type: ignore[assignment]
        loss._level_held = lambda *a: False  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._stays_quiet = self.saved  # type: ignore[assignment]
        loss._level_held = self.saved_held  # type: ignore[assignment]


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37, restore_every: int = 3) -> int:
    """Both pipelines over ``events`` in pieces (both restored from the fast one's snapshot every few pieces:
    the fast path's kept certificate is lost there): the same outputs and snapshots piece by piece; how
    many values took the fast path."""
    counter = _Off()
    fast, slow = Pipeline(settings), Pipeline(settings)
    for k, lo in enumerate(range(0, len(events), piece)):
        part = events[lo:lo + piece]
        loss._stays_quiet = counter.counting  # type: ignore[assignment]
        try:
            out_fast = fast.process(part)
        finally:
            loss._stays_quiet = counter.saved  # type: ignore[assignment]
        with _Off():
            out_slow = slow.process(part)
        assert out_fast == out_slow, lo
        blob = fast.snapshot()
        assert blob == slow.snapshot(), lo
        if k % restore_every == restore_every - 1:  # (both: a restore keeps late points by step, not in
            fast = Pipeline.restore(blob, settings)   # arrival order, so recent() may read other points)
            slow = Pipeline.restore(blob, settings)
    assert fast.incidents() == slow.incidents()
    return counter.taken


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS if s.source == "cpu"])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, SETTINGS)
    _compare(events, SMALL_HISTORY, piece=11)


def _loss_stream(seed: int) -> Iterator[Event]:
    """One rank's SDK-shaped metric envelopes: a loss that falls from ~2 to a level drawn about the rules'
    thresholds and hovers there with noise, then may jump to another level (back near its start, above
    it, far above it: the rules start to hold there, some values after the jump), drift, blow up once or
    go non-finite; a grad norm about plateau_small_grad at times or collapsing from its early level, an
    LR that may drop to 0, per-layer norms with a dead layer at times; late points and replays."""
    rng = random.Random(seed)
    start = 2.0
    targets = [SETTINGS.oscillation_min_level, SETTINGS.plateau_min_level,
               SETTINGS.plateau_stalled_min_level, 0.5, 0.2, 1.0, 0.79, 0.81, 0.89, 0.91, 0.6, 0.3]
    level = rng.choice(targets) * start
    jump_at = rng.choice([10 ** 9, 140, 200, 260])
    jump_to = rng.choice([0.6, 0.85, 0.95, 1.0, 1.2, 5.0, 0.1]) * start
    noise = rng.choice([0.001, 0.02, 0.1, 0.4])
    grad = rng.choice([1.0, 1.0, 1.0, SETTINGS.plateau_small_grad, 2 * SETTINGS.plateau_small_grad, 0.5])
    collapse_at = rng.choice([10 ** 9, 10 ** 9, 10 ** 9, 120])
    lr_zero_at = rng.choice([10 ** 9, 10 ** 9, 10 ** 9, 150, 300])
    dead_at = rng.choice([10 ** 9, 10 ** 9, 10 ** 9, 200])
    blow_at = rng.choice([10 ** 9, 250]) if seed % 3 == 0 else 10 ** 9
    nan_at = rng.choice([10 ** 9, 330]) if seed % 5 == 0 else 10 ** 9
    drift = rng.choice([0.0, 0.0, 0.002, -0.001, 0.01, 0.02])
    fall_steps = rng.choice([30, 60])
    base_ns = 1_700_000_000_000_000_000
    out: List[Event] = []
    for step in range(420):
        now = level if step < jump_at else jump_to
        fall = start + (now - start) * min(1.0, step / fall_steps) if step < jump_at else now
        value = max(1e-6, fall * (1 + noise * rng.gauss(0, 1)) + drift * max(0, step - 100))
        if step == blow_at:
            value = start * 2000
        if step == nan_at:
            value = math.nan
        norm = grad * (0.02 if step >= collapse_at else 1.0)
        points: List[Dict[str, Any]] = [
            {"name": "loss", "value": value},
            {"name": "grad/global_norm", "value": abs(norm * (1 + 0.3 * rng.gauss(0, 1)))},
            {"name": "opt/lr", "value": 0.0 if step >= lr_zero_at else 0.01}]
        if step % 10 == 0:
            points += [{"name": "grad/layer/0", "value": 0.0 if step >= dead_at else 0.1},
                       {"name": "grad/layer/1", "value": 0.2}]
        out.append({"project": "p", "run_id": f"quiet-{seed}", "host": "h", "pid": 1, "rank": 0,
                    "world_size": 1, "event_id": f"e{seed}-{step}", "step": step,
                    "time_unix_nano": base_ns + step * 10 ** 8, "severity": "INFO",
                    "metrics": {"points": [dict(p, value=float(p["value"])) for p in points]}})
    if seed % 4:
        for i in range(20, len(out) - 3, rng.choice([17, 41, 97])):  # late points
            out[i], out[i + 2] = out[i + 2], out[i]
        for i in range(33, len(out), 71):  # replays
            out.insert(i, json.loads(json.dumps(out[i - 5], allow_nan=True)))
    yield from out


VARIANTS = (SETTINGS, SMALL_HISTORY,
            DetectionSettings.from_overrides({"oscillation_min_level": 1.0, "plateau_min_level": 1.0,
                                              "plateau_stalled_min_level": 0.5}),
            DetectionSettings.from_overrides({"loss_window": 24, "rise_smooth": 3, "trend_z": 1.0}))


class _Oracle:
    """On every value the fast path takes, the four rules judged on a copy of the state (the window as the
    loop would build it): each must answer the shared "does not hold", and no flat stretch be there; and
    the window must be as the certificate claims (the bounds it proved hold on the window itself)."""

    def __init__(self) -> None:
        self.saved = loss._stays_quiet
        self.taken = 0
        self.failed: List[str] = []  # (the pipeline quarantines a run whose detector raises: kept here)

    def __call__(self, rank: Any, state: Dict[str, Any], series: Any, tail: Any, initial: float,
                 settings: DetectionSettings) -> bool:
        answer = self.saved(rank, state, series, tail, initial, settings)
        if answer:
            self.taken += 1
            try:
                self._check(rank, state, series, tail, initial, settings)
            except AssertionError as exc:
                self.failed.append(f"step {series[-1][0]}: {exc!r}")
        return answer

    @staticmethod
    def _check(rank: Any, state: Dict[str, Any], series: Any, tail: Any, initial: float,
               settings: DetectionSettings) -> None:
        copied = copy.deepcopy(state)
        win = loss._Window(series, settings.loss_window, tail)
        for kind in loss.CURVE_KINDS:
            check = loss._CHECKS[kind](rank, state["metric"], series, win, initial, copied, settings,
                                       settings, False)
            assert check is loss._NOT_HOLDING, kind
        assert "flat" not in state
        # and what the certificate claims of the window, whatever the rules made of it: its median under
        # each rule's level, the rank test still "lower", every value under the blow-up bar
        med, ordered, first = win.median, win.ordered, state["init"][0]
        assert win.full and med < settings.oscillation_min_level * min(initial, first), med
        assert med < settings.plateau_min_level * initial, med
        assert med / initial < settings.plateau_stalled_min_level, med
        if state.get("early"):
            assert -loss._rank_z_above(state["early"], ordered) >= settings.trend_z, "rank"
        base = loss.divergence_base(initial, first, settings)
        assert not ordered[-1] >= settings.divergence_blowup_factor * base, ordered[-1]


def _edge_values(kind: str, offset: int) -> List[float]:
    """Loss values that put the certificate's bounds on edge (initial level 2.0, jitter 1e-4): ``step``, a
    window of a low level whose newest quarter already sits over the oscillation / plateau-stalled level
    (0.8 x 2), then a jump: the median crosses exactly one value after the bound says it can; ``rank``,
    early values spread so that the rank test is just "lower", then values over most early ones;
    ``stalled`` (for the settings whose stalled level is the lowest), the same as ``step`` about 0.5 x 2;
    ``diverge``, a low level, then a smooth climb past divergence_factor x 2 (the rolling level crosses
    while the window's median is still low); ``blow``, one value past the blow-up bar. ``offset``: flat values before, so that some certificate is
    taken exactly where the bound is tight."""
    jitter = [1e-4 * ((k * 7) % 5 - 2) for k in range(400)]
    if kind == "rank":
        head = [2.0, 2.0, 2.0, 1.9, 3.0, 0.6, 2.0, 3.0, 3.5, 2.0]  # one early value under 1.3
        body = [1.3] * (40 + offset) + [2.5] * 40
    elif kind == "stalled":
        head, body = [2.0] * 10, [0.9] * (30 + offset) + [1.05] * 10 + [3.0] * 40
    elif kind == "diverge":
        head, body = [2.0] * 10, [1.2] * (40 + offset) + [4.5 + 0.5 * k for k in range(30)]
    elif kind == "blow":
        head, body = [2.0] * 10, [1.5] * (40 + offset) + [5000.0] + [1.5] * 40
    else:
        head, body = [2.0] * 10, [1.5] * (30 + offset) + [1.75] * 10 + [3.0] * 40
    return head + [v + jitter[k] for k, v in enumerate(body)]


def _events_of(values: List[float], run_id: str) -> List[Event]:
    base_ns = 1_700_000_000_000_000_000
    return [{"project": "p", "run_id": run_id, "host": "h", "pid": 1, "rank": 0, "world_size": 1,
             "event_id": f"{run_id}-{step}", "step": step, "time_unix_nano": base_ns + step * 10 ** 8,
             "severity": "INFO", "metrics": {"points": [{"name": "loss", "value": float(v)},
                                                        {"name": "grad/global_norm", "value": 1.0},
                                                        {"name": "opt/lr", "value": 0.01}]}}
            for step, v in enumerate(values)]


@PURE
@pytest.mark.parametrize("kind", ("step", "rank", "stalled", "diverge", "blow"))
def test_the_bounds_on_edge(kind: str) -> None:
    settings = VARIANTS[2] if kind == "stalled" else SETTINGS
    taken = 0
    for offset in range(24):
        oracle = _Oracle()
        loss._stays_quiet = oracle  # type: ignore[assignment]
        try:
            Pipeline(settings).process(_events_of(_edge_values(kind, offset), f"{kind}-{offset}"))
        finally:
            loss._stays_quiet = oracle.saved  # type: ignore[assignment]
        assert not oracle.failed, (offset, oracle.failed[:3])
        taken += oracle.taken
    assert taken > 24 * 10, taken


@pytest.mark.parametrize("seed", range(64))
def test_every_fast_value_is_one_no_rule_holds_on(seed: int) -> None:
    settings = VARIANTS[seed % len(VARIANTS)]
    oracle = _Oracle()
    loss._stays_quiet = oracle  # type: ignore[assignment]
    try:
        Pipeline(settings).process(list(_loss_stream(seed)))
    finally:
        loss._stays_quiet = oracle.saved  # type: ignore[assignment]
    assert not oracle.failed, oracle.failed[:3]


@pytest.mark.parametrize("seed", range(48))
def test_synthetic_streams_on_the_thresholds_are_unchanged(seed: int) -> None:
    events = list(_loss_stream(seed))
    _compare(events, VARIANTS[seed % len(VARIANTS)], piece=23 + seed % 5)


@PURE
def test_the_fast_path_is_taken_on_quiet_values() -> None:
    taken = sum(_compare(list(_loss_stream(seed)), SETTINGS) for seed in range(48))
    healthy = sum(_compare(s.events(), SETTINGS) for s in SCENARIOS if s.source == "cpu" and s.expected is None)
    assert taken > 500 and healthy > 100, (taken, healthy)  # (973 and 235 when written: most quiet values
    #   of the synthetic streams sit where nothing moves the weights or on a threshold, judged in full)


def _plateau_then(kind: str, offset: int) -> List[float]:
    """A loss flat about its start (an open plateau), then stepping down to 0.85 x it: under
    plateau_min_level (0.9) x it, over the level test's 0.8 x the plateau's level (``down``: the plateau
    clears on the window test, once the window's median passes the bar), first through values just over
    the bar (``edge``: the window's lower half sits there, the bound is tight)."""
    jitter = [1e-3 * ((k * 7) % 5 - 2) for k in range(700)]
    if kind == "edge":
        body = [2.0] * (300 + offset) + [1.81] * 20 + [1.7] * 60
    else:
        body = [2.0] * (300 + offset) + [1.7] * 60
    return [v + jitter[k] for k, v in enumerate(body)]


@PURE
@pytest.mark.parametrize("kind", ("down", "edge"))
def test_an_open_plateaus_held_window_level_is_as_certified(kind: str) -> None:
    """On every value the open plateau's window test is skipped (``loss._level_held``), the window's median
    is at or over the bar; and the run's outputs and snapshots equal those with the test made every time."""
    saved = loss._level_held
    held = 0
    failed: List[str] = []

    def oracle(tail: Any, bar: float, settings: DetectionSettings) -> bool:
        nonlocal held
        answer = saved(tail, bar, settings)
        if answer:
            held += 1
            values = sorted(v for _s, v, _t in tail.points[-settings.loss_window:])
            median = (values[19] + values[20]) / 2
            if not median >= bar:
                failed.append(f"{tail.points[-1][0]}: {median} < {bar}")
        return answer

    for offset in range(24):
        events = _events_of(_plateau_then(kind, offset), f"{kind}-{offset}")
        loss._level_held = oracle  # type: ignore[assignment]
        try:
            fast = Pipeline(SETTINGS)
            out_fast = fast.process(events)
        finally:
            loss._level_held = saved  # type: ignore[assignment]
        with _Off():
            slow = Pipeline(SETTINGS)
            out_slow = slow.process(events)
        assert out_fast == out_slow and fast.snapshot() == slow.snapshot(), offset
        assert [(i.subtype, i.status) for i in slow.incidents()] == [("plateau", "resolved")], offset
    assert not failed, failed[:3]
    assert held > 24 * 100, held
