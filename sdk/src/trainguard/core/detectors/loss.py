"""Non-finite loss, and the first correlation rule: was it a gradient explosion?

Rule (DESIGN §4 "Correlation", first version). When a loss metric (``settings.loss_metrics``) of a rank
becomes NaN or +-Inf at step L, look at that rank's gradient-norm history (``settings.grad_norm_metrics``)
over the steps [L - explosion_window_steps, L):

* **non-finite first**: a grad-norm value was NaN/Inf at a step before L; or
* **climb**: with at least ``explosion_min_points`` finite values, the peak is
  >= ``explosion_jump_factor`` x the running median (the median of the earlier half of the values
  before the peak: a gradual climb does not inflate its own baseline).

Either way the incident is ``gradient/explosion`` (root cause: data outlier / LR / clipping), otherwise
``loss/non_finite``. One incident per run (slot ``numeric``) merges all ranks; the rank whose signal came
first leads; ``first_step`` is the first non-finite step of the evidence (the grad norm's when it went
non-finite before the loss). A later rank whose evidence shows an explosion re-classifies a
``loss/non_finite`` incident (same id). Every further non-finite loss value counts as a signal.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..events import wire_float
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from . import fmt_number, window

NUMERIC_KEY = "numeric"


@dataclass
class Explosion:
    """The gradient evidence that turns a non-finite loss into a gradient explosion."""

    metric: str
    detail: str                  # one sentence, for the summary
    short: str = ""              # a few words, for the title
    evidence: List[Evidence] = field(default_factory=list)
    timeline: List[TimelineEntry] = field(default_factory=list)
    nonfinite_step: Optional[int] = None
    earliest_ns: int = 0


def _climb(finite: Sequence[Tuple[int, float, int]], settings: DetectionSettings
           ) -> Optional[Tuple[Tuple[int, float, int], float, Tuple[int, float, int]]]:
    """(peak, baseline median, onset point) when the values jump >= the factor above their baseline."""
    if len(finite) < settings.explosion_min_points:
        return None
    peak = max(finite, key=lambda p: (p[1], -p[0]))
    before = [p for p in finite if p[0] < peak[0]]
    if len(before) < settings.explosion_min_points - 1:
        return None
    earlier_half = before[: max(1, (len(before) + 1) // 2)]
    baseline = statistics.median(v for _s, v, _t in earlier_half)
    if baseline <= 0 or peak[1] < settings.explosion_jump_factor * baseline:
        return None
    onset = next(p for p in finite if p[1] >= settings.explosion_jump_factor * baseline)
    return peak, baseline, onset


def find_explosion(rank: RankState, loss_step: int, time_ns: int, settings: DetectionSettings
                   ) -> Optional[Explosion]:
    """The explosion evidence in ``rank``'s gradient-norm history before ``loss_step``, if any."""
    lo = loss_step - settings.explosion_window_steps
    for name in settings.grad_norm_metrics:
        if name not in rank.history:
            continue
        series = rank.series(name, lo, loss_step - 1)
        nonfinite = next((p for p in series if not math.isfinite(p[1])), None)
        first = rank.first_nonfinite.get(name)
        earlier = nonfinite is None or (first is not None and first[0] < nonfinite[0])
        if first is not None and lo <= first[0] < loss_step and earlier:
            kept = rank.history[name].get(first[0])  # gone only when the history moved past it
            nonfinite = (first[0], kept[0] if kept is not None else math.nan, first[1])
        finite = [p for p in series if math.isfinite(p[1]) and (nonfinite is None or p[0] < nonfinite[0])]
        climb = _climb(finite, settings)
        if climb is None and nonfinite is None:
            continue
        found = Explosion(metric=name, detail="")
        win = window(rank, name, loss_step, settings.evidence_window)
        parts: List[str] = []
        short: List[str] = []
        times: List[int] = []
        if climb is not None:
            peak, baseline, onset = climb
            ratio = peak[1] / baseline
            parts.append(f"{name} rose to {fmt_number(peak[1])} ({ratio:.3g}x its median "
                         f"{fmt_number(baseline)}) by step {peak[0]}")
            short.append(f"{name} {ratio:.3g}x its median by step {peak[0]}")
            found.evidence.append(Evidence(
                rule="gradient.norm_climb",
                description=(f"{name} peaked at {fmt_number(peak[1])} at step {peak[0]}, {ratio:.3g}x its "
                             f"running median {fmt_number(baseline)}; first above "
                             f"{settings.explosion_jump_factor:g}x at step {onset[0]} "
                             f"({fmt_number(onset[1])})"),
                step=onset[0], time_ns=onset[2] or time_ns, rank=rank.rank, metric=name,
                threshold=settings.explosion_jump_factor, value=ratio, window=win))
            found.timeline.append(TimelineEntry(
                time_ns=onset[2] or time_ns, step=onset[0], rank=rank.rank,
                what=(f"rank {rank.rank}: {name} {fmt_number(onset[1])} at step {onset[0]}, "
                      f"{onset[1] / baseline:.3g}x its median")))
            times.append(onset[2])
        if nonfinite is not None:
            step, value, t = nonfinite
            shown = fmt_number(value)
            parts.append(f"{name} became {shown} at step {step}")
            short.append(f"{shown} at step {step}" if short else f"{name} {shown} at step {step}")
            found.nonfinite_step = step
            found.evidence.append(Evidence(
                rule="gradient.non_finite",
                description=f"{name} was {shown} at step {step}, before the loss went non-finite "
                            f"(step {loss_step})",
                step=step, time_ns=t or time_ns, rank=rank.rank, metric=name,
                value=wire_float(value), window=win))
            found.timeline.append(TimelineEntry(
                time_ns=t or time_ns, step=step, rank=rank.rank,
                what=f"rank {rank.rank}: {name} became {shown} at step {step}"))
            times.append(t)
        found.detail = ", then ".join(parts)
        found.short = ", ".join(short)
        found.earliest_ns = min([t for t in times if t > 0] + [time_ns])
        return found
    return None


