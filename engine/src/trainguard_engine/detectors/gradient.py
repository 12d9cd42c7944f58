"""Gradient detectors: explosion before the NaN, vanishing gradients, stale clipping, the NaN source (the
family's shared state, numeric slot and divergence story are in :mod:`.numeric`). Pure and streaming;
the rules are specified in docs/detectors.md (Gradient).
"""

from __future__ import annotations

import math
from typing import AbstractSet, Any, Dict, Final, List, Optional, Sequence, Tuple

from trainguard.core.events import from_wire_float, wire_float

from .. import robust
from ..catalogue import DetectionSettings
from ..diagnosis import DIVERGED_KINDS
from ..incidents import Finding, resolve
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from . import fmt_number, window
from .base import Detector, MetricBatch
from .numeric import (
    CLIP_STALE_KEY,
    LAYER_PREFIX,
    MAX_LAYERS_KEPT,
    NUMERIC_KEY,
    STATE_KEY,
    VANISHING_KEY,
    LossGradientSettings,
    diverged_before,
    diverged_state,
    find_explosion,
    finite_series,
    grad_metric,
    loss_diverged,
    lr_span,
    nan_source,
    nan_source_evidence,
    note_nonfinite,
    numeric_final,
    point_time,
    rank_has_open,
    rank_state,
    read_batch,
    recent,
    upgrades,
)

CLIMB_GATE_STEPS: Final = 8
"""Steps a computed climb baseline gates the explosion check (see :func:`check_climb`)."""
"""Most layer names kept in state and evidence (first ones, and the largest norms)."""


def last_finite(rank: RankState, name: str, upto: int, most: int) -> List[Tuple[int, float]]:
    """The last ``most`` finite ``(step, value)`` of ``name`` received at steps <= ``upto``, by step."""
    return [(s, v) for s, v, _t in recent(rank, name, most, upto)][-most:]


def loss_metric(rank: RankState, settings: DetectionSettings) -> Optional[str]:
    """The rank's loss metric (first of ``loss_metrics`` it has a history of)."""
    return next((n for n in settings.loss_metrics if n in rank.history), None)


# ----------------------------------------------------------------------------------------------------
# entry point


