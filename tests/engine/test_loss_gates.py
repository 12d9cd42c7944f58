"""The loss curve's incident gates (issue 15, stop 41): what the run's incidents say to a rank's curve --
muted (an open vanishing / clip-stale / adapter incident lists the rank), ``numeric_final``, the open curve
kind -- is taken again only when an incident opened or changed its status, kind or ranks since the rank last
took it (``RunState.changes``, counted by ``incidents.apply`` / ``incidents.resolve`` and by correlation when
it moves ranks into a cause; ``loss._gates``), else the rank's memo answers. It must change nothing: on every
call an oracle takes the three values from the incidents as they are (``rank_has_open``, ``numeric_final``,
``_open_curve_kind``) and they must equal the memo's, on every corpus scenario and on the synthetic threshold
streams of test_loss_quiet_stretch (incidents open, escalate, resolve and reopen there), delivered in pieces
with snapshot restores; and the outputs and snapshots equal those of a pipeline that takes the gates from the
incidents on every value, piece by piece. The counter itself: each kind of change moves it, a restored run's
incidents share it, a snapshot never carries it."""

from __future__ import annotations

import json
from typing import Any, ContextManager, Dict, List, Optional, Tuple
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import SMALL_HISTORY, VARIANTS, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import correlate, incidents
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.detectors.adapter import KEY as ADAPTER_KEY
from trainguard_engine.detectors.numeric import CLIP_STALE_KEY, VANISHING_KEY, numeric_final, rank_has_open
from trainguard_engine.incidents import Finding
from trainguard_engine.state import RunState

PURE = pytest.mark.engine_pure("wraps loss._gates with an oracle")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]
Gates = Tuple[bool, bool, Optional[str]]


def _taken(run: Any, rank: Any) -> Gates:
    """The three gates, taken from the incidents as they are (what on_curve read before the memo)."""
    return (rank_has_open(run, rank, VANISHING_KEY, CLIP_STALE_KEY, ADAPTER_KEY), numeric_final(run, rank),
            loss._open_curve_kind(run, rank))


class _Oracle:
    """Wraps ``loss._gates``: on every call, its answer must equal the gates taken from the incidents; counts
    the calls the memo answered on a run with incidents (failures collected: the pipeline quarantines a run
    whose detector raises)."""

    def __init__(self) -> None:
        self.saved = loss._gates
        self.calls = self.memo = 0
        self.failed: List[str] = []

    def __call__(self, run: Any, rank: Any) -> Gates:
        memo = rank.derived.get(loss.GATES_MEMO)
        hit = bool(run.incidents) and memo is not None and memo[0] == run.changes[0] and \
            memo[1] == len(run.incidents)
        answer = self.saved(run, rank)
        self.calls += 1
        self.memo += hit
        truth = _taken(run, rank)
        if answer != truth:
            self.failed.append(f"rank {rank.rank}: {answer} != {truth}")
        return answer

    def __enter__(self) -> _Oracle:
        loss._gates = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._gates = self.saved  # type: ignore[assignment]


def _slow() -> ContextManager[object]:
    """The memo off: the gates taken from the incidents on every value."""
    return patch.object(loss, "_gates", _taken)


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37,
             restore_every: int = 3) -> _Oracle:
    """A pipeline with the memo (under the oracle) and one without, over ``events`` in pieces (both restored
    from the first's snapshot every few pieces: the memo starts empty there): the same outputs and
    snapshots piece by piece, and the oracle's agreement on every call."""
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


def _two_ranks(seed: int) -> List[Event]:
    """Two ranks' threshold streams in one run, interleaved: one rank's findings open, escalate and resolve
    the run's incidents while the other's curve is judged (the memo of the other rank must notice)."""
    a = list(_loss_stream(seed))
    b = [dict(e, rank=1, event_id=f"r1-{e['event_id']}") for e in _loss_stream(seed + 1000)]
    for e in b:
        e["run_id"] = a[0]["run_id"]
        e["world_size"] = a[0]["world_size"] = 2
    out: List[Event] = []
    for x, y in zip(a, b):
        out += [x, y]
    return out


@PURE
@pytest.mark.parametrize("seed", range(0, 48, 3))
def test_two_ranks_of_one_run_are_unchanged(seed: int) -> None:
    oracle = _compare(_two_ranks(seed), VARIANTS[seed % len(VARIANTS)], piece=29)
    assert oracle.calls > 500


