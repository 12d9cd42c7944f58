"""The loss curve's state format of stop 40: its memo of why nothing moves the weights (``stuck``) is no
longer in the snapshotted state. A snapshot written by the code before the change (HEAD 0f7aeff; the
fixtures in snapshots_0f7aeff/ are scenario streams cut mid-way, written by that code, each but the plateau
one carrying ``lg.loss.stuck``) restores: continued with the rest of its stream it gives the records of a
pipeline that ran this code from the start, and its later snapshots are that pipeline's (the retired key
is dropped at restore). And the new format round-trips: snapshot -> restore -> continue == uninterrupted,
at every cut of the loss scenarios."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RETIRED_KEYS, RankState

PURE = pytest.mark.engine_pure("spies on loss._stuck_now")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

ROOT = Path(__file__).resolve().parents[1]
STREAMS = ROOT / "scenarios" / "streams"
OLD = Path(__file__).resolve().parent / "snapshots_0f7aeff"
SETTINGS = DetectionSettings()
FIXTURES = sorted(p.name for p in OLD.glob("*.json.gz"))


def load(name: str) -> List[Dict[str, Any]]:
    with open(STREAMS / f"{name}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _loss_states(blob: bytes) -> List[Dict[str, Any]]:
    doc = json.loads(blob)
    return [r.get("detectors", {}).get("lg", {}).get("loss", {}) for run in doc["runs"] for r in run["ranks"]]


NEWER_STATE = {"lg": ("spike",)}
"""Detector state (state key -> parts) of rules added after the fixtures were written: a snapshot of that
code has none, so its restore starts them afresh (loss/spike's duplicate guard and candidate, stop 42)."""


def _without_newer_state(blob: bytes) -> Dict[str, Any]:
    """The snapshot ``blob`` as data, less :data:`NEWER_STATE` (which must be there: the reference ran it)."""
    doc = json.loads(blob)
    dropped = 0
    for run in doc["runs"]:
        for rank in run["ranks"]:
            for key, parts in NEWER_STATE.items():
                held = rank.get("detectors", {}).get(key, {})
                for part in parts:
                    dropped += held.pop(part, None) is not None
    assert dropped  # the newer rule did keep state in the reference
    return doc


def test_the_fixtures_are_there() -> None:
    assert len(FIXTURES) == 5
    carrying = [f for f in FIXTURES if any("stuck" in s for s in _loss_states(gzip.decompress(
        (OLD / f).read_bytes())))]
    assert len(carrying) == 4  # the old format's memo is in them (the plateau cut's rank had none)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_snapshot_of_the_old_format_restores_and_continues_as_the_new_code(fixture: str) -> None:
    name, cut_text = fixture[:-len(".json.gz")].rsplit("_cut", 1)
    cut = int(cut_text)
    events = load(name)
    old_blob = gzip.decompress((OLD / fixture).read_bytes())
    restored = Pipeline.restore(old_blob, SETTINGS)
    reference = Pipeline(SETTINGS)
    reference.process(events[:cut])
    # the restored state is the new code's at the cut: the retired memo dropped, nothing else differs but
    # the state of rules newer than the fixtures (it starts at the restore: loss/spike's, stop 42)
    assert json.loads(restored.snapshot()) == _without_newer_state(reference.snapshot())
    assert not any("stuck" in s for s in _loss_states(restored.snapshot()))
    rest = events[cut:]
    for lo in range(0, len(rest), 7):  # continued in pieces: the same records, piece for piece
        assert restored.process(rest[lo:lo + 7]) == reference.process(rest[lo:lo + 7])
    assert _without_record(restored.snapshot()) == _without_record(reference.snapshot())
    straight = Pipeline(SETTINGS)
    straight.process(events)
    assert restored.incidents() == straight.incidents()
    assert _without_record(restored.snapshot()) == _without_record(straight.snapshot())
    assert all(a <= b for a, b in zip(_records(restored.snapshot()), _records(straight.snapshot())))


def _records(blob: bytes) -> List[float]:
    return [rank.get("detectors", {}).get("lg", {}).get("spike", {}).get("record", 0.0)
            for run in json.loads(blob)["runs"] for rank in run["ranks"]]


def _without_record(blob: bytes) -> Dict[str, Any]:
    """The snapshot ``blob`` as data, less loss/spike's record of the run's own excursions (stop 43): a
    restore from a snapshot older than it starts it afresh at the cut, so it holds the excursions since the
    cut only -- never more than the uninterrupted run's (checked)."""
    doc = json.loads(blob)
    for run in doc["runs"]:
        for rank in run["ranks"]:
            spike = rank.get("detectors", {}).get("lg", {}).get("spike", {})
            spike.pop("record", None)
    return doc


@pytest.mark.parametrize("name", ("plateau", "oscillation", "rise_after_fall", "explosion", "healthy_mlp"))
def test_the_new_format_round_trips_at_every_cut(name: str) -> None:
    events = load(name)
    straight = Pipeline(SETTINGS)
    straight_out = straight.process(events)
    for cut in range(0, len(events) + 1, 9):
        first = Pipeline(SETTINGS)
        first.process(events[:cut])
        blob = first.snapshot()
        assert not any("stuck" in s for s in _loss_states(blob))
        restored = Pipeline.restore(blob, SETTINGS)
        assert restored.snapshot() == blob
        first.process(events[cut:])
        restored.process(events[cut:])
        assert restored.snapshot() == first.snapshot() == straight.snapshot()
        assert restored.incidents() == straight.incidents()
    assert straight_out == Pipeline(SETTINGS).process(events)


def test_a_restore_drops_exactly_the_retired_keys() -> None:
    data = RankState(0).to_json()
    data["detectors"] = {"lg": {"loss": {"stuck": [12, ""], "last": 12, "level": 1.5}, "grad": {"x": 1}},
                         "mem": {"stuck": 3}}
    state = RankState.from_json(data)
    assert state.detectors == {"lg": {"loss": {"last": 12, "level": 1.5}, "grad": {"x": 1}}, "mem": {"stuck": 3}}
    assert data["detectors"]["lg"]["loss"]["stuck"] == [12, ""]  # the input is not changed
    assert RETIRED_KEYS == {("lg", "loss"): ("stuck",)}


@PURE
def test_the_memo_serves_one_value_only() -> None:
    """on_curve clears the memo on every value it judges: a value never reads its predecessor's reason."""
    events = load("healthy_mlp")
    pipeline = Pipeline(SETTINGS)
    seen: List[Any] = []
    original = loss._stuck_now

    def spy(rank: Any, lo: int, hi: int, settings: DetectionSettings) -> str:
        seen.append(hi)
        return original(rank, lo, hi, settings)

    loss._stuck_now = spy  # type: ignore[assignment]
    try:
        pipeline.process(events)
    finally:
        loss._stuck_now = original  # type: ignore[assignment]
    assert seen and len(seen) == len(set(seen))  # one reason per judged value (and hi), none reused


def test_the_memo_is_the_ranks_own_and_pipelines_on_threads_agree() -> None:
    """The memo lives in the rank's derived state (never module state shared by every pipeline of the
    process): pipelines judging on four threads at once give what each gives alone."""
    assert not hasattr(loss, "_STUCK")
    streams = [load(name) for name in ("healthy_mlp", "plateau", "oscillation", "rise_after_fall")]
    alone = []
    for events in streams:
        p = Pipeline(SETTINGS)
        p.process(events)
        alone.append(p.snapshot())
        ranks = [r for run in json.loads(p.snapshot())["runs"] for r in run["ranks"]]
        assert ranks and not any("derived" in r for r in ranks)  # (never serialized)
    import sys
    import threading

    results: Dict[int, bytes] = {}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter lets them
    try:
        def work(i: int) -> None:
            p = Pipeline(SETTINGS)
            for event in streams[i]:
                p.process([event])
            results[i] = p.snapshot()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(streams))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert [results[i] for i in range(len(streams))] == alone
