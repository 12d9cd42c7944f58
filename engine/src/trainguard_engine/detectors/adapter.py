"""Adapter detectors: LoRA adapters cut off from the gradient while the loss still moves (DESIGN §4
adapter/lora-grad-break), from the ``lora/*`` metrics of ``trainguard.watch_lora`` (see
:mod:`trainguard.integrations.lora`) and the rank's loss history.

Pure and streaming. Per-rank state lives in ``RankState.detectors["lora"]`` (plain JSON, bounded): the
last report's step and event ids (a replayed report is ignored), the current streak of broken reports
(first step, its event time, how many), the last ``evidence_window`` reports, and what was reported. The
loss is read from the rank's history (the loss metrics of ``DetectionSettings.loss_metrics``), which the
pipeline keeps anyway. Thresholds are read with ``getattr(settings, name, DEFAULT)``; defaults below.

A report is **broken** when

* ``max(lora/grad_mean_A, lora/grad_mean_B) < lora_grad_min`` (1e-6, DESIGN §4): both halves of the
  adapters get (almost) no gradient. Both, because LoRA initialises B to 0, so A's gradient is exactly 0
  until B has moved -- and a LoRA whose A stays fixed still learns through B; or
* ``lora/no_grad_params`` > 0: some adapter parameters get no gradient at all (``.grad`` None, or exactly
  0): cut off from the graph, not attached to a module the forward uses, or ``requires_grad`` off.

It **fires** when ``lora_confirm_reports`` (5) reports in a row are broken (one report is not a trend: the
very first step of a healthy LoRA has A's gradient at exactly 0) **and the loss still moves** over the
steps since the streak began: the last ``lora_loss_window`` (32) finite loss values from the streak's first
step on, at least ``lora_loss_min_points`` (8) of them, show a Mann-Kendall trend with |z| >=
``trend_z`` (the shared trend threshold, 2.33: one-sided p ~ 0.01). Scale-free and outlier-proof, so no
per-model loss number: a loss that keeps falling (a trainable head learning) or rising while the adapters
are frozen out is what this kind is about -- and so is a loss still flat after a full ``lora_loss_window``
of values when *every* report of the streak says no adapter learns at all (all adapter parameters
without gradient, or both means ~0): in a LoRA fine-tune
with a frozen base nothing else trains, so that flat loss is the adapters' doing (the loss curve's
plateau defers to this incident). The check is repeated at each report and at each loss value while a
confirmed streak waits for the loss to show movement.

``first_step`` = the first broken report of the streak (where it began). Evidence: the gradient means (rule
``adapter.lora_grad_break.grad_mean``, threshold ``lora_grad_min``), the parameters without gradient
(``adapter.lora_grad_break.no_grad``, threshold 0), and the loss movement
(``adapter.lora_grad_break.loss_moves``, threshold ``trend_z``, value z, the loss window). Title placeholder
``{step}``. Not resolved when the adapters learn again (a later healthy streak only clears the streak).
"""

from __future__ import annotations

import math
import statistics
from typing import AbstractSet, Any, Dict, Final, List, Optional, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..robust import mann_kendall
from ..state import RankState, RunState
from . import finite_or_none, fmt_number
from .base import Detector, MetricBatch

STATE_KEY: Final = "lora"
"""``RankState.detectors`` key of this family's per-rank state."""
KEY = "adapter:lora-grad-break"

GRAD_MEAN_A = "lora/grad_mean_A"
GRAD_MEAN_B = "lora/grad_mean_B"
NO_GRAD = "lora/no_grad_params"
PARAMS = "lora/params"

# --- defaults (overridable by DetectionSettings fields of the same names) -------------------------
LORA_GRAD_MIN = 1e-6
"""Both adapter gradient means below this: the adapters get no gradient (DESIGN §4)."""
LORA_CONFIRM_REPORTS = 5
"""Consecutive broken watch_lora reports before the incident can open."""
LORA_LOSS_WINDOW = 32
"""Most loss values (from the streak's first step on) in the movement test."""
LORA_LOSS_MIN_POINTS = 8
"""Fewest loss values since the streak began for the movement test."""
TREND_Z = 2.33
"""Fallback of the shared ``trend_z`` setting (Mann-Kendall |z|)."""
MAX_IDS = 8
"""Event ids of the last step remembered to recognise a replayed report."""


