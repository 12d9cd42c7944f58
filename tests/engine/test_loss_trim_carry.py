"""What the loss curve keeps beside its tail survives a history trim (issue 15, stop 41): a series is trimmed
back to ``history_len`` points each time it reaches twice as many, and its tail is then a slice of the old
one (``SeriesTail.trimmed``); the curve's derived state there -- sorted windows and their Mann-Kendall S, the
quiet certificate, an open plateau's held level, the block medians -- used to be dropped with the old tail
and taken anew (a sort, an O(n log n) S, a full judgement of the four rules). It now moves its point indices
back by the points dropped (``loss._Derived.shifted``). It must change nothing: the outputs and snapshots
equal those of a pipeline that drops it at each trim, piece by piece with restores, on every corpus scenario
and the synthetic threshold and open-plateau streams, with the default history and a short one (a trim every
24-64 values); on every read an oracle checks the kept sorted window and S against sorted() and
robust.mann_kendall of the window's values; and each kept part is carried (not only dropped)."""

from __future__ import annotations

from typing import Any, ContextManager, Dict, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import SMALL_HISTORY, VARIANTS, _events_of, _loss_stream
from tests.engine.test_plateau_block_slope import _open_plateau
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import robust
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.state import SeriesTail

PURE = pytest.mark.engine_pure("replaces loss._sorted_window / _kept_trend and _Derived.shifted with oracles")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
SHORT = DetectionSettings.from_overrides({"history_len": 24, "loss_window": 20})
Event = Dict[str, Any]


class _Oracle:
    """Counts what a trim carries; checks every kept sorted window and S read against their definitions."""

    def __init__(self) -> None:
        self.saved = (loss._Derived.shifted, loss._sorted_window, loss._kept_trend)
        self.carried: Dict[str, int] = {"trims": 0, "sorted": 0, "kendall": 0, "quiet": 0, "held": 0,
                                        "blocks": 0}
        self.failed: List[str] = []

    def shifted(self, kept: Any, drop: int) -> bool:
        c = self.carried
        c["trims"] += 1
        answer = self.saved[0](kept, drop)
        c["sorted"] += len(kept.ends)
        c["kendall"] += len(kept.kendall)
        c["quiet"] += kept.quiet is not None
        c["held"] += kept.held is not None
        c["blocks"] += len(kept.blocks)
        return answer

    def sorted_window(self, tail: SeriesTail, width: int) -> List[float]:
        answer = self.saved[1](tail, width)
        truth = sorted(v for _s, v, _t in tail.points[-width:])
        if [repr(v) for v in answer] != [repr(v) for v in truth]:
            self.failed.append(f"sorted at {tail.points[-1][0]}")
        return answer

    def kept_trend(self, tail: SeriesTail, width: int) -> robust.MannKendall:
        answer = self.saved[2](tail, width)
        truth = robust.mann_kendall([v for _s, v, _t in tail.points[-width:]])
        if answer != truth:
            self.failed.append(f"trend at {tail.points[-1][0]}: {answer} != {truth}")
        return answer

    def __enter__(self) -> _Oracle:
        oracle = self
        loss._Derived.shifted = lambda kept, drop: oracle.shifted(kept, drop)  # type: ignore[method-assign]
        loss._sorted_window = self.sorted_window  # type: ignore[assignment]
        loss._kept_trend = self.kept_trend  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._Derived.shifted, loss._sorted_window, loss._kept_trend = self.saved  # type: ignore[method-assign]


def _dropped() -> ContextManager[object]:
    """As before: a trim drops what the curve kept (taken anew)."""
    return patch.object(loss._Derived, "shifted", lambda kept, drop: False)


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37, restore_every: int = 3) -> _Oracle:
    oracle = _Oracle()
    run_fast_and_slow(events, settings, oracle, _dropped, piece, restore_every)
    assert not oracle.failed, oracle.failed[:3]
    return oracle


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, SETTINGS)
    _compare(events, SHORT, piece=11, restore_every=2)