def on_metrics(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings of the gradient detectors for one metric batch of ``rank`` (already in its history, and
    after :func:`trainguard_engine.detectors.loss.on_metrics` judged any non-finite loss in it)."""
    tuned = settings
    detectors = rank.detectors
    state: Optional[Dict[str, Any]] = detectors.get(STATE_KEY)  # (rank_state, inline)
    if state is None:
        state = detectors[STATE_KEY] = {}
    out: List[Finding] = []
    grad_point, layers, loss_point, overflow = read_batch(rank, state, points, settings)
    numeric_open = numeric_final(run, rank) if run.incidents else False  # (no incident: not open)
    # 1. a non-finite gradient waiting for its step's loss (note_nonfinite's "nothing to note" test inline:
    # no layer report and no non-finite norm, the usual batch)
    if not numeric_open and not overflow and \
            (layers or (grad_point is not None and grad_point[2] - grad_point[2] != 0.0)):
        note_nonfinite(state, grad_point, layers, time_ns)
    if layers:
        out.extend(check_layers(run, rank, layers, time_ns, event_id, settings, tuned))
    pending = state.get("nonfinite")
    if pending is not None and pending.get("waiting"):
        if numeric_open:
            pending["waiting"] = False
        else:
            loss_seen = loss_point is not None and loss_point[1] >= pending["step"] and \
                math.isfinite(loss_point[2])
            if loss_seen or (grad_point is not None and grad_point[1] > pending["step"]):
                pending["waiting"] = False
                out.append(_pending_finding(run, rank, pending, loss_seen, time_ns, event_id, settings))
                numeric_open = True
    # 2. a climbing gradient norm before any NaN
    # (not while the loss has left its band: then the loss curve's divergence tells the story, and a
    # non-finite loss or gradient later re-classifies it as the explosion, with the climb as evidence)
    if grad_point is not None and math.isfinite(grad_point[2]):
        if numeric_open:
            _climb_settled(run, rank, state, grad_point, time_ns, settings)
        elif not diverged_state(state, settings):
            grad_state: Optional[Dict[str, Any]] = state.get("grad")
            if grad_state is None:
                grad_state = state["grad"] = {}
            elif "gave_way" in grad_state and rank_has_open(run, rank, "loss:plateau"):
                # a pre-NaN explosion that gave way to the plateau its flat loss is (loss.py's
                # _explosion_gave_way), still open: the climb is not flagged again (a non-finite loss or
                # gradient still is, through the numeric rules)
                grad_state = None
            if grad_state is not None and grad_point[1] > grad_state.get("last", -1):
                grad_state["last"] = grad_point[1]
                gate = grad_state.get("gate")  # [baseline, step it was computed at]
                far_below = (gate is not None and grad_point[1] - gate[1] < CLIMB_GATE_STEPS
                             and grad_point[2] < 0.5 * settings.explosion_jump_factor * gate[0])
                found = None if far_below else check_climb(run, rank, grad_point[0], grad_point[1], time_ns,
                                                           event_id, settings, tuned, memo=grad_state)
                if found is not None:
                    out.append(found)
                    numeric_open = True
                    grad_state["climb"] = [grad_state["gate"][0], grad_point[1], 0]  # [baseline, step, calm]
    # 3. clipping that eats the update (judged when the step's loss arrives)
    if loss_point is not None and math.isfinite(loss_point[2]) and not numeric_open:
        found = check_clip(run, rank, loss_point[0], loss_point[1], time_ns, event_id, settings, tuned, state)
        if found is not None:
            out.append(found)
    return out


def climb_range_top(values: Sequence[float], quantile: float) -> float:
    """The ``quantile`` of the baseline half of ``values`` (the earlier half, as :func:`climb_baseline`'s;
    nearest rank), which the sustained norms of a climb must all exceed; -inf when ``quantile`` is 0 (off)."""
    if not quantile > 0:
        return -math.inf
    earlier = sorted(values[: max(1, len(values) // 2)])
    return earlier[min(len(earlier) - 1, int(quantile * len(earlier)))]


def check_climb(run: RunState, rank: RankState, name: str, step: int, time_ns: int, event_id: str,
                settings: DetectionSettings, tuned: LossGradientSettings,
                memo: Optional[Dict[str, Any]] = None) -> Optional[Finding]:
    """The pre-NaN explosion rule (module docstring) at the grad norm of ``step``; a Finding or None.

    ``memo`` (the rank's grad state) receives ``gate = [baseline, step]``: for the next
    CLIMB_GATE_STEPS steps a norm below half the jump threshold over that baseline skips this check (the
    baseline, a median over the window's earlier half, cannot halve that fast), which keeps the
    per-event cost of a healthy run low."""
    lo = step - settings.explosion_window_steps
    series = recent(rank, name, settings.explosion_window_steps + 1, step)  # (by step: those >= lo, a suffix)
    first = 0
    while first < len(series) and series[first][0] < lo:
        first += 1
    if first:
        series = series[first:]  # (a slice: the points themselves, compiled not rebuilt one by one)
    if len(series) < max(tuned.explosion_trend_points, 2 * tuned.explosion_sustain, 4):
        return None
    # climb_baseline of the values, read from the earlier half alone: the usual call ends at the sustain
    # test, before the whole list of values is built
    baseline = robust.median([v for _s, v, _t in series[: max(1, len(series) // 2)]])
    if memo is not None and baseline > 0:
        memo["gate"] = [baseline, step]
    if not baseline > 0:
        return None
    factor = settings.explosion_jump_factor
    if not all(p[1] >= factor * baseline for p in series[-tuned.explosion_sustain:]):
        return None
    values = [v for _s, v, _t in series]
    bar = climb_range_top(values, settings.explosion_climb_quantile)
    if not all(v > bar for v in values[-tuned.explosion_sustain:]):
        return None  # inside the range the norm already had in the baseline half: a heavy-tailed norm (a
        #              converged model's, median collapsed, hard batches still ~1) spiking, not a climb
    trend = robust.mann_kendall(values[-tuned.explosion_trend_points:])
    if trend.z < tuned.trend_z:
        return None
    onset_index = len(series) - robust.trailing_run([v >= tuned.explosion_onset_factor * baseline
                                                      for v in values])
    onset = series[onset_index]
    loss_name = loss_metric(rank, settings)
    if loss_name is not None:  # a norm growing while the loss falls is a model starting to learn
        lo = min(onset[0], series[-tuned.explosion_trend_points][0])
        losses = [v for _s, v, _t in finite_series(rank, loss_name, lo, step)]
        if len(losses) >= 4 and robust.mann_kendall(losses).z <= -tuned.trend_z:
            return None
    ratio = values[-1] / baseline
    win = window(rank, name, step, settings.evidence_window)
    evidence = [Evidence(
        rule="gradient.norm_climb",
        description=(f"{name} climbed from its running median {fmt_number(baseline)} to "
                     f"{fmt_number(values[-1])} ({ratio:.3g}x) at step {step}: the last "
                     f"{tuned.explosion_sustain} values >= {factor:g}x, rising (Mann-Kendall "
                     f"z = {trend.z:.2f} >= {tuned.trend_z:g} over {trend.n} values); above "
                     f"{tuned.explosion_onset_factor:g}x since step {onset[0]}"),
        step=onset[0], time_ns=onset[2] or time_ns, rank=rank.rank, metric=name, threshold=factor,
        value=wire_float(ratio), window=win, event_id=event_id)]  # 1e308 / 5e-324: "Infinity"
    evidence.extend(_explosion_context(rank, onset[0], step, time_ns, settings, tuned))
    last_loss = rank.history.get(loss_name, {}).get(step) if loss_name else None
    loss_text = fmt_number(last_loss[0]) if last_loss is not None else "?"
    lr = lr_span(rank, onset[0], step)
    detail = f"{name} {ratio:.3g}x its median and rising since step {onset[0]}"
    timeline = [
        TimelineEntry(time_ns=onset[2] or time_ns, step=onset[0], rank=rank.rank,
                      what=f"rank {rank.rank}: {name} {fmt_number(onset[1])} at step {onset[0]}, "
                           f"{onset[1] / baseline:.3g}x its median: the climb begins"),
        TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                      what=f"rank {rank.rank}: {name} {fmt_number(values[-1])} at step {step}, "
                           f"{ratio:.3g}x its median and still rising; {loss_name or 'the loss'} "
                           f"{loss_text}, still finite")]
    return Finding(
        "gradient", "explosion", NUMERIC_KEY, rank.rank, onset[0], onset[2] or time_ns, seen_ns=time_ns,
        seen_step=step, host=rank.host, event_id=event_id, evidence=evidence, timeline=timeline,
        values={"detail": detail, "value": f"{loss_text} (still finite)", "step": step, "metric": name,
                "rank": rank.rank}, relabel=upgrades(run, "gradient", "explosion"),
        summary=(f"On rank {rank.rank}, {name} has been climbing since step {onset[0]} and is "
                 f"{ratio:.3g}x its running median at step {step}{lr}. The loss is still finite: a gradient "
                 f"explosion in the making, flagged before the first NaN. Look at the learning rate and its "
                 f"schedule, the clipping, and the data around step {onset[0]}."))


def _climb_settled(run: RunState, rank: RankState, state: Dict[str, Any], grad_point: Tuple[str, int, float],
                   time_ns: int, settings: DetectionSettings) -> None:
    """Resolve a gradient explosion flagged before any non-finite value (:func:`check_climb`) once the norm
    came back: ``explosion_resolve_points`` readings in a row below ``explosion_onset_factor`` x the
    baseline the climb was measured from, with no non-finite loss or gradient on the rank and its loss
    within its band. A spike that recovered is history (the run's health recovers, and the loss curve is
    judged again); a later climb or NaN opens the slot again."""
    grad_state = state.get("grad", {})
    climb = grad_state.get("climb")
    st = run.incidents.get(NUMERIC_KEY)
    if climb is None or st is None or (st.record.category, st.record.subtype) != ("gradient", "explosion") \
            or grad_point[1] <= climb[1] or "loss_nonfinite" in state or state.get("nonfinite"):
        return
    baseline, since, calm = climb
    recovered = _recovered(rank, grad_point[0], int(since), grad_point[1], baseline, settings) or \
        _settled(rank, grad_point[0], int(since), grad_point[1], baseline, settings)
    if recovered is None and (grad_point[2] >= settings.explosion_onset_factor * baseline
                              or loss_diverged(rank, settings)):
        climb[2] = 0
        return
    climb[2] = calm + 1
    if recovered is None and climb[2] < settings.explosion_resolve_points:
        return
    grad_state.pop("climb", None)
    what = recovered or (f"{grad_point[0]} back below {settings.explosion_onset_factor:g}x its median "
                         f"before the climb ({fmt_number(baseline)}) on {settings.explosion_resolve_points} "
                         f"readings in a row, the loss finite and in its band: the spike recovered")
    resolve(st, time_ns, grad_point[1], rank.rank, f"rank {rank.rank}: {what}", settings)


def _recovered(rank: RankState, name: str, since: int, step: int, baseline: float,
               settings: DetectionSettings) -> Optional[str]:
    """Why the run recovered from a pre-NaN explosion flagged at ``since`` although its grad norm stays
    spiky, or None: the loss's rolling level <= ``explosion_recovered_level`` x where it started (the
    median of its first values, or the first value when lower: an LR far too high moves the loss on the
    first update) and the median of the last ``explosion_resolve_points`` readings of
    ``name`` after ``since`` < ``explosion_onset_factor`` x ``baseline`` (the climb's median)."""
    factor, points = settings.explosion_recovered_level, settings.explosion_resolve_points
    loss = rank_state(rank).get("loss", {})
    level, init = loss.get("level"), loss.get("init")
    if not factor > 0 or level is None or not init:
        return None
    start = min(robust.median(list(init)), init[0])  # the first value: an LR that threw the first update
    if not (start > 0 and math.isfinite(level) and level <= factor * start):
        return None
    norms = [v for s, v in last_finite(rank, name, step, points) if s > since]
    if len(norms) < points:
        return None
    median = robust.median(norms)
    if median >= settings.explosion_onset_factor * baseline:
        return None
    return (f"the loss recovered (its level {fmt_number(level)} <= {factor:g}x its initial "
            f"{fmt_number(start)}) and {name}'s median over its last {points} readings "
            f"({fmt_number(median)}) is back below {settings.explosion_onset_factor:g}x its median before "
            f"the climb ({fmt_number(baseline)}): the run learned through the blow-up")


def _settled(rank: RankState, name: str, since: int, step: int, baseline: float,
             settings: DetectionSettings) -> Optional[str]:
    """Why a pre-NaN explosion flagged at ``since`` is over although the norm never came back under
    ``explosion_onset_factor`` x ``baseline``, or None: the norm stopped climbing at a new level -- the last
    ``explosion_resolve_points`` readings of ``name`` after ``since`` show no rising trend (Mann-Kendall
    z < trend_z) and their largest is <= ``explosion_settled_spread`` x their median -- while the loss is
    finite, in its band and its rolling level <= ``explosion_settled_level`` x where it started (the median
    of its first values, or the first value when lower): one bad batch that threw an adaptive optimizer's
    state off, and the run learned and trains on at a higher norm than before."""
    spread, factor, points = (settings.explosion_settled_spread, settings.explosion_settled_level,
                              settings.explosion_resolve_points)
    if not (spread > 0 and factor > 0) or loss_diverged(rank, settings):
        return None
    loss = rank_state(rank).get("loss", {})
    level, init = loss.get("level"), loss.get("init")
    if level is None or not init:
        return None
    start = min(robust.median(list(init)), init[0])
    if not (start > 0 and math.isfinite(level) and level <= factor * start):
        return None
    values = [v for s, v in last_finite(rank, name, step, points) if s > since]
    if len(values) < points:
        return None
    median = robust.median(values)
    if not (median > 0 and max(values) <= spread * median):
        return None
    trend = robust.mann_kendall(values)
    if trend.z >= settings.trend_z:
        return None
    return (f"{name} stopped climbing: its last {points} readings since step {since} hold at a median of "
            f"{fmt_number(median)} ({median / baseline:.3g}x its median before the climb, "
            f"{fmt_number(baseline)}), none above {spread:g}x that median, with no rising trend "
            f"(Mann-Kendall z = {trend.z:.2f} < {settings.trend_z:g}); the loss is finite, in its band and "
            f"its level {fmt_number(level)} <= {factor:g}x its initial {fmt_number(start)}: the blow-up is "
            f"over, the run trains on at a higher gradient norm than before it")


def _explosion_context(rank: RankState, lo: int, hi: int, time_ns: int, settings: DetectionSettings,
                       tuned: LossGradientSettings) -> List[Evidence]:
    """Corroborating evidence of the seed's other explosion signals: clip rate and large layer norms."""
    out: List[Evidence] = []
    clipped = finite_series(rank, "grad/clip_triggered", hi - settings.explosion_window_steps, hi)
    if clipped:
        rate = sum(1 for _s, v, _t in clipped if v >= 0.5) / len(clipped)
        if rate > tuned.clip_rate_warn:
            out.append(Evidence(
                rule="gradient.clip_rate", description=f"clipping triggered on {rate:.0%} of the last "
                f"{len(clipped)} steps (> {tuned.clip_rate_warn:.0%})", step=hi, time_ns=time_ns,
                rank=rank.rank, metric="grad/clip_triggered", threshold=tuned.clip_rate_warn, value=rate,
                window=window(rank, "grad/clip_triggered", hi, settings.evidence_window)))
    layers = rank_state(rank).get("layers", {}).get("largest", [])
    big = [(n, v) for n, v in layers if from_wire_float(v) > tuned.layer_norm_warn]
    if big:
        shown = ", ".join(f"{n} {fmt_number(from_wire_float(v))}" for n, v in big)
        out.append(Evidence(
            rule="gradient.layer_norm",
            description=f"per-layer grad norms above {tuned.layer_norm_warn:g}: {shown}",
            step=int(rank_state(rank)["layers"].get("last", hi)), time_ns=time_ns, rank=rank.rank,
            metric=LAYER_PREFIX + "*", threshold=tuned.layer_norm_warn,
            value=max(from_wire_float(v) for _n, v in big),
            window=[{"step": n, "value": v} for n, v in big]))
    return out


# ----------------------------------------------------------------------------------------------------
# vanishing


def layer_ratio(norms: Sequence[float]) -> Optional[float]:
    """L2 norm of the last third / L2 norm of the first third of ``norms`` (input layers first); None
    when it cannot be judged (fewer than 3 layers, a non-finite norm, no gradient in the last third) or
    the first third has exactly none (dead ReLUs or a part detached from the loss: the plateau verdict
    names those layers; vanishing gradients are small, not zero)."""
    if len(norms) < 3 or not all(math.isfinite(v) for v in norms):
        return None
    k = len(norms) // 3
    first = math.sqrt(sum(v * v for v in norms[:k]))
    last = math.sqrt(sum(v * v for v in norms[-k:]))
    if last <= 0 or first == 0:
        return None  # no gradient at all in the first layers: dead units or a detached part, not vanishing
    return last / first


def check_layers(run: RunState, rank: RankState, layers: Sequence[Tuple[str, int, float]], time_ns: int,
                 event_id: str, settings: DetectionSettings, tuned: LossGradientSettings) -> List[Finding]:
    """The vanishing rule on one per-layer report (the ``grad/layer/*`` points of one batch)."""
    step = layers[0][1]
    state = rank_state(rank).setdefault("layers", {})
    if any(s != step for _n, s, _v in layers) or step <= state.get("last", -1):
        return []
    state["last"] = step
    norms = [v for _n, _s, v in layers]
    finite = [(n, v) for n, _s, v in layers if math.isfinite(v)]
    finite.sort(key=lambda item: -item[1])
    state["largest"] = [[n[len(LAYER_PREFIX):], wire_float(v)] for n, v in finite[:4]]
    state["zero"] = [n[len(LAYER_PREFIX):] for n, _s, v in layers if v == 0.0][:MAX_LAYERS_KEPT]
    # the zero layers that had a gradient on an earlier report: units that died during the run (the loss
    # detector's _stuck_now tells them from units dead from the start)
    alive: List[str] = state.setdefault("alive", [])
    state["died"] = bool(state["zero"]) and all(n in alive for n in state["zero"])
    for n, _s, v in layers:
        name = n[len(LAYER_PREFIX):]
        if v != 0.0 and math.isfinite(v) and len(alive) < MAX_LAYERS_KEPT and name not in alive:
            alive.append(name)
    state["count"] = len(layers)
    if len(layers) < tuned.vanishing_min_layers:
        return []
    ratio = layer_ratio(norms)
    ratios: List[List[Any]] = state.setdefault("ratios", [])
    if ratio is not None:
        ratios.append([step, wire_float(ratio)])
        del ratios[: max(0, len(ratios) - settings.evidence_window)]
    if ratio is None or ratio < tuned.vanishing_ratio:
        state["streak"], state["since"] = 0, -1
        return []
    if state.get("streak", 0) == 0:
        state["since"], state["since_ns"] = step, time_ns
    state["streak"] = state.get("streak", 0) + 1
    if state["streak"] < tuned.vanishing_min_reports:
        return []
    if rank_has_open(run, rank, VANISHING_KEY):
        return [Finding("gradient", "vanishing", VANISHING_KEY, rank.rank, state["since"],
                        state.get("since_ns") or time_ns, seen_ns=time_ns, seen_step=step, host=rank.host,
                        event_id=event_id, counts=False)]
    k = len(layers) // 3
    names = [n[len(LAYER_PREFIX):] for n, _s, _v in layers]
    first = ", ".join(f"{n} {fmt_number(v)}" for n, v in zip(names[:k], norms[:k]))
    last = ", ".join(f"{n} {fmt_number(v)}" for n, v in zip(names[-k:], norms[-k:]))
    shown = "inf" if math.isinf(ratio) else f"{ratio:.3g}"
    evidence = [Evidence(
        rule="gradient.layer_ratio",
        description=(f"grad norm of the last third of {len(layers)} layers / the first third = {shown} "
                     f">= {tuned.vanishing_ratio:g} on {state['streak']} consecutive per-layer reports "
                     f"since step {state['since']} (first third: {_cut(first)}; last third: {_cut(last)})"),
        step=state["since"], time_ns=state.get("since_ns") or time_ns, rank=rank.rank,
        metric=LAYER_PREFIX + "*", threshold=tuned.vanishing_ratio, value=wire_float(ratio),
        window=[{"step": s, "value": v} for s, v in ratios], event_id=event_id)]
    return [Finding(
        "gradient", "vanishing", VANISHING_KEY, rank.rank, state["since"], state.get("since_ns") or time_ns,
        seen_ns=time_ns, seen_step=step, host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: first-third layers' gradients {shown}x smaller than "
                                     f"the last third's ({state['streak']} reports in a row)")],
        values={"step": state["since"], "detail": f"{shown}x", "value": shown, "rank": rank.rank},
        summary=(f"On rank {rank.rank}, the gradients of the first {k} of {len(layers)} layers are {shown}x "
                 f"smaller than those of the last {k} on every per-layer report since step "
                 f"{state['since']}: the layers near the input barely update (vanishing gradients). A flat "
                 f"loss on this rank is explained by it and is not reported separately."))]


def _cut(text: str, most: int = 240) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# clip-stale


def clip_tau(rank: RankState, lo: int, hi: int, name: str) -> Tuple[Optional[float], Optional[float], bool]:
    """``(lower, upper, known)`` bounds of the clip threshold tau from the rank's history over [lo, hi]:
    tau itself when the job reported it (``known``), else tau > the largest unclipped pre-clip norm and
    tau <= the smallest clipped one (either may be None)."""
    tau = rank_state(rank).get("clip", {}).get("tau")
    if tau is not None:
        return float(tau), float(tau), True
    norms = {s: v for s, v, _t in finite_series(rank, name, lo, hi)}
    clipped = [norms[s] for s, v, _t in finite_series(rank, "grad/clip_triggered", lo, hi)
               if s in norms and v >= 0.5]
    unclipped = [norms[s] for s, v, _t in finite_series(rank, "grad/clip_triggered", lo, hi)
                 if s in norms and v < 0.5]
    return (max(unclipped) if unclipped else None), (min(clipped) if clipped else None), False


def _clip_quiet(state: Dict[str, Any], history: Dict[str, Dict[int, Any]], step: int) -> bool:
    """Whether :func:`check_clip` at ``step`` (past its ``last`` test) returns None and changes nothing
    more, whatever the grad norm (so without looking for it): no threshold reported, the step not clipped
    and the streak already reset (``streak`` 0, ``since`` -1 -- what the not-clipped branch writes)."""
    if "tau" in state or state.get("streak") != 0 or state.get("since") != -1:
        return False
    flags = history.get("grad/clip_triggered")
    flag = flags.get(step) if flags else None
    return flag is None or flag[0] < 0.5


def check_clip(run: RunState, rank: RankState, loss_name: str, step: int, time_ns: int, event_id: str,
               settings: DetectionSettings, tuned: LossGradientSettings,
               family: Optional[Dict[str, Any]] = None) -> Optional[Finding]:
    """The clip-stale rule when the loss of ``step`` arrives (judged at steps with a reported grad norm:
    a sparse norm cadence makes the streak count reports, not steps); a Finding or None. ``family``: the
    rank's family state (:func:`rank_state`) when the caller holds it."""
    if family is None:
        family = rank_state(rank)
    state = family.get("clip")
    if state is None:
        state = family["clip"] = {}
    if step <= state.get("last", -1):
        return None
    state["last"] = step
    history = rank.history
    if _clip_quiet(state, history, step):
        return None
    gname = grad_metric(rank, settings)
    norms_kept = history.get(gname) if gname is not None else None
    if norms_kept is None or step not in norms_kept:
        return None  # no norm reported at this step (a sparse cadence): nothing new to judge
    flags = history.get("grad/clip_triggered")
    flag = flags.get(step) if flags else None
    if "tau" not in state and (flag is None or flag[0] < 0.5):  # not clipped now (or no clip): cheap
        state["streak"], state["since"] = 0, -1
        return None
    pinned, norms, mean_norm = _pinned(rank, gname, step, tuned)
    stale = False
    curve: Optional[robust.Curvature] = None
    rel = rel_se = math.nan
    if pinned:
        losses = last_finite(rank, loss_name, step, tuned.clip_stale_curve_window)
        if len(losses) >= tuned.clip_stale_curve_window and _steady(norms, tuned) and \
                _starved(rank, [v for _s, v in losses], mean_norm, tuned):
            curve = robust.curvature([float(s) for s, _v in losses], [v for _s, v in losses])
        if curve is not None and curve.level != 0:
            rel, rel_se = curve.d2 / abs(curve.level), curve.se / abs(curve.level)
            stale = abs(rel) < tuned.clip_stale_curvature or abs(rel) <= tuned.trend_z * rel_se
    if not stale:
        state["streak"], state["since"] = 0, -1
        return None
    if state.get("streak", 0) == 0:
        state["since"] = _clipped_since(rank, step, norms[0][0] if norms else step)
        state["since_ns"] = point_time(rank, "grad/clip_triggered", state["since"], time_ns)
    state["streak"] = state.get("streak", 0) + 1
    if state["streak"] < tuned.confirm_checks:
        return None
    stale_count = state["streak"]
    since = int(state["since"])
    if rank_has_open(run, rank, CLIP_STALE_KEY):
        return Finding("gradient", "clip-stale", CLIP_STALE_KEY, rank.rank, since,
                       state.get("since_ns") or time_ns, seen_ns=time_ns, seen_step=step, host=rank.host,
                       event_id=event_id, counts=False)
    lower, upper, known = clip_tau(rank, step - settings.explosion_window_steps, step, gname or "")
    grow = 1 + tuned.clip_stale_growth * stale_count
    if known and upper is not None:
        tau_text = f"tau = {fmt_number(upper)}"
        rec = (f"adaptive threshold (seed): stale tau <- tau x (1 + {tuned.clip_stale_growth:g} x "
               f"{stale_count}) = {fmt_number(upper * grow)}; at an explosion onset tau <- min("
               f"{tuned.clip_onset_growth:g} tau, {tuned.clip_max_tau:g}) = "
               f"{fmt_number(min(tuned.clip_onset_growth * upper, tuned.clip_max_tau))}")
    else:
        bound = f"tau <= {fmt_number(upper)} (the smallest clipped pre-clip norm)" if upper is not None \
            else "tau unknown"
        if lower is not None:
            bound += f", > {fmt_number(lower)}"
        tau_text = bound
        rec = (f"adaptive threshold (seed): stale tau <- tau x (1 + {tuned.clip_stale_growth:g} x "
               f"{stale_count}) = {grow:.3g} x your max_norm; at an explosion onset tau <- "
               f"min({tuned.clip_onset_growth:g} tau, {tuned.clip_max_tau:g})")
    median_norm = robust.median([v for _s, v in norms]) if norms else math.nan
    diverged = diverged_step(run, rank)
    advice = ("raise max_norm (or lower the LR if nearly every step clips)" if diverged is None else
              f"the loss diverged at step {diverged}: every step clips because the updates are too large for "
              f"the model -- lower the LR (a higher max_norm would let them through)")
    rule_text = (f"mean pre-clip grad norm of the last {len(norms)} steps {fmt_number(mean_norm)} > "
                 f"{tuned.clip_stale_norm_ratio:g} x tau" if known else
                 f"clipping triggered on each of the last {len(norms)} steps (the pre-clip norm, median "
                 f"{fmt_number(median_norm)}, was >= tau every time)")
    curve_text = (f"loss curvature {rel:.3g} per step^2 relative to the level (+- {rel_se:.2g}), "
                  f"below {tuned.clip_stale_curvature:g} or within {tuned.trend_z:g} standard errors of 0: "
                  f"the loss is not bending down")
    evidence = [
        Evidence(rule="gradient.clip_pinned", description=f"{rule_text}; {tau_text}; since step {since}",
                 step=since, time_ns=state.get("since_ns") or time_ns, rank=rank.rank,
                 metric=gname or "grad/clip_triggered", threshold=tuned.clip_stale_norm_ratio,
                 value=mean_norm / upper if known and upper else wire_float(median_norm),
                 window=window(rank, gname or "grad/clip_triggered", step, settings.evidence_window),
                 event_id=event_id),
        Evidence(rule="loss.curvature", description=curve_text, step=step, time_ns=time_ns, rank=rank.rank,
                 metric=loss_name, threshold=tuned.clip_stale_curvature, value=wire_float(rel),
                 window=window(rank, loss_name, step, settings.evidence_window)),
        Evidence(rule="gradient.clip_recommendation",
                 description=f"{rec}; stale for {stale_count} steps. Every update is scaled down to tau: "
                             f"{advice}",
                 step=step, time_ns=time_ns, rank=rank.rank, metric="grad/clip_triggered",
                 threshold=tuned.clip_stale_growth, value=grow,
                 window=window(rank, "grad/clip_triggered", step, settings.evidence_window)),
    ]
    return Finding(
        "gradient", "clip-stale", CLIP_STALE_KEY, rank.rank, since, state.get("since_ns") or time_ns,
        seen_ns=time_ns, seen_step=step, host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: every step clipped since step {since} and the "
                                     f"loss is flat ({stale_count} steps stale)")],
        values={"step": since, "detail": tau_text, "value": fmt_number(median_norm), "rank": rank.rank},
        summary=(f"On rank {rank.rank}, gradient clipping has scaled down every update since step {since} "
                 f"(pre-clip grad norm median {fmt_number(median_norm)}, {tau_text}) while the loss curve "
                 f"stays flat: clipping is eating the update. "
                 + (f"Recommendation: {rec}." if diverged is None else f"But {advice}.")))


