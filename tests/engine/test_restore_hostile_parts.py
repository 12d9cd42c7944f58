"""A stored part that this code did not write -- a corrupt or foreign state store, a value no version of the
engine writes -- is left out at restore: that run (or cluster) alone is quarantined and its part deleted at
the next checkpoint; every other run is restored and the pipeline's checkpoints go on (hR6, stop 49).

Before: a run part with ``started_ns`` ``"x"`` or ``1e400`` restored unchecked on the pure engine (what the
wheels, Docker and Flink ship) and failed the store's upsert at every retry -- the processor stalled for
every project, across restarts; ``last_event_ns`` ``1e400`` put an infinite eviction time into the header,
which no checkpoint could encode again; and an OverflowError or IndexError of one part (a 400-digit number,
a short list) escaped the per-part catch, so the whole partition restarted empty, every restart.

Each case runs on the engine this process loaded (compiled under ``make test``) and, marked
``engine_pure``, on the pure modules too."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pytest

from tests.engine.test_pipeline_poison import healthy_run, metrics
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RANK_KINDS, RUN_KINDS, RankState, RunState, check_kinds

HUGE = "1" + "0" * 400  # a 401-digit JSON integer: json.loads reads it; float() cannot


def _crash_run() -> List[Dict[str, Any]]:
    """A run with an exception (so it has a cluster part) beside the calm one."""
    events = [metrics("hostile", "h1", s, {"loss": 2.0 / (1 + s)}) for s in range(12)]
    events.append({"event_id": "hostile-h1-exc", "project": "hostile", "run_id": "h1", "rank": 0, "step": 12,
                   "time_unix_nano": events[-1]["time_unix_nano"] + 10**9,
                   "exception": {"type": "RuntimeError", "message": "CUDA error: an illegal memory access",
                                 "frames": [{"filename": "train.py", "lineno": 10, "function": "step"}]}})
    return events


# (label, part ("run" / "cluster"), path inside the part's document, the raw JSON put there)
CASES: List[Tuple[str, str, Tuple[Any, ...], str]] = [
    ("run started_ns a string", "run", ("run", "started_ns"), '"x"'),
    ("run started_ns 1e400", "run", ("run", "started_ns"), "1e400"),
    ("run last_event_ns 1e400", "run", ("run", "last_event_ns"), "1e400"),
    ("run touched a string", "run", ("run", "touched"), '"x"'),
    ("run lost a number", "run", ("run", "lost"), "1"),
    ("run tags a list", "run", ("run", "tags"), "[]"),
    ("rank step_time_s 1e400", "run", ("run", "ranks", 0, "step_time_s"), "1e400"),
    ("rank exited a string", "run", ("run", "ranks", 0, "exited"), '"yes"'),
    ("rank history value past float", "run", ("run", "ranks", 0, "history", "loss", 0, 1), HUGE),
    ("rank history time 1e400", "run", ("run", "ranks", 0, "history", "loss", 0, 2), "1e400"),
    ("rank first_nonfinite one item", "run", ("run", "ranks", 0, "first_nonfinite"), '{"loss": [5]}'),
    ("part seq 1e400", "run", ("seq",), "1e400"),
    ("cluster sample_key empty", "cluster", ("cluster", "sample_key"), "[]"),
    ("cluster touched 1e400", "cluster", ("cluster", "touched"), "1e400"),
]


def tampered(blob: bytes, path: Tuple[Any, ...], raw: str) -> bytes:
    doc = json.loads(blob)
    at = doc
    for step in path[:-1]:
        at = at[step]
    at[path[-1]] = "@@TAMPERED@@"
    return json.dumps(doc).replace('"@@TAMPERED@@"', raw).encode()


def check_case(part: str, path: Tuple[Any, ...], raw: str) -> None:
    calm, hostile = healthy_run("calm", "c1", steps=40), _crash_run()
    before = Pipeline()
    before.process(calm[:20] + hostile)
    parts = {k: v for k, v in before.changed_parts().items() if v is not None}
    name = next(k for k in parts if k.startswith(f"{part}/hostile"))
    parts[name] = tampered(parts[name], path, raw)
    assert raw.encode() in parts[name]

    after = Pipeline.restore_parts(parts)  # before: raised (the whole partition then started empty)
    quarantined = after.take_quarantined()
    assert [q.project for q in quarantined] == ["hostile"] and name in quarantined[0].reason
    deleted = after.changed_parts()  # encodes: before, the header's 'evicted' held an infinity
    assert deleted[name] is None  # the part that cannot be read is deleted
    calm_part = next(k for k in parts if k.startswith("run/calm"))
    assert calm_part not in deleted  # restored as it was: nothing changed
    after.parts_saved()

    out = after.process([*calm[20:], metrics("hostile", "h1", 13, {"loss": 0.5})])
    (record,) = [r for r in out.runs if r.project == "calm"]
    assert (record.started_ns, record.last_event_ns) == (calm[0]["time_unix_nano"], calm[-1]["time_unix_nano"])
    for r in out.runs:  # what the stores are given holds what they can write
        assert type(r.started_ns) is int and type(r.last_event_ns) is int
    assert all(v is None or isinstance(v, bytes) for v in after.changed_parts().values())


@pytest.mark.parametrize("label,part,path,raw", CASES, ids=[c[0] for c in CASES])
def test_one_bad_part_is_left_out(label: str, part: str, path: Tuple[Any, ...], raw: str) -> None:
    check_case(part, path, raw)


@pytest.mark.engine_pure("the pure engine restored these parts unchecked (the shipped wheels run it)")
@pytest.mark.parametrize("label,part,path,raw", CASES, ids=[c[0] for c in CASES])
def test_one_bad_part_is_left_out_pure(label: str, part: str, path: Tuple[Any, ...], raw: str) -> None:
    check_case(part, path, raw)


def test_the_kinds_cover_every_scalar_field_written() -> None:
    """RANK_KINDS / RUN_KINDS name exactly the fields to_json writes outside the structured ones, and what
    this code writes passes them."""
    run = RunState("p", "r")
    rank = RankState(0)
    run_doc, rank_doc = run.to_json(), rank.to_json()
    assert set(RUN_KINDS) == set(run_doc) - {"ranks", "incidents", "seen"}
    assert set(RANK_KINDS) == set(rank_doc) - {"history", "history_floor", "first_nonfinite", "detectors"}
    check_kinds("run", {k: v for k, v in run_doc.items() if k in RUN_KINDS}, RUN_KINDS)
    check_kinds("rank", {k: v for k, v in rank_doc.items() if k in RANK_KINDS}, RANK_KINDS)


@pytest.mark.parametrize("kind,value,ok", [
    ("int", 5, True), ("int", True, False), ("int", 5.0, False), ("int", 2**70, True),
    ("float", 0.5, True), ("float", 3, True), ("float", float("inf"), False), ("float", float("nan"), False),
    ("float", "0.5", False), ("str", "", True), ("str", 1, False), ("bool", False, True), ("bool", 0, False),
    ("dict", {}, True), ("dict", [], False)])
def test_check_kinds(kind: str, value: Any, ok: bool) -> None:
    if ok:
        check_kinds("run", {"f": value}, {"f": kind})
    else:
        with pytest.raises(TypeError, match=r"^run\.f holds .*, where this code writes " + kind):
            check_kinds("run", {"f": value}, {"f": kind})
