"""The pipeline's per-event fold (issue 15, stop 43) must change nothing: ``Pipeline._fold`` tests whether an
event is remembered by id (``_notable``) inline, and ``Pipeline._on_metrics`` looks a batch's route up in the
routes of its settings itself (``_route`` only on a miss).

Checked against the code before (a11e7e4's ``_fold`` and ``_on_metrics``), kept here verbatim ON PURPOSE as the
pre-change reference (the fast path is inline code in those two methods: no switch gives the old path back by
patching) and run in a copy of the module's namespace: outputs, snapshots and counters piece by piece with restores on every corpus scenario
sent once and with every event replayed later (duplicates of exceptions, lifecycle, logs, alerts and non-finite
batches dropped by id, the others folded again), and on two projects with their own settings and a shard's norm
combined across ranks."""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from operator import itemgetter
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import pipeline as pipeline_mod
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

SETTINGS = DetectionSettings()
Event = Dict[str, Any]

BEFORE = r'''
def _fold(self, ev: ReadEnvelope, key: str, points: Sequence[Any], applied_before: int,
          run: Optional[RunState] = None) -> None:
    """Fold one parsed event into its run's state (``_process_one`` after the envelope was read; ``run``:
    the run of ``key`` when it is held already)."""
    project_settings = self.project_settings  # (settings_for, inline: once per event)
    settings = project_settings.get(ev.project, self.settings) if project_settings else self.settings
    if run is None:
        run = self._run(ev, key)
    self._unsaved_runs[key] = None
    routed = self._routed.pop(self._at, None) if self._routed else None  # (not notable: see _run_ahead)
    if ev.event_id and routed is None and self._notable(ev, points) and \
            not run.remember(ev.event_id, settings):
        self.counters["duplicates"] += 1
        return
    rank = run.ranks.get(ev.rank)
    if rank is None:
        rank = run.rank_state(ev.rank, settings)
        if rank is None:
            self.counters["ranks_dropped"] += 1
            return
    first = run.ranks[next(iter(run.ranks))]  # where run-wide detector state lives (straggler's)
    judged = first.detectors.get(straggler.RUN_KEY, _NO_STATE).get("judged")
    wide = run.lost or bool(run.incidents)  # on_alive, correlation: run-wide
    self._ranks_wide = False
    time_ns = ev.time_ns
    rank.touch(time_ns, ev.host, ev.pid)
    if ev.world_size > run.world_size:  # (written only when they change: the same values as max / or)
        run.world_size = ev.world_size
    if not run.run_name:
        run.run_name = ev.run_name
    if not run.trace_id:
        run.trace_id = ev.trace_id
    if time_ns:
        if not run.first_ns or time_ns < run.first_ns:
            run.first_ns = time_ns
        if time_ns > run.last_event_ns:  # newer: the run becomes its project's most recently active
            run.last_event_ns = time_ns  # (a replayed or late event changes no order: idempotent)
            self._index.touch_run(run, key)
    if run.lost:  # (else nothing to say)
        progress.on_alive(run, rank, ev.time_ns, settings)
    if ev.kind == "metrics":
        self._on_metrics(run, rank, ev, points, settings, self._at, routed)
    elif ev.kind == "heartbeat":
        self._on_heartbeat(run, rank, ev, settings)
    elif ev.kind == "exception":
        self._on_exception(run, rank, ev, settings)
    elif ev.kind == "lifecycle":
        self._on_lifecycle(run, rank, ev, settings)
    elif ev.kind == "log":  # error text printed by the job (process), an agent's hang report (progress)
        event = _info(ev, _step_of(ev, rank))
        for detector in DETECTORS:
            self._apply_all(run, rank, detector.on_log(run, rank, event, settings), settings)
    elif ev.kind == "memory":
        diagnosis.observe_memory(rank, ev.body)
        batch = MetricBatch((), ev.step, ev.time_ns, ev.event_id)
        for detector in DETECTORS:
            self._apply_all(run, rank, detector.on_memory(run, rank, ev.body, batch, settings), settings)
    if run.incidents:
        self._correlate(run, ev.time_ns, settings, folded=self._applied != applied_before)
    self._dirty_runs[key] = None  # _mark, inline (_unsaved_runs: set on entry)
    # which ranks this event may have written: its own and the first (run-wide detector state), unless
    # anything run-wide ran -- a finding applied (incidents, diagnosis), correlation, a lost run back,
    # shards combined, a step judged across ranks (the straggler detector writes every rank's pairs)
    touched = self._touched_ranks.get(key, _NO_RANKS)
    if touched is None:
        return  # every rank already
    if wide or run.incidents or self._ranks_wide or self._applied != applied_before or \
            first.detectors.get(straggler.RUN_KEY, _NO_STATE).get("judged") != judged:
        self._touched_ranks[key] = None
    else:
        if touched is _NO_RANKS:
            touched = self._touched_ranks[key] = set()
        touched.add(rank.rank)
        touched.add(first.rank)



def _on_metrics(self, run: RunState, rank: RankState, ev: ReadEnvelope, points: Sequence[Any],
                settings: DetectionSettings, at: int, route: Optional[_Route] = None) -> None:
    """A metric envelope (``at``: its index in the events of this ``process`` call; -1: a step's
    combined shard norms, not an envelope; ``route``: its route when already known)."""
    time_ns = ev.time_ns
    if route is None:
        route = self._route(rank, points, settings)
    if points and rank.observe_step(max(map(_STEP, points)), time_ns):
        progress.on_progress(run, rank, time_ns, settings)
    rank.observe_points(points, route.keep, time_ns, settings)
    if route.diagnosis:  # (it reads those points only)
        diagnosis.observe(rank, points, route.diagnosis)
    if ev.body.get("recent"):
        keeps, observe = settings.keeps_history, rank.observe_point
        for name, step, value in recent_points(ev.raw):
            if keeps(name):
                observe(name, step, value, time_ns, settings, context=True)
    batch = MetricBatch(points, ev.step, time_ns, ev.event_id)
    names = route.names
    columns = route.columns if at >= 0 and not route.sharded else ()
    for detector, ask in route.detectors:  # the registry's order (see detectors/registry.py)
        if columns and detector in columns:
            found = self._from_run(detector, run, rank, ev, points, batch, settings, at)
        elif not ask or detector.wants(rank, names, settings):
            found = detector.on_metrics(run, rank, batch, settings)
        else:
            continue
        for finding in found:
            self._apply(run, finding, settings)
    if route.sharded:
        self._ranks_wide = True  # shards.fold reads and clears every rank's shares
        combined = shards.fold(run, rank.rank, points)
        if combined:  # a step every rank reported its share of: the full gradients' norms
            target = run.ranks[min(run.ranks)]
            self._on_metrics(run, target, replace(ev, rank=target.rank, event_id="", body={}, raw={}),
                             combined, settings, -1)


'''
"""pipeline.py's Pipeline._fold and Pipeline._on_metrics at a11e7e4, verbatim (dedented)."""

