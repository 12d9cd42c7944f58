"""The AMP rule's steady points as a column (issue 15, stop 42): in the memory detector's column hook
(``Memory.on_metric_run``), a stretch of batches whose only point the rule reads is a steady GradScaler scale
-- each one ``memory._amp_steady`` would take: the scale kept, not under the lowest, no overflow flag ever
sent, a later step -- is folded by ``memory._steady_column`` with one set of state writes (the last batch's)
instead of the whole rule batch by batch. It must change nothing: the outputs and snapshots equal those of a
pipeline whose hook runs the rule on every batch, piece by piece with snapshot restores, on the synthetic AMP
streams of test_amp_steady.py (constant, growing, halving with and without the flag, 0 / NaN / inf / -1
scales, late points, replays) sent with and without other memory metrics, two ranks interleaved, the
column hook's streams and every corpus scenario; and columns of many batches are taken."""

from __future__ import annotations

import random
from typing import Any, ContextManager, Dict, List, Sequence, Tuple
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_amp_steady import _amp_stream
from tests.engine.test_pipeline_columns import STREAMS
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import memory
from trainguard_engine.detectors.base import MetricBatch
from trainguard_engine.state import RankState

PURE = pytest.mark.engine_pure("replaces memory._steady_column with the slow path")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]


class _Counting:
    """``_steady_column`` counting the columns it took and their batches."""

    def __init__(self) -> None:
        self.saved = memory._steady_column
        self.columns = 0
        self.batches = 0
        self.longest = 0

    def __call__(self, rank: RankState, batches: Sequence[MetricBatch], first: int,
                 scale_pt: Tuple[int, float]) -> int:
        taken = self.saved(rank, batches, first, scale_pt)
        if taken:
            self.columns += 1
            self.batches += taken
            self.longest = max(self.longest, taken)
        return taken

    def __enter__(self) -> _Counting:
        memory._steady_column = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        memory._steady_column = self.saved  # type: ignore[assignment]


def _batch_by_batch() -> ContextManager[object]:
    """The whole rule on every batch of a run (the column off)."""
    return patch.object(memory, "_steady_column", lambda rank, batches, first, scale_pt: 0)


def _compare(events: List[Event], piece: int = 37, restore_every: int = 3) -> _Counting:
    counting = _Counting()
    run_fast_and_slow(events, SETTINGS, counting, _batch_by_batch, piece, restore_every)
    return counting


def _with_other_memory_metrics(events: List[Event], seed: int) -> List[Event]:
    """``events`` with, on some envelopes, another point the rule reads (mem/allocated, a flag of 0) or a
    second amp/scale point (the last one counts), so that columns stop and start again."""
    rng = random.Random(seed)
    out = []
    for event in events:
        points = event.get("metrics", {}).get("points")
        if points and rng.random() < 0.08:
            extra = rng.choice([[{"name": "mem/allocated", "value": 1e9 + rng.random()}],
                                [{"name": "amp/overflow", "value": 0.0}],
                                [{"name": "amp/scale", "value": rng.choice([1.0, 65536.0])}],
                                [{"name": "throughput/samples_per_s", "value": 10.0}]])
            at = rng.randrange(len(points) + 1)
            event = dict(event, metrics={"points": points[:at] + extra + points[at:]})
        out.append(event)
    return out


def _two_ranks(events: List[Event]) -> List[Event]:
    one = [dict(e, rank=1, event_id=f"{e.get('event_id', '')}-r1") for e in events]
    return [e for pair in zip(events, one) for e in pair]


@pytest.mark.parametrize("seed", range(40))
def test_synthetic_amp_streams_are_unchanged(seed: int) -> None:
    events = _amp_stream(seed)
    _compare(events, piece=23 + seed % 7)
    _compare(_with_other_memory_metrics(events, seed), piece=64 + seed, restore_every=2)


@pytest.mark.parametrize("seed", range(0, 40, 5))
def test_two_ranks_interleaved_are_unchanged(seed: int) -> None:
    _compare(_two_ranks(_amp_stream(seed)), piece=90)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_column_hook_streams_are_unchanged(name: str) -> None:
    _compare(STREAMS[name](), piece=50)


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, piece=41)


@PURE
def test_long_columns_are_taken() -> None:
    seen = [_compare(_amp_stream(seed), piece=400) for seed in range(0, 40, 4)]
    assert sum(c.batches for c in seen) > 1000, [c.batches for c in seen]
    assert max(c.longest for c in seen) > 30  # (a run of the hook is at most pipeline.RUN_MAX envelopes)
    assert sum(c.batches for c in seen) > 3 * sum(c.columns for c in seen)


def _rank(amp: Dict[str, Any]) -> RankState:
    rank = RankState(rank=0)
    rank.detectors[memory.STATE_KEY] = {"amp": amp}
    return rank


def _batches(*scales: Tuple[int, float], other: int = -1) -> List[MetricBatch]:
    out = []
    for i, (step, value) in enumerate(scales):
        points = [("loss", step, 1.0), ("amp/scale", step, value)]
        if i == other:
            points.append(("amp/overflow", step, 0.0))
        out.append(MetricBatch(points, step, 0, ""))
    return out


def test_the_column_writes_what_the_last_batch_would() -> None:
    amp = {"last": 3, "scale": [3, 1024.0], "lowest": 512, "streak": 2}
    rank = _rank(amp)
    batches = _batches((4, 1024.0), (5, 1024.0), (6, 1024.0), (7, 2048.0))
    assert memory._steady_column(rank, batches, 0, (4, 1024.0)) == 3
    assert list(amp.items()) == [("last", 6), ("scale", [6, 1024.0]), ("lowest", 512.0), ("streak", 0)]
    assert type(amp["lowest"]) is float  # (as _amp_steady writes it: min(float(lowest), value))


@pytest.mark.parametrize("scales, other, taken", [
    (((4, 1024.0), (4, 1024.0)), -1, 1),      # the same step again: a replay stops the column
    (((4, 1024.0), (3, 1024.0)), -1, 1),      # a late point
    (((4, 1024.0), (5, 512.0)), -1, 1),       # a halving
    (((4, 1024.0), (5, 1024.0)), 1, 1),       # a flag point in the batch
    (((4, 2048.0), (5, 2048.0)), -1, 0),      # not the kept scale
    (((3, 1024.0), (5, 1024.0)), -1, 0),      # not a later step
])
def test_the_column_stops_where_the_short_path_would(scales: Tuple[Tuple[int, float], ...], other: int,
                                                    taken: int) -> None:
    amp = {"last": 3, "scale": [3, 1024.0], "lowest": 1024.0, "streak": 0}
    before = dict(amp)
    assert memory._steady_column(_rank(amp), _batches(*scales, other=other), 0, scales[0]) == taken
    if not taken:
        assert amp == before


def test_a_state_with_a_flag_or_without_its_lowest_takes_the_whole_rule() -> None:
    for amp in ({"last": 3, "scale": [3, 1024.0], "streak": 0},
                {"last": 3, "scale": [3, 1024.0], "lowest": 1024.0, "flag": True}):
        before = dict(amp)
        assert memory._steady_column(_rank(amp), _batches((4, 1024.0)), 0, (4, 1024.0)) == 0
        assert amp == before
    assert memory._steady_column(RankState(rank=0), _batches((4, 1024.0)), 0, (4, 1024.0)) == 0
