"""The diagnosis's related metrics read the history through the series' tails (issue 15): ``_facts`` must
equal the definition -- each series sorted from the history dict, filtered, re-scanned -- after every kind
of update (points in order, late points, a replayed envelope overwriting its points, an alert's context
points, non-finite values, trims, a restored rank without tails), for incident steps before, inside and
past the history, on the recorded corpus's metric streams."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.diagnosis import _facts, _number
from trainguard_engine.extract import metric_points, recent_points
from trainguard_engine.records import Incident
from trainguard_engine.state import IncidentState, RankState, RunState

SMALL = DetectionSettings.from_overrides({"history_len": 16})  # trims every 16 points: often
STREAMS = ("explosion", "nan_source", "healthy_lm", "gpu_amp_overflow", "gpu_healthy_amp")


def _series(rank: RankState, names: Sequence[str], upto: int) -> List[Tuple[int, float]]:
    for name in names:
        data = rank.history.get(name)
        if data:
            return [(s, v) for s, (v, _t) in sorted(data.items()) if s <= upto]
    return []


def _finite(values: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    return [(s, v) for s, v in values if v - v == 0.0]


def _at(values: Sequence[Tuple[int, float]], step: int) -> Optional[float]:
    best = None
    for s, v in values:
        if s <= step:
            best = v
    return best


def _reference(rank: RankState, step: int, settings: DetectionSettings) -> Dict[str, Any]:
    """The related metrics and facts as the definition reads them (the code before the tails)."""
    out: Dict[str, Any] = {}
    upto = max(rank.max_step, step)
    loss = _series(rank, settings.loss_metrics, upto)
    if loss:
        finite = _finite(loss)
        item: Dict[str, Any] = {}
        at = _at(loss, step)
        if at is not None:
            item["at_first_step"] = _number(at)
        if finite:
            item["min"] = _number(min(v for _s, v in finite))
        item["last"] = _number(loss[-1][1])
        out["loss"] = item
    grads = _series(rank, settings.grad_norm_metrics, upto)
    out["grad_jump"] = 0.0
    if grads:
        item = {}
        at = _at(grads, step)
        before = [v for s, v in _finite(grads) if s < step][-32:]
        if at is not None:
            item["at_first_step"] = _number(at)
        if before:
            median = statistics.median(before)
            item["median_before"] = _number(median)
            if at is not None and median > 0 and at - at == 0.0:
                out["grad_jump"] = at / median
        finite_all = _finite(grads)
        if finite_all:
            item["max"] = _number(max(v for _s, v in finite_all))
        out["grad_norm"] = item
    clips = _finite(_series(rank, ("grad/clip_triggered",), step))
    out["clip_rate"] = None
    if clips:
        window = [v for _s, v in clips[-32:]]
        out["clip_rate"] = sum(1 for v in window if v > 0) / len(window)
        out["related_clip_rate"] = round(out["clip_rate"], 4)
    scale = _series(rank, ("amp/scale",), upto)
    out["has_amp"] = bool(scale)
    if scale:
        out["amp_scale"] = _number(scale[-1][1])
    return out


def _read(run: RunState, rank: RankState, step: int, settings: DetectionSettings) -> Dict[str, Any]:
    inc = Incident("i", "p", "r", "loss", "plateau", "warning", first_step=step, lead_rank=rank.rank)
    facts = _facts(run, rank, IncidentState("k", inc), settings)
    out: Dict[str, Any] = {k: facts.related[k] for k in ("loss", "grad_norm") if k in facts.related}
    out.update(grad_jump=facts.grad_jump, clip_rate=facts.clip_rate, has_amp=facts.has_amp)
    if "clip_rate" in facts.related:
        out["related_clip_rate"] = facts.related["clip_rate"]
    if "amp_scale" in facts.related:
        out["amp_scale"] = facts.related["amp_scale"]
    return out


@pytest.mark.parametrize("stream", STREAMS)
def test_facts_equal_the_history_read(stream: str) -> None:
    events = [e for e in BY_NAME[stream].events() if metric_points(e)]
    assert len(events) > 50
    order = list(events)  # every 9th envelope swapped with the 4th after it, every 7th delivered again
    for i in range(0, len(order) - 4, 9):
        order[i], order[i + 4] = order[i + 4], order[i]
    delivered = [e for i, e in enumerate(order) for _ in range(2 if i % 7 == 3 else 1)]
    run = RunState("p", "r")
    checked = late = 0
    for n, env in enumerate(delivered):
        rank_id = int(env.get("rank", 0))
        rank = run.ranks.setdefault(rank_id, RankState(rank_id))
        points = metric_points(env)
        top = max(s for _n, s, _v in points)
        rank.max_step = max(rank.max_step, top)
        for name, step, value in points:
            if SMALL.keeps_history(name):
                late += step < max(rank.history.get(name, {step: None}), default=step)
                rank.observe_point(name, step, value, int(env.get("time_unix_nano", 0)), SMALL)
        for name, step, value in recent_points(env):
            if SMALL.keeps_history(name):
                rank.observe_point(name, step, value, 0, SMALL, context=True)
        first = min((min(d) for d in rank.history.values() if d), default=0)
        for step in (top, top - 3, top + 5, first, first - 1, (first + top) // 2):
            if step < 0:
                continue  # an incident without a step is read at the rank's last: another candidate
            assert _read(run, rank, step, SMALL) == _reference(rank, step, SMALL), (stream, n, step)
            checked += 1
        if n % 97 == 0:  # a restored rank starts without tails
            run.ranks = {r: RankState.from_json(s.to_json()) for r, s in run.ranks.items()}
    assert checked > 300 and late > 0