_BEFORE: Dict[str, Any] = dict(vars(pipeline_mod))
_BEFORE["_STEP"] = itemgetter(1)  # the reference's name for a point's step (pipeline.py reads it no more)
exec(compile(BEFORE, "pipeline.py@a11e7e4", "exec"), _BEFORE)  # the reference code, verbatim


@contextmanager
def _before() -> Iterator[None]:
    saved = Pipeline._fold, Pipeline._on_metrics
    Pipeline._fold = _BEFORE["_fold"]  # type: ignore[method-assign]
    Pipeline._on_metrics = _BEFORE["_on_metrics"]  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pipeline._fold, Pipeline._on_metrics = saved  # type: ignore[method-assign]


def _compare(events: List[Event], piece: int = 37, restore_every: int = 3,
             projects: Optional[Dict[str, DetectionSettings]] = None) -> None:
    fast, slow = Pipeline(SETTINGS, projects), Pipeline(SETTINGS, projects)
    for k, lo in enumerate(range(0, len(events), piece)):
        part = events[lo:lo + piece]
        out_fast = fast.process(part)
        with _before():
            out_slow = slow.process(part)
        assert out_fast == out_slow, lo
        assert fast.counters == slow.counters, lo
        blob = fast.snapshot()
        assert blob == slow.snapshot(), lo
        if k % restore_every == restore_every - 1:
            fast, slow = Pipeline.restore(blob, SETTINGS, projects), Pipeline.restore(blob, SETTINGS, projects)
    assert fast.incidents() == slow.incidents()


def _replayed(events: List[Event], seed: int) -> List[Event]:
    """``events`` with each one sent again a few events later (at-least-once delivery)."""
    rng = random.Random(seed)
    out: List[Event] = []
    for i, event in enumerate(events):
        out.append(event)
        if rng.random() < 0.5:
            back = events[max(0, i - rng.randint(0, 5))]
            out.append(dict(back))
    return out


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = list(next(s for s in SCENARIOS if s.name == scenario).events())
    _compare(events, piece=41)
    _compare(_replayed(events, len(scenario)), piece=53, restore_every=2)


def _projects_stream(seed: int) -> List[Event]:
    """Two projects, two ranks each, metric batches of a few name lists (shards' norms among them), alerts,
    non-finite values, heartbeats, logs; replays."""
    rng = random.Random(seed)
    base_ns = 1_700_000_000_000_000_000
    lists = [["loss", "lr"], ["time/step_s", "grad/global_norm", "opt/lr"], ["loss"],
             ["grad/shard_sumsq", "loss"], ["mem/allocated", "loss"]]
    out: List[Event] = []
    for step in range(120):
        for project in ("a", "b"):
            for rank in (0, 1):
                head = {"project": project, "run_id": f"r-{project}", "host": f"h{rank}", "pid": 1 + rank,
                        "rank": rank, "world_size": 2, "step": step,
                        "time_unix_nano": base_ns + step * 10 ** 8 + rank, "severity": "INFO"}
                names = rng.choice(lists)
                points = [{"name": n, "value": 1.0 / (1 + step) + rng.random() * 0.01} for n in names]
                if rng.random() < 0.03:
                    points[0]["value"] = rng.choice([math.nan, math.inf])
                event = dict(head, event_id=f"{project}{rank}-{step}", metrics={"points": points})
                if rng.random() < 0.02:
                    event["metrics"] = dict(event["metrics"], alert="loss went non-finite")
                out.append(event)
                if rng.random() < 0.05:
                    out.append(dict(head, event_id=f"{project}{rank}-{step}-hb",
                                    heartbeat={"last_step": step, "step_time_ewma_s": 0.1}))
                if rng.random() < 0.02:
                    out.append(dict(head, event_id=f"{project}{rank}-{step}-log",
                                    log={"text": "RuntimeError: CUDA error: an illegal memory access"}))
    return _replayed(out, seed)


@pytest.mark.parametrize("seed", range(4))
def test_two_projects_with_their_own_settings_are_unchanged(seed: int) -> None:
    projects = {"b": DetectionSettings.from_overrides({"history_len": 64, "loss_metrics": ["loss", "lr"]})}
    _compare(_projects_stream(seed), piece=45 + seed, projects=projects)
    _compare(_projects_stream(seed), piece=200, restore_every=10 ** 9)
