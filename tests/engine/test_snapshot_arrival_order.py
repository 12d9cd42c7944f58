"""A snapshot keeps each history series' points in arrival order (the series dict's order), not sorted by
step: the detectors' "last N points" (:func:`~trainguard_engine.detectors.numeric.recent`) are the last
received, so a late point counts as recent -- and after snapshot -> restore it must still. Until stop 40 the
points were written sorted by step: with late points a restored pipeline could read other "last" points
than the one that ran straight through (e.g. a plateau confirmed on 48 values instead of 49). A snapshot
of the old format (sorted) still restores as it did: it is read in its list order, which was step order."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from tests.engine.test_loss_quiet_stretch import VARIANTS, _loss_stream
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.numeric import recent
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RankState

SETTINGS = DetectionSettings()
PIECE = 27


def _late_rank() -> RankState:
    rank = RankState(0)
    for step, value in ((1, 5.0), (2, 4.0), (4, 3.0), (3, 3.5), (5, 2.0), (7, 1.5), (6, 1.8)):
        rank.observe_point("loss", step, value, 10 * step, SETTINGS)
    return rank


def test_a_rank_snapshot_keeps_arrival_order() -> None:
    rank = _late_rank()
    data = json.loads(json.dumps(rank.to_json()))
    assert [p[0] for p in data["history"]["loss"]] == [1, 2, 4, 3, 5, 7, 6]
    back = RankState.from_json(data)
    assert list(back.history["loss"]) == list(rank.history["loss"]) == [1, 2, 4, 3, 5, 7, 6]
    assert back.to_json() == rank.to_json()
    for most in range(1, 9):  # the last points received, before and after the restore
        assert recent(back, "loss", most) == recent(rank, "loss", most)
    assert [p[0] for p in recent(back, "loss", 2)] == [6, 7]  # the last two received: 7, then 6
    assert [p[0] for p in recent(back, "loss", 4)] == [3, 5, 6, 7]  # step 3 arrived after step 4


def test_a_replayed_step_keeps_its_first_place() -> None:
    """A point replacing a step's value keeps the step's place (the dict's), in the snapshot too."""
    rank = _late_rank()
    rank.observe_point("loss", 4, 9.0, 99, SETTINGS)
    data = rank.to_json()
    assert [p[0] for p in data["history"]["loss"]] == [1, 2, 4, 3, 5, 7, 6]
    back = RankState.from_json(data)
    assert recent(back, "loss", 5) == recent(rank, "loss", 5)


def test_a_snapshot_of_the_old_format_restores_in_step_order() -> None:
    """0f7aeff's writer sorted each series by step: such a snapshot is read in its order (step order, as
    that code restored it) and written back byte for byte."""
    data = _late_rank().to_json()
    data["history"] = {name: sorted(points) for name, points in data["history"].items()}
    back = RankState.from_json(data)
    assert list(back.history["loss"]) == [1, 2, 3, 4, 5, 6, 7]
    assert back.to_json() == data


def _continued(events: List[Dict[str, Any]], settings: DetectionSettings, restore: bool) -> Any:
    pipeline = Pipeline(settings)
    outs = []
    for k, lo in enumerate(range(0, len(events), PIECE)):
        outs.append(pipeline.process(events[lo:lo + PIECE]))
        if restore and k % 3 == 2:
            pipeline = Pipeline.restore(pipeline.snapshot(), settings)
    return outs, pipeline.snapshot(), pipeline.incidents()


# synthetic loss streams with late points and replays (seed % 4 != 0): restored every third piece. These
# (variant, seed) pairs each differed from the straight run with the points written sorted by step (records
# in 5 of them, the final snapshot in 7); the rest of the sweep below agreed either way.
DIFFERED = ((1, 47), (2, 21), (3, 5), (3, 7), (3, 21), (3, 35), (3, 38), (3, 46))


@pytest.mark.parametrize("variant,seed", DIFFERED)
def test_restore_then_continue_is_the_straight_run_with_late_points(variant: int, seed: int) -> None:
    events = list(_loss_stream(seed))
    steps = [e["step"] for e in events]
    assert any(b < a for a, b in zip(steps, steps[1:]))  # late points are there
    settings = VARIANTS[variant]
    assert _continued(events, settings, True) == _continued(events, settings, False)


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_restore_then_continue_over_a_sweep_of_late_point_streams(variant: int) -> None:
    settings = VARIANTS[variant]
    for seed in range(1, 25):
        if seed % 4 == 0:
            continue  # no late points in those
        events = list(_loss_stream(seed))
        assert _continued(events, settings, True) == _continued(events, settings, False), seed
