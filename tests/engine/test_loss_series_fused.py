"""The loss curve's per-value reads, fused (issue 15, stop 47, hS): ``loss._loss_series`` answers what
``recent()``, ``_exact_tail()`` and ``_initial()`` answered one after the other (the last ``loss_window``
points, their exact tail, the run's initial level), in one pass when recent() would answer with a plain slice
of the tail; ``loss._track_level`` takes the rolling median inline instead of through ``_median_of``. Neither
may change anything: on every call an oracle compares the fused answer with the three calls' (the same points
in the same order, the same tail object, the same initial level bit for bit) and the state ``_track_level``
leaves with the one the reference leaves (the same keys in the same order, levels bit for bit), on every corpus
scenario and on the synthetic threshold streams of test_loss_quiet_stretch, delivered in pieces with snapshot
restores; and the outputs and snapshots equal those of a pipeline on the reference reads, piece by piece."""

from __future__ import annotations

import copy
import struct
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import SMALL_HISTORY, VARIANTS, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.detectors.numeric import recent
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RankState, SeriesTail

PURE = pytest.mark.engine_pure("wraps loss._loss_series and loss._track_level with an oracle")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]
Points = Sequence[Tuple[int, float, int]]


def _series_ref(rank: RankState, name: str, most: int, upto: int, init: List[float]
                ) -> Tuple[Points, Optional[SeriesTail], float]:
    """What on_curve read before the fusion: three calls."""
    series = recent(rank, name, most, upto)
    tail = loss._exact_tail(rank, name, series)
    return series, tail, loss._initial(init, tail)


