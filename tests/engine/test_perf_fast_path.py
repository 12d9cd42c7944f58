"""The perf detectors' per-batch path (issue 15, stop 43) must change nothing: ``straggler.on_metrics`` reads a
point's role from its name once (remembered per settings object and name, ``straggler._role``) instead of three
tests per point, builds the per-step dict only for a batch with a phase point and sorts it only with two steps;
``_fold_step``, ``_count_report`` and ``_run_state`` get their state dicts without building an empty one per call,
and ``_count_report`` finds the step to judge without a list.

Checked against the code before (a11e7e4), kept here verbatim ON PURPOSE as the pre-change reference (the fast
path is inline code: no switch gives the old path back by patching) and run in a copy of the module's namespace
(its helpers are the module's own, unchanged; the four replaced functions the old ones): outputs
and snapshots piece by piece with restores (tests/engine/fast_slow.py) on every recorded straggler fixture (4-rank
jobs: stragglers, regressions, loaders, NVML throttling, run-queue delay), every corpus scenario and synthetic
streams (phases, throughput, throttle bits, odd values, points at other steps, late and replayed steps, a rank
joining late), under the default settings and settings where a throughput name is a phase name or the throttle
metric."""

from __future__ import annotations

import bisect
import gzip
import json
import math
import random
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import roles as roles_mod
from trainguard_engine.detectors import straggler

PURE = pytest.mark.engine_pure("replaces straggler's functions with their earlier versions and counts _role")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "straggler"
SETTINGS = DetectionSettings()
ODD = DetectionSettings.from_overrides({"throughput_metrics": ["time/data_s", "gpu/throttle_reasons",
                                                               "throughput/samples_per_s"]})
Event = Dict[str, Any]

BEFORE = r'''
def _run_state(run: RunState) -> Dict[str, Any]:
    first = run.ranks[next(iter(run.ranks))]
    state: Dict[str, Any] = first.detectors.setdefault(RUN_KEY, {})
    return state


def _fold_step(state: Dict[str, Any], step: int, time_ns: int, values: Dict[str, float],
               settings: DetectionSettings) -> bool:
    """Add one timed step to the rank's window; False when it is a replay, late or warm-up.

    The window's medians are kept incrementally: one sorted column per phase (``state["col"]``), the
    new value inserted and the evicted one removed by bisection, and only the columns that changed get
    their median read again: a step costs a few list moves and no sort."""
    if step <= state.get("last", -1):
        return False
    state["last"] = step
    n = state["n"] = state.get("n", 0) + 1
    if n <= settings.perf_warmup_steps:
        return False
    step_s = values[STEP_S]
    data, fwd, opt = values.get(DATA_S), values.get(FORWARD_S), values.get(OPTIMIZER_S)
    own = rest = None
    if fwd is not None:
        own = (data or 0.0) + fwd + (opt or 0.0)
        rest = max(0.0, step_s - own)
    entry: List[Any] = [step, time_ns, step_s, own, data, fwd, opt, rest]
    runqueue = values.get(RUNQUEUE_S)
    if runqueue is not None:  # only then: a stream without it keeps today's state exactly
        entry.append(runqueue)
    window: Optional[List[List[Any]]] = state.get("w")
    if window is None:
        window = state["w"] = []
    columns: Optional[Dict[str, List[float]]] = state.get("col")
    if columns is None:  # a new rank, or state saved before the columns were kept
        columns = state["col"] = {name: sorted(e[i] for e in window if e[i] is not None)
                                  for name, i in _MED_FIELDS.items()}
    window.append(entry)
    gone = window.pop(0) if len(window) > settings.perf_window else _NOTHING
    meds: Dict[str, float] = state.setdefault("med", {})
    least = settings.perf_min_points
    if own is None and data is None and opt is None and gone[_OWN] is None and gone[_DATA] is None and \
            gone[_OPT] is None:
        items: Tuple[Tuple[str, int], ...] = _STEP_ITEMS  # no phases (the usual SDK stream): one column
    else:
        items = _MED_ITEMS
    for name, i in items:
        new = entry[i]
        old = gone[i]
        if new is None and old is None:
            continue
        column = columns[name]
        if new is not None:
            insort(column, new)
        if old is not None:
            del column[bisect_left(column, old)]
        k = len(column)
        if k >= least:
            meds[name] = column[k // 2] if k % 2 else 0.5 * (column[k // 2 - 1] + column[k // 2])
        else:
            meds.pop(name, None)
    if len(window) > settings.perf_window:  # perf_window lowered since the state was kept
        _refold(state, settings)
    return True


def _count_report(run: RunState, run_state: Dict[str, Any], step: int) -> bool:
    """Count that one more rank reported ``step``; True when every timed rank has (judge it now)."""
    if step <= run_state.get("judged", -1):
        return False
    counts: List[List[int]] = run_state.setdefault("cnt", [])
    for entry in counts:
        if entry[0] == step:
            entry[1] += 1
            break
    else:
        counts.append([step, 1])
        counts.sort()
        del counts[:-RECENT_STEPS]
    expected = run_state.get("ranks", 0)
    done = [e for e in counts if e[1] >= expected]
    if not done:
        return False
    run_state["judged"] = max(e[0] for e in done)
    run_state["cnt"] = [e for e in counts if e[0] > run_state["judged"]]
    return True


def on_metrics(run: RunState, rank: RankState, batch: MetricBatch,
               settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank``."""
    timed: Dict[int, Dict[str, float]] = {}
    tp: Optional[float] = None
    throttle = False
    throughput = _names(settings.throughput_metrics)
    for name, s, value in batch.points:
        if name in _PHASE_SET:
            v = value if value.__class__ is float and 0.0 <= value < math.inf else _finite(value)
            if v is not None:
                values = timed.get(s)
                if values is None:
                    values = timed[int(s)] = {}
                values[name] = v
        elif name in throughput:
            v = _finite(value)
            if v is not None and v > 0:
                tp = v
        elif name == THROTTLE:
            throttle = True
    out: List[Finding] = []
    state = rank_state(rank)
    if tp is not None:
        tps: List[float] = state.setdefault("tpw", [])
        tps.append(tp)
        del tps[:-settings.perf_window]
        if len(tps) >= settings.perf_min_points:
            state["tp"] = _median(tps)
    if throttle:
        out += _throttle(run, rank, state, batch, settings)
    for step in sorted(timed):
        values = timed[step]
        if STEP_S not in values:
            continue
        new_rank = "w" not in state
        if not _fold_step(state, step, batch.time_ns, values, settings):
            continue
        run_state = _run_state(run)
        if new_rank:
            run_state["ranks"] = run_state.get("ranks", 0) + 1
        if "med" in state and "step" in state["med"] and _count_report(run, run_state, step):
            out += _judge(run, run_state, run_state["judged"], batch.time_ns, settings)
    return out
'''
"""straggler.py's _run_state, _fold_step, _count_report and on_metrics at a11e7e4, verbatim."""

