"""The AMP rule's usual point in short (issue 15, stop 41): a batch whose GradScaler scale is the one kept, not
under the lowest, no overflow flag ever sent and a new step -- every envelope of a steady AMP run (env500) --
is folded by ``memory._amp_steady`` (the state writes :func:`memory._amp` makes on it, in the same order)
instead of the whole rule. It must change nothing: the outputs and snapshots equal those of a pipeline that
runs the whole rule on every batch, piece by piece with snapshot restores, on every corpus scenario and on
synthetic AMP streams (a constant scale, growth every N steps, halvings after overflows with and without
the flag, scales of 0, NaN and inf, late points and replays, a state restored without its lowest scale);
and the short path is taken on most of their batches."""

from __future__ import annotations

import json
import math
import random
from typing import Any, ContextManager, Dict, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import memory

PURE = pytest.mark.engine_pure("replaces memory._amp_steady / _steady_column with the slow path")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]


class _Counting:
    def __init__(self) -> None:
        self.saved = memory._amp_steady
        self.taken = 0

    def __call__(self, state: Dict[str, Any], scale_pt: Any) -> bool:
        answer = self.saved(state, scale_pt)
        self.taken += answer
        return answer

    def __enter__(self) -> _Counting:
        memory._amp_steady = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        memory._amp_steady = self.saved  # type: ignore[assignment]


def _whole() -> ContextManager[object]:
    """The whole rule on every batch (the short path off)."""
    return patch.object(memory, "_amp_steady", lambda state, scale_pt: False)


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37, restore_every: int = 3) -> int:
    counting = _Counting()
    run_fast_and_slow(events, settings, counting, _whole, piece, restore_every)
    return counting.taken


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, SETTINGS)
    _compare(events, SETTINGS, piece=11, restore_every=2)


def _amp_stream(seed: int) -> List[Event]:
    """One rank's batches with a loss and a GradScaler scale: constant, growing x2 every ``grow`` steps,
    halving after overflows (with the amp/overflow flag or without it), at times 0, NaN or inf; late
    points and replays."""
    rng = random.Random(seed)
    grow = rng.choice([10 ** 9, 50, 7])
    flags = rng.random() < 0.5
    overflow_at = set(rng.sample(range(20, 400), rng.choice([0, 1, 3, 12, 40])))
    odd_at = {rng.randrange(10, 400): rng.choice([0.0, math.nan, math.inf, -1.0]) for _ in range(seed % 3)}
    scale = 65536.0
    base_ns = 1_700_000_000_000_000_000
    out: List[Event] = []
    for step in range(420):
        points: List[Dict[str, Any]] = [{"name": "loss", "value": 2.0 / (1 + step / 50)}]
        if step in overflow_at:
            scale /= 2
            if flags:
                points.append({"name": "amp/overflow", "value": 1.0})
        elif step % grow == grow - 1:
            scale *= 2
        elif flags and step % 5 == 0:
            points.append({"name": "amp/overflow", "value": 0.0})
        points.append({"name": "amp/scale", "value": odd_at.get(step, scale)})
        out.append({"project": "p", "run_id": f"amp-{seed}", "host": "h", "pid": 1, "rank": 0, "world_size": 1,
                    "event_id": f"a{seed}-{step}", "step": step, "time_unix_nano": base_ns + step * 10 ** 8,
                    "severity": "INFO", "metrics": {"points": points}})
    if seed % 4:
        for i in range(20, len(out) - 3, rng.choice([17, 41, 97])):  # late points
            out[i], out[i + 2] = out[i + 2], out[i]
        for i in range(33, len(out), 71):  # replays
            out.insert(i, json.loads(json.dumps(out[i - 5], allow_nan=True)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_synthetic_amp_streams_are_unchanged(seed: int) -> None:
    _compare(_amp_stream(seed), SETTINGS, piece=23 + seed % 7)


@PURE
def test_the_short_path_is_taken_on_most_steady_batches() -> None:
    # (the column hook folds stretches of these batches without it since stop 42: test_amp_steady_column.py)
    with patch.object(memory, "_steady_column", lambda rank, batches, first, scale_pt: 0):
        taken = sum(_compare(_amp_stream(seed), SETTINGS, piece=10 ** 9) for seed in range(0, 40, 4))
    assert taken > 1000, taken  # (1550 when written: half the streams send the flag, some grow every 7 steps)


def test_a_state_without_its_lowest_scale_takes_the_whole_rule() -> None:
    """A kept scale with no lowest (a state from code that did not keep it): the whole rule (it reads the
    lowest as +inf: a new lowest), not the short path."""
    state: Dict[str, Any] = {"last": 3, "scale": [3, 1024.0], "streak": 0}
    assert not memory._amp_steady(state, (4, 1024.0)) and state["last"] == 3
    state["lowest"] = 2048.0  # (over the scale: the whole rule, it is a new lowest)
    assert not memory._amp_steady(state, (4, 1024.0))
    state["lowest"] = 512.0
    assert memory._amp_steady(state, (4, 1024.0)) and state == {"last": 4, "scale": [4, 1024.0], "streak": 0,
                                                               "lowest": 512.0}
    assert not memory._amp_steady(state, (4, 1024.0))  # (the same step again: replayed)
    state["flag"] = True
    assert not memory._amp_steady(state, (5, 1024.0))