def _track_ref(state: Dict[str, Any], series: Points, tuned: DetectionSettings) -> None:
    """_track_level as it was (21e5b32): the level through _median_of."""
    width = tuned.rise_smooth
    if len(series) < width:
        return
    level = loss._median_of(series[-width:])
    centre = series[-(width // 2) - 1][0]
    state["levels"] = state.get("levels", 0) + 1
    if "best" not in state or level < state["best"]:
        state["best"], state["best_step"] = level, centre
    state["level"] = level


def _bits(value: Any) -> Any:
    """A float as its bytes (0.0 and -0.0 apart, NaN equal to itself); anything else as it is."""
    return struct.pack("<d", value) if isinstance(value, float) else value


def _same_state(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return list(a) == list(b) and all(_bits(a[k]) == _bits(b[k]) for k in a)


class _Oracle:
    """Wraps ``loss._loss_series`` and ``loss._track_level``: each answer must equal the reference's (failures
    collected: the pipeline quarantines a run whose detector raises); counts the calls that had an exact tail
    (every value of the fused path has one; a few of the three calls' have one too)."""

    def __init__(self) -> None:
        self.series, self.track = loss._loss_series, loss._track_level
        self._saved = (loss._loss_series, loss._track_level)  # put back on exit, whatever self.track became
        self.calls = self.fused = self.tracked = 0
        self.failed: List[str] = []

    def _loss_series(self, rank: RankState, name: str, most: int, upto: int, init: List[float]
                     ) -> Tuple[Points, Optional[SeriesTail], float]:
        answer = self.series(rank, name, most, upto, init)
        series, tail, initial = answer
        ref_series, ref_tail, ref_initial = _series_ref(rank, name, most, upto, init)
        self.calls += 1
        self.fused += tail is not None and rank.tails.get(name) is tail
        if list(series) != list(ref_series) or any(a is not b for a, b in zip(series, ref_series)) or \
                tail is not ref_tail or _bits(initial) != _bits(ref_initial):
            self.failed.append(f"rank {rank.rank} step {upto}: _loss_series differs")
        return answer

    def _track_level(self, state: Dict[str, Any], series: Points, tuned: DetectionSettings) -> None:
        expected = copy.deepcopy(state)
        _track_ref(expected, series, tuned)
        self.track(state, series, tuned)
        self.tracked += 1
        if not _same_state(state, expected):
            self.failed.append(f"step {series[-1][0] if series else None}: _track_level differs")

    def __enter__(self) -> _Oracle:
        loss._loss_series = self._loss_series  # type: ignore[assignment]
        loss._track_level = self._track_level  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._loss_series, loss._track_level = self._saved  # type: ignore[assignment]


@contextmanager
def _slow() -> Iterator[None]:
    """The reference reads in place: three calls per value, the rolling median through _median_of."""
    with ExitStack() as stack:
        saved_series, saved_track = loss._loss_series, loss._track_level
        loss._loss_series = _series_ref  # type: ignore[assignment]
        loss._track_level = _track_ref  # type: ignore[assignment]
        stack.callback(setattr, loss, "_loss_series", saved_series)
        stack.callback(setattr, loss, "_track_level", saved_track)
        yield


def _oracle_over(events: List[Event], settings: DetectionSettings, piece: int, restore_every: int) -> _Oracle:
    """The oracle around a pipeline over ``events`` in pieces, beside one on the reference reads (both
    restored from the first's snapshot every few pieces): same outputs and snapshots, no disagreement."""
    oracle = _Oracle()
    run_fast_and_slow(events, settings, oracle, _slow, piece, restore_every)
    assert not oracle.failed, oracle.failed[:3]
    return oracle


CASES: Dict[str, Tuple[Callable[[], List[Event]], DetectionSettings, int, int]] = {
    **{f"corpus-{s.name}": (s.events, SETTINGS, 37, 3) for s in SCENARIOS},
    **{f"corpus-{s.name}-short": (s.events, SMALL_HISTORY, 11, 2) for s in SCENARIOS},
    **{f"synthetic-{seed}": (partial(lambda k: list(_loss_stream(k)), seed), VARIANTS[seed % len(VARIANTS)],
                             23 + seed % 5, 3) for seed in range(24)},
}
"""Every corpus scenario (default settings; a short history, so trims move the tails) and the synthetic
threshold streams (incidents open, escalate, resolve and reopen there), by a readable id."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_reads_change_nothing(case: str) -> None:
    events, settings, piece, restore_every = CASES[case]
    _oracle_over(events(), settings, piece, restore_every)


@PURE
def test_both_paths_are_taken() -> None:
    """On the synthetic streams many values have an exact tail (the fused path's case) and many others do
    not (a non-finite or out-of-order point in the window: the three calls): both are checked above."""
    calls = fused = 0
    for seed in range(8):
        oracle = _oracle_over(list(_loss_stream(seed)), SETTINGS, 10 ** 9, 10 ** 9)
        calls, fused = calls + oracle.calls, fused + oracle.fused
    assert calls > 500 and calls // 4 < fused < calls - calls // 4, (fused, calls)


@PURE
def test_the_oracle_sees_a_different_level() -> None:
    """The oracle can fail: a rolling median that takes the lower middle value is caught -- and the module's
    own functions are back afterwards (the first version left the broken median in place: the loss tests
    that ran after it in the same process failed)."""
    originals = (loss._loss_series, loss._track_level)
    oracle = _Oracle()

    def lower_middle(state: Dict[str, Any], series: Points, tuned: DetectionSettings) -> None:
        _track_ref(state, series, tuned)
        if len(series) >= tuned.rise_smooth:
            state["level"] = sorted(v for _s, v, _t in series[-tuned.rise_smooth:])[tuned.rise_smooth // 2 - 1]

    oracle.track = lower_middle  # type: ignore[assignment]
    with oracle:
        Pipeline(SETTINGS).process(list(_loss_stream(0)))
    assert oracle.failed
    assert (loss._loss_series, loss._track_level) == originals


def test_no_window_reads_nothing_as_recent_does() -> None:
    """``most`` < 1 (a loss window of 0, only reachable past the settings' own minimum): the fused read answers
    as recent() does -- nothing -- instead of the whole tail (hR2's L2 of stop 47)."""
    pipeline = Pipeline(SETTINGS)
    pipeline.process(list(_loss_stream(0)))
    ranks = [rank for run in pipeline._runs.values() for rank in run.ranks.values() if rank.tails]
    assert ranks
    for rank in ranks:
        for name in rank.tails:
            assert recent(rank, name, 0, 10 ** 9) == []
            series, tail, _initial = loss._loss_series(rank, name, 0, 10 ** 9, [])
            assert list(series) == [] and tail is None
            assert list(loss._loss_series(rank, name, 5, 10 ** 9, [])[0]) == recent(rank, name, 5, 10 ** 9)