_BEFORE: Dict[str, Any] = dict(vars(straggler))
_BEFORE["insort"] = bisect.insort  # (the reference's own: straggler.py inserts by robust.bisect_right_of now)
exec(compile(BEFORE, "straggler.py@a11e7e4", "exec"), _BEFORE)  # the reference code, verbatim


@contextmanager
def _before() -> Iterator[None]:
    with ExitStack() as stack:
        for name in ("_run_state", "_fold_step", "_count_report", "on_metrics"):
            stack.enter_context(patch.object(straggler, name, _BEFORE[name]))
        yield


class _Roles:
    """Counts the names whose role the fast path decided (re-entered for every piece)."""

    def __init__(self) -> None:
        self.saved = straggler._role
        self.decided = 0

    def __enter__(self) -> _Roles:
        def counted(name: str, settings: DetectionSettings) -> int:
            self.decided += 1
            return int(self.saved(name, settings))

        straggler._role = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        straggler._role = self.saved  # type: ignore[assignment]


def _compare(events: List[Event], settings: DetectionSettings = SETTINGS, piece: int = 37,
             restore_every: int = 3) -> None:
    run_fast_and_slow(events, settings, _Roles(), _before, piece, restore_every)


def _fixture(name: str) -> List[Event]:
    with gzip.open(FIXTURES / f"{name}.jsonl.gz", "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.mark.parametrize("name", sorted(p.name[:-len(".jsonl.gz")] for p in FIXTURES.glob("*.jsonl.gz")))
def test_recorded_straggler_jobs_are_unchanged(name: str) -> None:
    events = _fixture(name)
    _compare(events, piece=53)
    if name in ("compute", "nvml_h200", "quiet_affinity_weak_sdk_runqueue"):
        _compare(events, ODD, piece=31, restore_every=2)


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, piece=41)


