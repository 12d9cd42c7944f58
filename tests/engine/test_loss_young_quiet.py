"""The loss curve's young windows (issue 15, stop 45): on a value whose window is not full yet (fewer than
``loss_window`` values since the run's baseline), the oscillation and plateau rules cannot hold (their first
test), so ``loss._young_quiet`` proves "no rule holds" from the rise and divergence rules' own first tests
(the rise rule's fall and rise, the divergence rule's blow-up scan and rolling level), made exactly, instead
of judging the four rules. It must change nothing: on every corpus scenario, on the synthetic streams of
test_loss_quiet_stretch and on young-window edge streams (a blow-up the loss came back from, a fall and
rebound, a fast climb, an early blow-up, a loss still over the blow-up bar, late points and replays), in
pieces with snapshot restores, the outputs and snapshots equal those of a pipeline that judges every value;
and on every value the young path takes, the four rules judged on a copy of the state each answer the shared
"does not hold" and leave that copy as it was."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import VARIANTS, _events_of, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.pipeline import Pipeline

PURE = pytest.mark.engine_pure("replaces loss._young_quiet / on_curve with an oracle and deep-copies states")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()


class _Oracle:
    """Counts the young path's answers; on each True, the four rules judged on a copy of the state (the
    window as the caller's loop builds it) must each answer the shared "does not hold", the window must not
    be full, and the rules must leave the copy as it was (the loop then only zeroes the streaks)."""

    def __init__(self) -> None:
        self.saved = loss._young_quiet
        self.taken = 0
        self.refused = 0
        self.failed: List[str] = []  # (the pipeline quarantines a run whose detector raises: kept here)

    def __call__(self, state: Dict[str, Any], series: Any, tail: Any, initial: float,
                 settings: DetectionSettings) -> bool:
        answer = self.saved(state, series, tail, initial, settings)
        if not answer:
            self.refused += 1
            return answer
        self.taken += 1
        try:
            copied = copy.deepcopy(state)
            before = copy.deepcopy(state)
            win = loss._Window(series, settings.loss_window, tail)
            assert not win.full, len(series)
            rank = _Oracle.rank
            for kind in loss.CURVE_KINDS:
                check = loss._CHECKS[kind](rank, state["metric"], series, win, initial, copied, settings,
                                           settings, False)
                assert check is loss._NOT_HOLDING, kind
            assert copied == before, "state changed"
            assert loss._derived(tail).quiet is None
        except AssertionError as exc:
            self.failed.append(f"step {series[-1][0]}: {exc!r}")
        return answer

    rank: Any = None


class _oracle:  # (a context, re-entered around each piece of the fast pipeline)
    """The oracle in place of loss._young_quiet; the rank it judges on is taken from on_curve's call."""

    def __init__(self, oracle: _Oracle) -> None:
        self.oracle = oracle
        self.saved_curve = loss.on_curve

    def __enter__(self) -> _Oracle:
        saved_curve = self.saved_curve

        def on_curve(run: Any, rank: Any, *args: Any) -> Any:
            _Oracle.rank = rank
            return saved_curve(run, rank, *args)

        loss._young_quiet = self.oracle  # type: ignore[assignment]
        loss.on_curve = on_curve  # type: ignore[assignment]
        return self.oracle

    def __exit__(self, *exc: Any) -> None:
        loss._young_quiet = self.oracle.saved  # type: ignore[assignment]
        loss.on_curve = self.saved_curve  # type: ignore[assignment]


@contextmanager
def _off() -> Iterator[None]:
    """The young path off: every young value judged by the four rules."""
    saved = loss._young_quiet
    loss._young_quiet = lambda *a: False  # type: ignore[assignment]
    try:
        yield
    finally:
        loss._young_quiet = saved  # type: ignore[assignment]