@pytest.mark.parametrize("seed", range(48))
def test_synthetic_threshold_streams_are_unchanged(seed: int) -> None:
    settings = (SHORT, SMALL_HISTORY, *VARIANTS)[seed % (2 + len(VARIANTS))]
    _compare(list(_loss_stream(seed)), settings, piece=23 + seed % 5)


@pytest.mark.parametrize("seed", range(12))
def test_open_plateaus_are_unchanged(seed: int) -> None:
    settings = (SETTINGS, SHORT, SMALL_HISTORY)[seed % 3]
    _compare(_events_of(_open_plateau(seed), f"flat-{seed}"), settings, piece=41 + seed)


def _converging(seed: int) -> List[float]:
    """A loss that fell from 2 to ~0.5 and hovers there with noise: quiet values, certificates at trims."""
    return [2.0 + 0.01 * (k % 3) for k in range(10)] + \
        [0.5 + 0.02 * (((k * 7919 + seed * 13) % 11) - 5) / 5 for k in range(600)]


@pytest.mark.parametrize("seed", range(6))
def test_converging_runs_are_unchanged(seed: int) -> None:
    settings = (SETTINGS, SHORT, SMALL_HISTORY)[seed % 3]
    _compare(_events_of(_converging(seed), f"down-{seed}"), settings, piece=29 + seed)


@PURE
@pytest.mark.parametrize("at", range(120, 142))
def test_a_blow_up_right_after_a_trim_is_judged(at: int) -> None:
    """A converging run (quiet certificates on most values) whose loss blows up once about its first trim
    (129 points with the default history: the points after a carried certificate's are checked against its
    blow-up bar, from the index it moved to)."""
    values = _converging(at)
    values[at] = 5000.0
    oracle = _compare(_events_of(values, f"blow-{at}"), SETTINGS, piece=10 ** 9)
    assert oracle.carried["trims"] >= 1


@PURE
def test_each_kept_part_is_carried() -> None:
    """Each part is carried over some trim (the test above would pass, trivially, if all were dropped)."""
    total: Dict[str, int] = {}
    streams = [(list(_loss_stream(seed)), SETTINGS) for seed in range(16)] + \
        [(_events_of(_open_plateau(seed), f"flat-{seed}"), settings)
         for seed in range(6) for settings in (SETTINGS, SMALL_HISTORY)] + \
        [(_events_of(_converging(seed), f"down-{seed}"), settings)
         for seed in range(3) for settings in (SETTINGS, SMALL_HISTORY)]
    for events, settings in streams:
        oracle = _compare(events, settings, piece=10 ** 9)
        for k, v in oracle.carried.items():
            total[k] = total.get(k, 0) + v
    assert all(total[k] > 10 for k in total), total


def test_a_shift_moves_every_index_and_drops_what_reached_the_dropped_points() -> None:
    data: Dict[int, Any] = {}
    tail = SeriesTail(data)
    for step in range(100):
        data[step] = (float(step % 7), 0)
        tail.append(step, float(step % 7), 0)
    kept = loss._derived(tail)
    loss._sorted_window(tail, 40)
    loss._kept_trend(tail, 40)
    loss._kept_block_slope(tail, 40)
    kept.quiet = loss._Quiet(SETTINGS, 98, 5, 1.0, 10.0)
    kept.held = [SETTINGS, 1.0, 100, 3]
    assert kept.shifted(30)
    assert kept.ends == {40: 70} and kept.kendall[40][0] == 70 and min(kept.blocks) == 30
    assert kept.quiet is not None and (kept.quiet.at, kept.quiet.checked) == (68, 68)
    assert kept.held[2] == 70
    assert kept.shifted(35)  # now the windows reach into the dropped points: gone
    assert kept.ends == {} and kept.sorted == {} and kept.kendall == {} and kept.quiet is None and \
        kept.held is None and min(kept.blocks) == 3  # (blocks 30, 34, ... -> 3, 7, ...)