def diverged_step(run: RunState, rank: RankState) -> Optional[int]:
    """The first step of an incident of ``run`` listing ``rank`` (open or resolved) that says its updates
    were too large (loss/divergence, gradient/explosion, loss/non_finite), or None."""
    first: Optional[int] = None
    for st in run.incidents.values():
        rec = st.record
        if rank.rank in st.rank_first and f"{rec.category}/{rec.subtype}" in DIVERGED_KINDS and \
                (first is None or rec.first_step < first):
            first = rec.first_step
    return first


def _steady(norms: Sequence[Tuple[int, float]], tuned: LossGradientSettings) -> bool:
    """Whether the clip-stale window's pre-clip norms hold still (max < ``explosion_onset_factor`` x their
    median): clipping that eats the update pins a norm that barely moves (the weights barely do); a norm
    climbing through the threshold is an explosion's onset, the explosion rule's call."""
    values = [v for _s, v in norms]
    return bool(values) and max(values) < tuned.explosion_onset_factor * robust.median(values)


def _starved(rank: RankState, losses: Sequence[float], mean_norm: float, tuned: LossGradientSettings) -> bool:
    """Whether the clipping starves the updates, judged on the loss values ``losses`` (the last
    ``clip_stale_curve_window``). Never while the loss rises (Mann-Kendall z >= trend_z: that is a
    divergence, and raising the threshold would make it worse). With the threshold tau reported: starved
    when the pre-clip norm is >= ``clip_stale_min_ratio`` x tau (every update cut to a sliver; a cut by a
    factor of 1-2 starves nothing, whatever else keeps the loss flat -- a warmup from LR ~0, say). With tau
    unknown: when the loss is flat (|z| < trend_z) and still >= ``plateau_min_level`` x the run's initial
    level (it never got going). Never either while the loss has left its band (``loss_diverged``: its level
    >= ``divergence_factor`` x its start, flat up there or not): a loss held far above where it started
    under clipping is diverged, and advice to raise the threshold would make it worse."""
    if loss_diverged(rank, tuned):
        return False
    z = robust.mann_kendall(list(losses)).z
    if z >= tuned.trend_z:
        return False
    tau = rank_state(rank).get("clip", {}).get("tau")
    if tau is not None and tau > 0:  # known: the cut is mean_norm / tau, a factor of ~1 starves nothing
        return mean_norm >= tuned.clip_stale_min_ratio * float(tau)
    if z <= -tuned.trend_z:
        return False
    init = rank_state(rank).get("loss", {}).get("init")
    if not init:
        return True
    initial = robust.median(list(init))
    return initial <= 0 or robust.median(list(losses)) >= tuned.plateau_min_level * initial


