"""The diagnosis' loss min / max and grad-norm max kept beside the series' tail (issue 15, stop 41): an
incident is enriched on every finding applied to it (an open plateau's refresh every ``loss_window // 4``
values), and ``_facts`` took min() and max() over the whole kept series each time; ``diagnosis._extremes``
keeps them beside the tail and looks only at the points that arrived since. It must change nothing: on
every call an oracle compares its answer with ``_least`` / ``_most`` of the same points (the same floats,
sign of zero included), on every corpus scenario, the synthetic threshold streams (non-finite values, late
points, replays, trims) and long open plateaus, delivered in pieces with snapshot restores; and the outputs
and snapshots equal those of a pipeline that takes min() and max() every time, piece by piece."""

from __future__ import annotations

import math
from typing import Any, ContextManager, Dict, List, Optional, Tuple
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import SMALL_HISTORY, VARIANTS, _events_of, _loss_stream
from tests.engine.test_plateau_block_slope import _open_plateau
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import diagnosis
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.state import SeriesTail

PURE = pytest.mark.engine_pure("replaces diagnosis._extremes with its plain version")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]
Pair = Tuple[Optional[float], Optional[float]]


def _plain(values: Any, finite: bool, tail: Any) -> Pair:
    return diagnosis._least(values, finite), diagnosis._most(values, finite)


def _same(a: Pair, b: Pair) -> bool:
    return [repr(x) for x in a] == [repr(x) for x in b]  # (repr: -0.0 is not 0.0)


class _Oracle:
    def __init__(self) -> None:
        self.saved = diagnosis._extremes
        self.calls = self.kept = 0
        self.failed: List[str] = []

    def __call__(self, values: Any, finite: bool, tail: Any) -> Pair:
        self.kept += tail is not None and finite and values is tail.points and \
            diagnosis.EXTREMES_KEY in tail.windows
        answer = self.saved(values, finite, tail)
        self.calls += 1
        truth = _plain(values, finite, tail)
        if not _same(answer, truth):
            self.failed.append(f"{answer} != {truth}")
        return answer

    def __enter__(self) -> _Oracle:
        diagnosis._extremes = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        diagnosis._extremes = self.saved  # type: ignore[assignment]


def _slow() -> ContextManager[object]:
    """The extremes scanned from the whole series on every refresh (the kept ones off)."""
    return patch.object(diagnosis, "_extremes", _plain)


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37, restore_every: int = 3) -> _Oracle:
    oracle = _Oracle()
    run_fast_and_slow(events, settings, oracle, _slow, piece, restore_every)
    assert not oracle.failed, oracle.failed[:3]
    return oracle


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, SETTINGS)
    _compare(events, SMALL_HISTORY, piece=11, restore_every=2)


@pytest.mark.parametrize("seed", range(48))
def test_synthetic_threshold_streams_are_unchanged(seed: int) -> None:
    _compare(list(_loss_stream(seed)), VARIANTS[seed % len(VARIANTS)], piece=23 + seed % 5)


@PURE
@pytest.mark.parametrize("seed", range(12))
def test_open_plateaus_are_unchanged_and_kept(seed: int) -> None:
    settings = (SETTINGS, SMALL_HISTORY, VARIANTS[3])[seed % 3]
    oracle = _compare(_events_of(_open_plateau(seed), f"flat-{seed}"), settings, piece=41 + seed)
    assert oracle.calls > 40 and oracle.kept > oracle.calls // 2, (oracle.calls, oracle.kept)


def test_the_first_of_equals_and_the_sign_of_zero() -> None:
    for values in ([0.0, -0.0, 0.0, -0.0], [-0.0, 0.0, 1.0, -0.0, 0.0], [1.0, 1.0, 2.0, 2.0, -0.0, 0.0],
                   [3.0, -1e-300, 1e300, -1e300, 0.0, 7.0], [math.sin(k) for k in range(50)]):
        data: Dict[int, Any] = {}
        tail = SeriesTail(data)
        for step, v in enumerate(values):
            data[step] = (v, 0)
            tail.append(step, v, 0)
            for _again in range(2):  # (a second call with nothing new)
                assert _same(diagnosis._extremes(tail.points, True, tail), _plain(tail.points, True, tail))
    assert _same(diagnosis._extremes([(1, math.nan, 0), (2, 1.0, 0)], False, None), (1.0, 1.0))
    assert diagnosis._extremes([], True, None) == (None, None)