@PURE
def test_the_memo_answers_on_runs_with_incidents() -> None:
    """The memo is used where it matters: on values of runs that hold incidents (not only the empty run's
    shortcut)."""
    memo = calls = 0
    for s in SCENARIOS:
        oracle = _compare(s.events(), SETTINGS, piece=10 ** 9)
        memo, calls = memo + oracle.memo, calls + oracle.calls
    for seed in range(0, 48, 3):
        oracle = _compare(_two_ranks(seed), SETTINGS, piece=10 ** 9)
        memo, calls = memo + oracle.memo, calls + oracle.calls
    assert memo > 1000 and calls > memo, (memo, calls)


# --- the counter -------------------------------------------------------------------------------------


def _finding(key: str, rank: int, step: int = 5, category: str = "loss", subtype: str = "plateau",
             relabel: bool = False) -> Finding:
    return Finding(category, subtype, key, rank, step, 1_000 + step, relabel=relabel)


def test_each_kind_of_change_moves_the_counter() -> None:
    run = RunState("p", "r")
    seen = [run.changes[0]]

    def moved() -> bool:
        seen.append(run.changes[0])
        return seen[-1] > seen[-2]

    st = incidents.apply(run, _finding("loss:plateau", 0), SETTINGS)
    assert st is not None and st.changes is run.changes and moved()  # opened
    incidents.apply(run, _finding("loss:plateau", 1), SETTINGS)
    assert moved()  # a rank joined
    incidents.resolve(st, 2_000, 9, 0, "cleared", SETTINGS)
    assert moved() and not st.is_open  # resolved
    incidents.resolve(st, 2_001, 9, 0, "cleared", SETTINGS)
    assert not moved()  # (already resolved: nothing changed)
    incidents.apply(run, _finding("loss:plateau", 0, step=12), SETTINGS)
    assert moved() and st.is_open  # reopened
    num = incidents.apply(run, _finding("numeric", 0, category="loss", subtype="rise-after-fall"), SETTINGS)
    assert num is not None and moved()
    incidents.apply(run, _finding("numeric", 0, category="gradient", subtype="explosion", relabel=True),
                    SETTINGS)
    assert moved() and (num.record.category, num.record.subtype) == ("gradient", "explosion")  # re-kinded
    cause = incidents.apply(run, _finding("exc:x", 2, category="process", subtype="exception"), SETTINGS)
    assert cause is not None and moved()
    incidents.resolve(st, 3_000, 14, 0, "cleared", SETTINGS)
    assert moved()
    correlate._fold_into(run, st, cause, SETTINGS)  # ranks 0 and 1 move into the cause (st resolved already:
    assert moved() and {0, 1} <= set(cause.rank_first)  # its resolve() there counts nothing)


def test_a_restored_runs_incidents_share_its_counter_and_snapshots_never_carry_it() -> None:
    run = RunState("p", "r")
    for key, rank in (("loss:plateau", 0), ("numeric", 1), ("loss:oscillation", 0)):
        incidents.apply(run, _finding(key, rank), SETTINGS)
    assert run.changes[0] == 3
    doc = run.to_json()
    assert "changes" not in json.dumps(doc)
    again = RunState.from_json(json.loads(json.dumps(doc)))
    assert again.changes[0] == 0 and all(st.changes is again.changes for st in again.incidents.values())
    incidents.resolve(again.incidents["numeric"], 5_000, 20, 1, "cleared", SETTINGS)
    assert again.changes[0] == 1 and run.changes[0] == 3
    twin = RunState.from_json(json.loads(json.dumps(doc)))
    twin.changes[0] = 7
    assert twin == RunState.from_json(json.loads(json.dumps(doc)))  # (not compared)


def test_a_memo_is_taken_again_after_a_change_the_counter_saw() -> None:
    """The memo answers while nothing changed, and is taken again after each change (here: a plateau
    opened for the rank, another rank's incident, the plateau resolved)."""
    run = RunState("p", "r")
    rank = run.rank_state(0, SETTINGS)
    assert rank is not None
    assert loss._gates(run, rank) == (False, False, None)  # no incident: no memo needed
    st = incidents.apply(run, _finding("loss:plateau", 0), SETTINGS)
    assert st is not None and loss._gates(run, rank) == (False, False, "plateau")
    memo = rank.derived[loss.GATES_MEMO]
    assert loss._gates(run, rank) == (False, False, "plateau") and rank.derived[loss.GATES_MEMO] is memo
    incidents.apply(run, _finding(VANISHING_KEY, 1, category="gradient", subtype="vanishing"), SETTINGS)
    assert loss._gates(run, rank) == (False, False, "plateau") and rank.derived[loss.GATES_MEMO] is not memo
    incidents.apply(run, _finding(VANISHING_KEY, 0, category="gradient", subtype="vanishing"), SETTINGS)
    assert loss._gates(run, rank) == (True, False, "plateau")
    incidents.resolve(st, 9_000, 40, 0, "cleared", SETTINGS)
    assert loss._gates(run, rank) == (True, False, None)