def _pinned(rank: RankState, gname: Optional[str], step: int, tuned: LossGradientSettings
            ) -> Tuple[bool, List[Tuple[int, float]], float]:
    """Whether the clip threshold pinned the last ``clip_stale_window`` reported norms; the norms
    ``(step, value)`` and their mean."""
    if gname is None:
        return False, [], math.nan
    norms = last_finite(rank, gname, step, tuned.clip_stale_window)
    if len(norms) < tuned.clip_stale_window:
        return False, norms, math.nan
    mean_norm = sum(v for _s, v in norms) / len(norms)
    tau = rank_state(rank).get("clip", {}).get("tau")
    if tau is not None:
        return mean_norm > tuned.clip_stale_norm_ratio * float(tau), norms, mean_norm
    flags = rank.history.get("grad/clip_triggered", {})
    clipped = [flags.get(s) for s, _v in norms]
    return all(f is not None and f[0] >= 0.5 for f in clipped), norms, mean_norm


def _clipped_since(rank: RankState, step: int, fallback: int) -> int:
    """The first step of the run of consecutively clipped steps that ends at ``step`` (``fallback`` when
    the trigger flags are not in the history, e.g. tau is reported instead)."""
    flags = finite_series(rank, "grad/clip_triggered", -(2**63), step)
    run = robust.trailing_run([v >= 0.5 for _s, v, _t in flags])
    return flags[len(flags) - run][0] if run else fallback