def _young_values(kind: str, at: int) -> List[float]:
    """Loss values about a start of 2.0 (the blow-up bar 1000 x 2 = 2000, the early blow-up bar 10 x 2, the
    divergence level 2 x 2) whose event falls ``at`` values after the baseline, inside the young window:
    ``blow``, one value of 5000 then back at 1.9; ``over``, values staying over the blow-up bar; ``early``,
    one of the first values at 30 (an early blow-up, judged once a window is full); ``rise``, a fall to 0.4
    then a rebound to 1.6; ``climb``, a climb past 4 (the rolling level crosses the divergence bar);
    ``fall``, a healthy fall (every young value quiet)."""
    jitter = [1e-3 * ((k * 7) % 5 - 2) for k in range(200)]
    head = [2.0, 2.02, 1.98, 2.01, 1.99]
    n = 120
    if kind == "blow":
        body = [1.9] * n
        body[at] = 5000.0
    elif kind == "over":
        body = [1.9] * at + [3000.0] * 6 + [1.9] * (n - at - 6)
    elif kind == "early":
        body = [1.9] * n
        body[min(at, 4)] = 30.0
    elif kind == "rise":
        body = [2.0 - 1.6 * min(1.0, k / (at + 4)) for k in range(at + 4)]
        body += [0.4 + 1.2 * min(1.0, k / 8) for k in range(n - len(body))]
    elif kind == "climb":
        body = [2.0 + 0.3 * max(0, k - at) for k in range(n)]
    else:
        body = [0.8 + 1.2 * 0.97 ** k for k in range(n)]
    return head + [v + jitter[k] for k, v in enumerate(body)]


KINDS = ("blow", "over", "early", "rise", "climb", "fall")


@PURE
@pytest.mark.parametrize("kind", KINDS)
def test_every_young_value_taken_is_one_no_rule_holds_on(kind: str) -> None:
    oracle = _Oracle()
    for at in range(0, 34, 3):
        with _oracle(oracle):
            Pipeline(SETTINGS).process(_events_of(_young_values(kind, at), f"{kind}-{at}"))
    assert not oracle.failed, oracle.failed[:3]
    assert oracle.taken > 12 * 5, oracle.taken
    if kind not in ("fall", "early"):  # (each edge stream reaches the test it was built for: the rules
        assert oracle.refused > 0, kind  # judged there; an early blow-up is judged on a full window only)


@pytest.mark.parametrize("kind", KINDS)
def test_young_edge_streams_are_unchanged(kind: str) -> None:
    for at in range(0, 34, 5):
        events = _events_of(_young_values(kind, at), f"{kind}-{at}")
        run_fast_and_slow(events, SETTINGS, _oracle(_Oracle()), _off, piece=7 + at % 5)


@pytest.mark.parametrize("seed", range(0, 48, 3))
def test_synthetic_streams_are_unchanged(seed: int) -> None:
    oracle = _Oracle()
    run_fast_and_slow(list(_loss_stream(seed)), VARIANTS[seed % len(VARIANTS)], _oracle(oracle), _off,
                      piece=5 + seed % 7)
    assert not oracle.failed, oracle.failed[:3]


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS if s.source == "cpu"])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    oracle = _Oracle()
    run_fast_and_slow(next(s for s in SCENARIOS if s.name == scenario).events(), SETTINGS, _oracle(oracle),
                      _off)
    assert not oracle.failed, oracle.failed[:3]


@PURE
def test_the_young_path_is_taken() -> None:
    """Most young values of a healthy run take it (the full judgement is left to the values a rule may
    hold on)."""
    oracle = _Oracle()
    with _oracle(oracle):
        Pipeline(SETTINGS).process(_events_of(_young_values("fall", 0), "fall"))
    # the values after the 5 baseline ones (the 5th completes it) until the window is full (40) -- all young
    assert oracle.taken == SETTINGS.loss_window - SETTINGS.loss_baseline_points - 1, oracle.taken
    assert oracle.refused == 0