PHASES = ("time/step_s", "time/data_s", "time/forward_s", "time/backward_s", "time/optimizer_s", "time/runqueue_s")
OTHERS = ("loss", "grad/global_norm", "opt/lr", "throughput/samples_per_s", "gpu/throttle_reasons",
          "gpu/sm_clock_mhz", "gpu/temperature_c", "gpu/power_w", "gpu/power_limit_w")


def _stream(seed: int) -> List[Event]:
    """Three ranks (the third joining late, one slower), each step a batch of a step time with or without
    phases, run-queue delay, throughput and NVML samples (throttle bits), at times points of the next or the
    previous step in the same batch, odd values (NaN, inf, negative, 0), replays and late batches."""
    rng = random.Random(seed)
    base_ns = 1_700_000_000_000_000_000
    phases = rng.random() < 0.5
    out: List[Event] = []
    for step in range(rng.choice([90, 150])):
        for rank in (0, 1, 2):
            if rank == 2 and step < 30:
                continue
            slow = 2.5 if rank == 1 and step > 40 else 1.0
            job = 2.5 if step > 40 else 1.0  # (every rank's step waits for the slow one)
            step_s = 0.1 * job + 0.01 * rng.random()
            points: List[Dict[str, Any]] = [{"name": "time/step_s", "value": step_s}]
            if phases or seed % 2:
                own = (0.01 * slow, 0.05 * slow, 0.01)
                points += [{"name": "time/data_s", "value": own[0]}, {"name": "time/forward_s", "value": own[1]},
                           {"name": "time/optimizer_s", "value": own[2]},
                           {"name": "time/backward_s", "value": max(0.0, step_s - sum(own))}]
            if seed % 3 == 0:
                points.append({"name": "time/runqueue_s", "value": 0.02 * rng.random()})
            for name in rng.sample(OTHERS, rng.randint(0, 3)):
                points.append({"name": name, "value": rng.choice([1.0, 0.0, 32.0, 100.0, 0x40, 0x4, 1500.0])})
            if rng.random() < 0.05:
                points.append({"name": rng.choice(PHASES), "step": step + rng.choice([1, -1]),
                               "value": 0.1 * rng.random()})
            if rng.random() < 0.03:
                rng.choice(points)["value"] = rng.choice([math.nan, math.inf, -1.0, 0.0])
            rng.shuffle(points)
            out.append({"project": "p", "run_id": f"perf-{seed}", "host": f"h{rank % 2}", "pid": 1 + rank,
                        "rank": rank, "world_size": 3, "event_id": f"p{seed}-{step}-{rank}", "step": step,
                        "time_unix_nano": base_ns + step * 10 ** 8 + rank * 10 ** 6, "severity": "INFO",
                        "metrics": {"points": points}})
    for i in range(25, len(out) - 3, rng.choice([19, 47])):  # late batches
        out[i], out[i + 2] = out[i + 2], out[i]
    for i in range(40, len(out), 83):  # replays
        out.insert(i, dict(out[i - 6]))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_synthetic_perf_streams_are_unchanged(seed: int) -> None:
    events = _stream(seed)
    _compare(events, piece=29 + seed % 7)
    _compare(events, ODD, piece=70 + seed, restore_every=2)


def test_the_synthetic_streams_reach_the_rules() -> None:
    from trainguard_engine.pipeline import Pipeline
    kinds = set()
    for seed in range(10):
        pipe = Pipeline(SETTINGS)
        pipe.process(_stream(seed))
        kinds |= {f"{i.category}/{i.subtype}" for i in pipe.incidents()}
    assert "perf/straggler" in kinds and "perf/throttling" in kinds, kinds


@PURE
def test_roles_are_remembered_and_start_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roles_mod, "ROLES_MAX", 3)
    monkeypatch.setattr(straggler, "_ROLES", roles_mod.RoleMemo())
    roles = _Roles()
    with roles:
        _compare(_stream(1)[:300], piece=50)
    assert len(straggler._ROLES.of(SETTINGS)) <= 3
    assert roles.decided > 10  # (the memo restarted: names decided again)
    monkeypatch.setattr(roles_mod, "ROLES_MAX", 4096)
    monkeypatch.setattr(straggler, "_ROLES", roles_mod.RoleMemo())
    roles = _Roles()
    with roles:
        _compare(_stream(1)[:300], piece=50)
    assert roles.decided <= len(PHASES) + len(OTHERS) + 2  # once per name (and settings object)