def _pending_finding(run: RunState, rank: RankState, pending: Dict[str, Any], loss_seen: bool, time_ns: int,
                     event_id: str, settings: DetectionSettings) -> Finding:
    """A non-finite gradient whose step's loss stayed finite (``loss_seen``) or was not reported by the
    next step: an explosion when the norm climbed before it, else a NaN source."""
    source = nan_source(rank)
    assert source is not None
    loss_text = "the loss of that step was still finite" if loss_seen else \
        "no non-finite loss was reported for that step"
    explosion = find_explosion(rank, source.step + 1, time_ns, settings) or \
        diverged_before(run, rank, source.step, time_ns, settings)
    if explosion is not None:
        began = source.step if explosion.onset_step is None else min(source.step, explosion.onset_step)
        return Finding(
            "gradient", "explosion", NUMERIC_KEY, rank.rank, began, explosion.earliest_ns,
            seen_ns=time_ns, host=rank.host, event_id=event_id, evidence=explosion.evidence,
            timeline=explosion.timeline, relabel=upgrades(run, "gradient", "explosion"),
            values={"detail": explosion.short, "value": f"finite ({source.metric} {source.value})",
                    "step": source.step, "rank": rank.rank},
            summary=(f"On rank {rank.rank}, {explosion.detail}; {loss_text}: the gradients blew up (look at "
                     f"the learning rate, the clipping and the data around the climb)."))
    gname = grad_metric(rank, settings)
    before = finite_series(rank, gname, source.step - settings.explosion_window_steps, source.step - 1) \
        if gname else []
    calm = ""
    if len(before) >= 2:
        calm = (f"; before it the norm was steady (median "
                f"{fmt_number(robust.median([v for _s, v, _t in before]))}, max "
                f"{fmt_number(max(v for _s, v, _t in before))}): no climb, so not an explosion")
    evidence = [nan_source_evidence(rank, source, time_ns, settings)]
    return Finding(
        "gradient", "nan-source", NUMERIC_KEY, rank.rank, source.step, source.time_ns or time_ns,
        seen_ns=time_ns, host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=source.time_ns or time_ns, step=source.step, rank=rank.rank,
                                what=f"rank {rank.rank}: {source.metric} became {source.value} at step "
                                     f"{source.step}; {loss_text}")],
        values={"detail": source.detail, "step": source.step, "value": source.value, "rank": rank.rank},
        relabel=upgrades(run, "gradient", "nan-source"),
        summary=(f"On rank {rank.rank}, {source.description}; {loss_text} (a backward-only singularity "
                 f"such as sqrt(0) or a division by a value that reached 0, or a loop that skips non-finite "
                 f"losses){calm}."))