def _cfg(settings: DetectionSettings, name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def rank_state(rank: RankState) -> Dict[str, Any]:
    """The family's state of ``rank``: ``last`` [step, [ids]], ``streak`` [first, first_ns, count],
    ``reports`` [[step, mean_A, mean_B, no_grad, params]], ``reported`` [first step, ...]."""
    state: Dict[str, Any] = rank.detectors.setdefault(STATE_KEY, {})
    return state


def on_metrics(run: RunState, rank: RankState, points: Sequence[Any], step: int, time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (``points``: (name, step, value) tuples)."""
    reports: Dict[int, Dict[str, float]] = {}
    loss_seen = False
    for name, s, value in points:
        if name in (GRAD_MEAN_A, GRAD_MEAN_B, NO_GRAD, PARAMS):
            reports.setdefault(int(s), {})[name] = float(value)
        elif not loss_seen and settings.is_loss(name):
            loss_seen = True
    if not reports:
        state = rank.detectors.get(STATE_KEY)
        if loss_seen and state and _pending(state, settings):
            return _maybe_fire(rank, state, time_ns, event_id, settings)
        return []
    state = rank_state(rank)
    out: List[Finding] = []
    for s in sorted(reports):
        if not _fresh(state, s, event_id):
            continue
        values = reports[s]
        out.extend(_report(rank, state, s, values, time_ns, event_id, settings))
    return out


def _fresh(state: Dict[str, Any], s: int, event_id: str) -> bool:
    """Record (step, event id); False for a replayed or late report."""
    last = state.get("last")
    if last is not None:
        if s < last[0] or (s == last[0] and event_id and event_id in last[1]):
            return False
        if s == last[0]:
            last[1] = [*last[1], event_id][-MAX_IDS:]
            return True
    state["last"] = [s, [event_id]]
    return True


def _report(rank: RankState, state: Dict[str, Any], s: int, values: Dict[str, float], time_ns: int,
            event_id: str, settings: DetectionSettings) -> List[Finding]:
    mean_a, mean_b = finite_or_none(values.get(GRAD_MEAN_A)), finite_or_none(values.get(GRAD_MEAN_B))
    no_grad, params = finite_or_none(values.get(NO_GRAD)), finite_or_none(values.get(PARAMS))
    reports: List[List[Any]] = state.setdefault("reports", [])
    reports.append([s, mean_a, mean_b, no_grad, params])
    del reports[:-max(1, int(_cfg(settings, "evidence_window", 20)))]
    limit = float(_cfg(settings, "lora_grad_min", LORA_GRAD_MIN))
    means = [m for m in (mean_a, mean_b) if m is not None]
    vanished = bool(means) and max(means) < limit
    missing = no_grad is not None and no_grad > 0
    if not (vanished or missing):
        state.pop("streak", None)
        return []
    streak = state.get("streak")
    if streak is None:
        state["streak"] = [s, time_ns, 1]
    else:
        streak[2] = int(streak[2]) + 1
    return _maybe_fire(rank, state, time_ns, event_id, settings)


def _pending(state: Dict[str, Any], settings: DetectionSettings) -> bool:
    """A confirmed streak not reported yet (waiting for the loss to show movement)."""
    streak = state.get("streak")
    return (streak is not None and int(streak[2]) >= int(_cfg(settings, "lora_confirm_reports",
                                                              LORA_CONFIRM_REPORTS))
            and not _reported_streak(state, streak))


def _reported_streak(state: Dict[str, Any], streak: List[Any]) -> bool:
    reported = state.get("reported")
    return reported is not None and int(reported[0]) == int(streak[0])


def loss_window(rank: RankState, first: int, settings: DetectionSettings
                ) -> Tuple[str, List[Tuple[int, float]]]:
    """(loss metric name, [(step, value)]) of the last ``lora_loss_window`` finite loss values at steps >=
    ``first`` (the first loss metric of ``settings.loss_metrics`` the rank has)."""
    most = int(_cfg(settings, "lora_loss_window", LORA_LOSS_WINDOW))
    for name in settings.loss_metrics:
        if name in rank.history:
            points = [(s, v) for s, v, _t in rank.series(name, first, 2**62) if math.isfinite(v)]
            return name, points[-most:]
    return "", []


def _maybe_fire(rank: RankState, state: Dict[str, Any], time_ns: int, event_id: str,
                settings: DetectionSettings) -> List[Finding]:
    if not _pending(state, settings):
        return []
    streak = state["streak"]
    first, first_ns, count = int(streak[0]), int(streak[1]), int(streak[2])
    name, points = loss_window(rank, first, settings)
    if len(points) < int(_cfg(settings, "lora_loss_min_points", LORA_LOSS_MIN_POINTS)):
        return []
    trend = mann_kendall([v for _s, v in points])
    z_needed = float(_cfg(settings, "trend_z", TREND_Z))
    if abs(trend.z) < z_needed and not (
            len(points) >= int(_cfg(settings, "lora_loss_window", LORA_LOSS_WINDOW))
            and _all_dead(state, first, settings)):
        return []  # no movement yet; a flat loss with every adapter dead counts after a full window
    reported_before = state.get("reported") is not None
    state["reported"] = [first, count]
    return [_finding(rank, state, first, first_ns or time_ns, count, name, points, trend.z, z_needed,
                     time_ns, event_id, settings, update=reported_before)]


def _all_dead(state: Dict[str, Any], first: int, settings: DetectionSettings) -> bool:
    """Whether every report of the streak says that *no* adapter parameter learns (all of them without
    gradient, or both gradient means ~0): then a flat loss is the adapters' doing, not a plateau to
    explain -- nothing else trains in a LoRA fine-tune with a frozen base."""
    limit = float(_cfg(settings, "lora_grad_min", LORA_GRAD_MIN))
    for _s, mean_a, mean_b, no_grad, params in (r for r in state.get("reports", []) if r[0] >= first):
        means = [m for m in (mean_a, mean_b) if m is not None]
        every = no_grad is not None and params is not None and params > 0 and no_grad >= params
        if not (every or (bool(means) and max(means) < limit)):
            return False
    return True


def _finding(rank: RankState, state: Dict[str, Any], first: int, first_ns: int, count: int, loss_name: str,
             points: List[Tuple[int, float]], z: float, z_needed: float, time_ns: int, event_id: str,
             settings: DetectionSettings, update: bool) -> Finding:
    limit = float(_cfg(settings, "lora_grad_min", LORA_GRAD_MIN))
    reports = [r for r in state["reports"] if r[0] >= first]
    last = reports[-1] if reports else state["reports"][-1]
    step = int(last[0])
    mean_a, mean_b, no_grad, params = last[1], last[2], last[3], last[4]
    means = [m for m in (mean_a, mean_b) if m is not None]
    top = max(means) if means else math.nan
    evidence: List[Evidence] = []
    grad_window = [{"step": r[0], "value": max([m for m in (r[1], r[2]) if m is not None], default=0.0)}
                   for r in state["reports"]]
    if means and top < limit:
        evidence.append(Evidence(
            rule="adapter.lora_grad_break.grad_mean",
            description=(f"mean |grad| of the LoRA A matrices {fmt_number(mean_a or 0.0)}, of the B matrices "
                         f"{fmt_number(mean_b or 0.0)}: both < {limit:g} on {count} consecutive watch_lora "
                         f"reports since step {first}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric=f"{GRAD_MEAN_A}|{GRAD_MEAN_B}",
            threshold=limit, value=float(top), window=grad_window, event_id=event_id))
    if no_grad is not None and no_grad > 0:
        total = f" of {int(params)}" if params else ""
        evidence.append(Evidence(
            rule="adapter.lora_grad_break.no_grad",
            description=(f"{int(no_grad)}{total} adapter parameters get no gradient at all (.grad None or "
                         f"exactly 0) on {count} consecutive reports since step {first}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric=NO_GRAD, threshold=0.0,
            value=float(no_grad), window=[{"step": r[0], "value": r[3]} for r in state["reports"]
                                          if r[3] is not None],
            event_id=event_id))
    values = [v for _s, v in points]
    k = max(1, min(4, len(values) // 4))
    start, end = statistics.median(values[:k]), statistics.median(values[-k:])
    flat = abs(z) < z_needed
    direction = "flat" if flat else "falling" if z < 0 else "rising"
    moves = (f"the loss does not move either: {loss_name} is flat over the {len(values)} values since step "
             f"{points[0][0]} (Mann-Kendall z = {z:.2f}, |z| < {z_needed:g}), {fmt_number(start)} -> "
             f"{fmt_number(end)}: no adapter learns and nothing else trains, so the flat loss is the "
             "adapters' doing, not a plateau" if flat else
             f"the loss still moves: {loss_name} is {direction} over the {len(values)} values since "
             f"step {points[0][0]} (Mann-Kendall z = {z:.2f}, |z| >= {z_needed:g}), from "
             f"{fmt_number(start)} to {fmt_number(end)} (medians of the first and last {k}): "
             "something else is learning while the adapters are not")
    evidence.append(Evidence(
        rule="adapter.lora_grad_break.loss_moves",
        description=moves,
        step=points[0][0], time_ns=first_ns, rank=rank.rank, metric=loss_name, threshold=z_needed,
        value=round(z, 4), window=[{"step": s, "value": v} for s, v in
                                   points[-int(_cfg(settings, "evidence_window", 20)):]],
        event_id=event_id))
    if no_grad is not None and no_grad > 0 and params and no_grad < params:
        detail = f"{int(no_grad)} of {int(params)} adapter parameters get no gradient"
    elif no_grad is not None and no_grad > 0:
        detail = f"none of the {int(no_grad)} adapter parameters gets a gradient"
    else:
        detail = f"adapter gradients ~0 (mean |grad| {fmt_number(top)} < {limit:g})"
    return Finding(
        "adapter", "lora-grad-break", KEY, rank.rank, first, first_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: {detail} since step {first}, loss {direction}")],
        values={"step": first, "detail": detail, "rank": rank.rank},
        counts=not update, replace_evidence=update, update_values=update,
        summary=(f"On rank {rank.rank}, the LoRA adapters stopped receiving gradients at step {first} "
                 f"({detail}) " + (
                     f"and the loss is flat ({fmt_number(start)} -> {fmt_number(end)}): nothing learns. "
                     "Typical causes: lora_alpha 0 (a scale of 0), A and B both initialised to 0, "
                     "lora_dropout 1.0, or " if flat else
                     f"while the loss keeps {direction} ({fmt_number(start)} -> {fmt_number(end)}): "
                     "other parameters (a head, modules_to_save) learn, the adapters do not. Typical "
                     "causes: ") +
                 "reentrant gradient checkpointing over frozen embeddings without "
                 "model.enable_input_require_grads() (or use_reentrant=False), adapters on modules the "
                 "forward does not use, requires_grad off, or the base model run under no_grad."))


class Adapters(Detector):
    """``watch_lora()`` reports: adapters that stopped getting gradients (:func:`on_metrics`)."""

    name = "adapter"
    kinds: Tuple[str, ...] = ("adapter/lora-grad-break",)
    section = "adapter"

    def wants_names(self, names: AbstractSet[str], settings: DetectionSettings) -> Optional[bool]:
        """True for a batch with an adapter report, False for one without a loss point either; else None
        (a loss point matters only to a rank that reported adapters: a pending break waits for the loss)."""
        if not names.isdisjoint((GRAD_MEAN_A, GRAD_MEAN_B, NO_GRAD, PARAMS)):
            return True
        return None if not names.isdisjoint(settings.loss_metrics) else False

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        decided = self.wants_names(names, settings)
        return decided if decided is not None else self.wants_rank(rank, names, settings)

    def wants_rank(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return STATE_KEY in rank.detectors  # a pending break waits for the loss

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch.points, batch.step, batch.time_ns, batch.event_id, settings)
