"""``Pipeline._fold`` inlines ``RankState.touch`` (issue 15, stop 47, hT): the two copies must write the same
host, pid, first and last time for any order of events -- times out of order, zero, repeated; host and pid
empty, changing -- so a later edit of one copy without the other fails here (hR2's L3 of stop 47)."""

from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RankState

SETTINGS = DetectionSettings()


def _events(seed: int) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    base = 1_700_000_000_000_000_000
    out = []
    for i in range(60):
        time_ns = rng.choice([0, base + rng.randrange(-10**9, 10**10), base + i * 10**8])
        out.append({"event_id": f"e{seed}-{i}", "project": "p", "run_id": f"r{seed}", "rank": 0, "world_size": 1,
                    "time_unix_nano": time_ns, "host": rng.choice(["", "node-a", "node-b"]),
                    "pid": rng.choice([0, 100, 200]), "heartbeat": {"step": i}})
    return out


def _touched(events: List[Dict[str, Any]]) -> Tuple[str, int, int, int]:
    rank = RankState(0)
    for e in events:
        rank.touch(e["time_unix_nano"], e["host"], e["pid"])
    return rank.host, rank.pid, rank.first_ns, rank.last_ns


@pytest.mark.parametrize("seed", range(12))
def test_the_fold_writes_what_touch_writes(seed: int) -> None:
    events = _events(seed)
    pipeline = Pipeline(SETTINGS)
    for at in range(0, len(events), 7):  # in pieces: the state carries over calls
        pipeline.process(events[at:at + 7])
    [run] = pipeline._runs.values()
    rank = run.ranks[0]
    assert (rank.host, rank.pid, rank.first_ns, rank.last_ns) == _touched(events)