def on_metrics(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (already folded into its history)."""
    for name, step, value in points:
        if settings.is_loss(name) and not math.isfinite(value):
            return [_loss_finding(run, rank, name, step, value, time_ns, event_id, settings)]
    return []


def _loss_finding(run: RunState, rank: RankState, name: str, step: int, value: float, time_ns: int,
                  event_id: str, settings: DetectionSettings) -> Finding:
    shown = fmt_number(value)
    current = run.incidents.get(NUMERIC_KEY)
    if current is not None and rank.rank in current.rank_first:
        # the same rank again: one more signal, the story is already told
        return Finding(current.record.category, current.record.subtype, NUMERIC_KEY, rank.rank, step, time_ns,
                       host=rank.host, event_id=event_id)
    explosion = find_explosion(rank, step, time_ns, settings)
    evidence = [Evidence(rule="loss.non_finite", description=f"{name} was {shown} at step {step} on rank "
                         f"{rank.rank}", step=step, time_ns=time_ns, rank=rank.rank, metric=name,
                         value=wire_float(value), window=window(rank, name, step, settings.evidence_window),
                         event_id=event_id)]
    timeline = [TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: {name} became {shown} at step {step}")]
    values = {"value": shown, "step": step, "metric": name, "rank": rank.rank, "detail": ""}
    if explosion is None:
        grads = [g for g in settings.grad_norm_metrics if g in rank.history]
        why = (f"{', '.join(grads)} showed no climb (< {settings.explosion_jump_factor:g}x its median) and "
               f"stayed finite before it" if grads else "no gradient-norm metric was reported")
        return Finding("loss", "non_finite", NUMERIC_KEY, rank.rank, step, time_ns, host=rank.host,
                       event_id=event_id, evidence=evidence, timeline=timeline, values=values,
                       summary=f"On rank {rank.rank}, {name} became {shown} at step {step}; {why}.")
    began = step if explosion.nonfinite_step is None else min(step, explosion.nonfinite_step)
    values["detail"] = explosion.short
    return Finding(
        "gradient", "explosion", NUMERIC_KEY, rank.rank, began, explosion.earliest_ns, seen_ns=time_ns,
        seen_step=step, host=rank.host,
        event_id=event_id, evidence=explosion.evidence + evidence, timeline=explosion.timeline + timeline,
        values=values, relabel=True,
        summary=(f"On rank {rank.rank}, {explosion.detail}, and {name} became {shown} at step {step}: the "
                 f"gradients blew up first, so this is a gradient explosion (look for a data outlier, the "
                 f"learning rate or the clipping), not a loss or communication problem."))