class Gradients(Detector):
    """The gradient detectors on one metric batch (:func:`on_metrics`): a non-finite gradient waiting for
    its loss, a climbing global norm, per-layer vanishing, clipping that eats the update."""

    name = "gradient"
    kinds: Tuple[str, ...] = ("gradient/explosion", "gradient/nan-source", "gradient/vanishing",
                              "gradient/clip-stale")
    section = "loss_gradient"

    def wants_names(self, names: AbstractSet[str], settings: DetectionSettings) -> Optional[bool]:
        """True for a batch with a point of the family (a grad norm, a loss, a clip threshold, a GradScaler
        overflow flag, a layer's norm); else None: a pending wait ends on any batch (the rank decides)."""
        if not (names.isdisjoint(settings.grad_norm_metrics) and names.isdisjoint(settings.loss_metrics)
                and names.isdisjoint(settings.clip_threshold_metrics) and "amp/overflow" not in names):
            return True
        if any(n.startswith(LAYER_PREFIX) for n in names):
            return True
        return None

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return bool(self.wants_names(names, settings)) or self.wants_rank(rank, names, settings)

    def wants_rank(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        pending = rank.detectors.get(STATE_KEY, {}).get("nonfinite")  # its wait ends on any batch
        return pending is not None and bool(pending.get("waiting"))

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch.points, batch.time_ns, batch.event_id, settings)
