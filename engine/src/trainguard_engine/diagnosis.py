"""The incident record's diagnosis (seed 000 §3.6): duration, related metrics, trigger conditions and
ranked root-cause hypotheses with a confidence. Pure; recomputed from the run's state whenever an incident
changes (``Pipeline`` calls :func:`enrich` each time a finding is applied to the incident or correlation
changes it: event-driven, never at output time, so the record does not depend on how events are batched
and survives snapshot/restore unchanged). "Peak" and "last" values are therefore as of the incident's
latest signal.

* ``duration_s`` -- last_ns - first_ns.
* ``related`` -- from the lead rank's history around the incident's ``first_step``: ``loss``
  (``at_first_step``, ``min``, ``last``), ``grad_norm`` (``at_first_step``, ``median_before``, ``max``),
  ``lr``, ``clip_rate`` (share of the last steps clipped, when the SDK reports ``grad/clip_triggered``),
  ``amp_scale`` (last GradScaler scale), ``peak_memory_bytes`` (the highest ``mem/max_allocated`` /
  ``mem/allocated`` / ``mem/reserved`` / ``mem/rss`` seen on the rank, by name) and ``step_time_s``.
  Keys without data are left out; non-finite values use the JSON mapping's spelling (``"NaN"``).
  Values at ``first_step`` are kept as first computed when the history (the last ``history_len``
  steps) no longer holds that step.
* ``trigger`` -- ``step``, the LR phase at that step (``rising``: warmup or a schedule bug; ``constant``;
  ``decaying``; ``zero``) with ``lr_growth`` (LR at the step / the earliest LR kept; ``"Infinity"`` when
  the ratio overflows a double, e.g. an LR of 5e-324 that became 1.0), and ``batch``: the batch features
  the SDK reported at that step (``seq/*``, ``batch/*`` metrics, e.g. the truncation check's fractions).
* ``hypotheses`` -- the kind's likely causes (catalogue order is the prior: the first is the most common
  in the seeds' experience), re-weighted by what this incident's data says (:data:`RULES`: e.g. an LR that
  grew 30x before an explosion makes "learning rate too high / schedule bug" the lead; an OOM whose
  reserved-but-unallocated memory exceeds the request makes fragmentation the lead; a rank that went
  silent makes "node failure or preemption" the lead of a rank-lost incident), normalised to confidences
  summing to 1, each with the reasons ("why"). These are heuristics over the evidence, stated as such;
  the incident library (similar past incidents with confirmed causes) refines them later.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, Dict, Final, List, Mapping, Optional, Sequence, Tuple

from trainguard.core.events import wire_float

from . import robust
from .catalogue import DetectionSettings, IncidentKind, kind
from .detectors.numeric import loss_start
from .state import IncidentState, RankState, RunState, SeriesTail, bounded_append

STATE_KEY: Final = "diag"
"""``RankState.detectors`` key: ``{"peak": {metric: bytes}, "lr": [[step, lr], ...]}``."""
MEMORY_METRICS: Final = ("mem/max_allocated", "mem/allocated", "mem/reserved", "mem/rss")
LR_METRICS: Final = ("opt/lr", "lr")
BATCH_PREFIXES = ("seq/", "batch/")
LR_LOG_CHANGE: Final = 0.05
"""The LR change log records a value that moved by more than this fraction since the last record."""
LR_LOG_MAX = 64
LR_RECENT_STEPS = 16
"""An LR record within this many steps of the incident's step means the LR was moving there."""


# ----------------------------------------------------------------------------------------------------
# streaming input: peak memory per rank


def observe_start(rank: RankState, body: Mapping[str, Any]) -> None:
    """Keep what a START says about the rank's runtime (the torch build: ``+cpu`` means no CUDA)."""
    torch_version = body.get("torch")
    if isinstance(torch_version, str) and torch_version:
        rank.detectors.setdefault(STATE_KEY, {})["torch"] = torch_version[:64]


def observe(rank: RankState, points: Sequence[Tuple[str, int, float]],
            positions: Optional[Sequence[int]] = None) -> None:
    """Keep the peak of the memory metrics in ``points`` (one metric batch of ``rank``) and the LR's
    change points (the history drops old steps; an incident's onset can be older). ``positions``: the
    indices of the points to read (None: all of them) -- the pipeline knows per list of names which
    ones are memory or LR metrics."""
    peak: Optional[Dict[str, float]] = None
    for i in range(len(points)) if positions is None else positions:
        name, step, value = points[i]
        if value - value != 0.0:
            continue
        if name.startswith("mem/") and name in MEMORY_METRICS:
            if peak is None:
                peak = rank.detectors.setdefault(STATE_KEY, {}).setdefault("peak", {})
            if value > peak.get(name, -1.0):
                peak[name] = float(value)
        elif name in LR_METRICS:
            held = rank.detectors.get(STATE_KEY)
            log = held.get("lr") if held is not None else None
            if log:  # _log_lr's two "nothing to record" tests first, inline (most LR points record nothing)
                last_step, last = log[-1]
                if step <= last_step or (abs(value - last) <= LR_LOG_CHANGE * abs(last) and
                                         (last == 0.0) == (value == 0.0)):
                    continue
            _log_lr(rank, step, value)


def _log_lr(rank: RankState, step: int, value: float) -> None:
    """Record (step, lr) when the LR moved by more than LR_LOG_CHANGE since the last record (bounded:
    LR_LOG_MAX entries, the middle goes first)."""
    held = rank.detectors.get(STATE_KEY)  # (get, then set: no empty dict and list built per call)
    if held is None:
        held = rank.detectors[STATE_KEY] = {}
    log: Optional[List[List[float]]] = held.get("lr")
    if log is None:
        log = held["lr"] = []
    if log:
        last_step, last = log[-1]
        if step <= last_step:
            return
        if abs(value - last) <= LR_LOG_CHANGE * abs(last) and not (last == 0.0) != (value == 0.0):
            return
    bounded_append(log, [step, float(value)], LR_LOG_MAX)


def lr_phase(rank: RankState, step: int) -> Dict[str, Any]:
    """``{"lr", "lr_phase", "lr_growth"}`` at ``step`` from the LR change log (empty when unknown).
    The phase is ``rising`` / ``decaying`` when the LR moved within LR_RECENT_STEPS before the step,
    ``zero`` for an LR of 0, else ``constant``; growth is the LR at the step / the first LR seen."""
    held = rank.detectors.get(STATE_KEY)
    log = (held.get("lr") if held is not None else None) or _NONE
    i = len(log) - 1  # the last record at or before the step (the log need not be by step: looked up so)
    while i >= 0 and not log[i][0] <= step:
        i -= 1
    if i < 0:
        return {}
    s_i, lr = log[i]
    out: Dict[str, Any] = {"lr": _number(lr)}
    if lr == 0:
        out["lr_phase"] = "zero"
    elif i > 0 and step - s_i <= LR_RECENT_STEPS:
        out["lr_phase"] = "rising" if lr > log[i - 1][1] else "decaying"
    elif i + 1 < len(log) and log[i + 1][0] - step <= LR_RECENT_STEPS:
        out["lr_phase"] = "rising" if log[i + 1][1] > lr else "decaying"
    else:
        out["lr_phase"] = "constant"
    if log[0][1] > 0:  # LR 5e-324 -> 1.0 overflows the ratio: +Infinity in the JSON mapping's spelling
        out["lr_growth"] = wire_float(round(lr / log[0][1], 4))
    return out


def observe_memory(rank: RankState, body: Mapping[str, Any]) -> None:
    """Keep the peaks of a ``memory`` event (allocated / max_allocated / reserved / rss). Zero is "not
    reported" (a protobuf default), not a peak."""
    points = []
    for field_name, metric in (("max_allocated", "mem/max_allocated"), ("allocated", "mem/allocated"),
                               ("reserved", "mem/reserved"), ("rss", "mem/rss")):
        value = body.get(field_name)
        if isinstance(value, str) and value.isdigit():  # int64 in the JSON mapping
            value = int(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            points.append((metric, 0, float(value)))
    observe(rank, points)


# ----------------------------------------------------------------------------------------------------
# facts


@dataclass
class Facts:
    """What the rules look at, computed once per enrichment."""

    related: Dict[str, Any] = field(default_factory=dict)
    trigger: Dict[str, Any] = field(default_factory=dict)
    lr_phase: str = ""
    lr_growth: float = 0.0
    clip_rate: Optional[float] = None
    has_amp: bool = False
    grad_jump: float = 0.0          # grad norm at the first step / median before (0: unknown)
    rules: Tuple[str, ...] = ()     # evidence rules present
    facts: Dict[str, Any] = field(default_factory=dict)  # the classifier's parsed facts, merged
    world_size: int = 1
    silent_rank: bool = False
    cuda: Optional[bool] = None     # CUDA in use on the lead rank: True, False (known CPU-only), None
    lr: Optional[float] = None      # the LR at the incident's step (None: not reported)
    lr_high: float = 0.1            # DetectionSettings.diagnosis_lr_high
    diverged_at: Optional[int] = None  # first step of an earlier divergence / explosion of the run
    loss_rise: float = 0.0          # the highest finite loss kept / where the loss started (0: unknown)
    clip_stale_loss_rise: float = 2.0  # DetectionSettings.diagnosis_clip_stale_loss_rise


Triple = Tuple[int, float, int]
_VALUE: Final = itemgetter(1)


def _series(rank: RankState, names: Sequence[str], upto: int) -> Tuple[Sequence[Triple], bool]:
    """:func:`_series_tail` without the tail."""
    points, finite, _tail = _series_tail(rank, names, upto)
    return points, finite


def _series_tail(rank: RankState, names: Sequence[str], upto: int
                 ) -> Tuple[Sequence[Triple], bool, Optional[SeriesTail]]:
    """``(step, value, time_ns)`` of the first of ``names`` the rank has a history of, at steps <= ``upto``,
    by step (empty: none), and whether they are known to be all finite. Read from the series'
    :class:`~trainguard_engine.state.SeriesTail` (made when missing; kept by ``observe_point`` from then
    on) when its steps only rose -- then its points are the history's items in step order, a slice, no
    sort and no tuple built; else sorted from the history dict. Read only (a tail is the rank's). The
    third value: that tail when the points are its whole list (``points is tail.points``), else None."""
    for name in names:
        data = rank.history.get(name)
        if data:
            tail = rank.tails.get(name)
            if tail is None or tail.data is not data or len(tail.points) != len(data):
                tail = rank.tails[name] = SeriesTail(data)
            whole: Optional[SeriesTail] = tail
            if tail.descent == 0:
                points: Sequence[Triple] = tail.points
                finite = tail.bad_end == 0
            else:  # a late point: by step
                points = [(s, *data[s]) for s in sorted(data)]
                finite = False
                whole = None
            if points[-1][0] > upto:
                points = points[:bisect_left(points, (upto + 1,))]
                whole = None
            return points, finite, whole
    return (), True, None


def _finite_values(values: Sequence[Triple], finite: bool) -> List[float]:
    """The finite values of ``values``, in order (``finite``: all are)."""
    if finite:
        return list(map(_VALUE, values))
    return [v for _s, v, _t in values if v - v == 0.0]


def _least(values: Sequence[Triple], finite: bool) -> Optional[float]:
    """``min`` of :func:`_finite_values` (None when there is none), without building the list: the same
    values in the same order, so the same one (the first of equals)."""
    if finite:
        return min(map(_VALUE, values)) if values else None
    return min((v for _s, v, _t in values if v - v == 0.0), default=None)


def _most(values: Sequence[Triple], finite: bool) -> Optional[float]:
    """``max`` of :func:`_finite_values` (None when there is none), as :func:`_least`."""
    if finite:
        return max(map(_VALUE, values)) if values else None
    return max((v for _s, v, _t in values if v - v == 0.0), default=None)


EXTREMES_KEY = "diagnosis.extremes"
"""The key of :func:`_extremes`' kept [points looked at, min, max] in a series tail's ``windows``."""


def _extremes(values: Sequence[Triple], finite: bool, tail: Optional[SeriesTail]
              ) -> Tuple[Optional[float], Optional[float]]:
    """``(_least(values, finite), _most(values, finite))``, the same floats: when ``values`` is the whole
    point list of ``tail`` (:func:`_series_tail`) and all finite, from the lowest and highest value kept
    beside the tail (``windows[EXTREMES_KEY]``: derived, dropped with the tail -- its points only grow while
    it lasts) and updated with the points that arrived since, one comparison each; else as they are. A
    later value equal to the kept one does not replace it (``<`` / ``>``), so the kept one is the first of
    its equals, as min() and max() answer (0.0 and -0.0 included)."""
    if tail is None or not finite or values is not tail.points or not values:
        return _least(values, finite), _most(values, finite)
    n = len(values)
    kept: Optional[List[Any]] = tail.windows.get(EXTREMES_KEY)
    if kept is None:
        kept = tail.windows[EXTREMES_KEY] = [n, min(map(_VALUE, values)), max(map(_VALUE, values))]
    elif kept[0] < n:
        low, high = kept[1], kept[2]
        for i in range(kept[0], n):
            v = values[i][1]
            if v < low:
                low = v
            elif v > high:
                high = v
        kept[0], kept[1], kept[2] = n, low, high
    return kept[1], kept[2]


def _at(values: Sequence[Triple], step: int) -> Optional[float]:
    """The value at ``step`` or the nearest before it (``values`` by step)."""
    i = bisect_left(values, (step + 1,))
    return values[i - 1][1] if i else None


def _times(factor: float) -> str:
    """``"12.5x"``; an overflowed ratio (an LR that grew from ~0) as ``"from ~0 (an unbounded factor)"``."""
    return f"{factor:.3g}x" if math.isfinite(factor) else "from ~0 (an unbounded factor)"


def _number(value: float) -> Any:
    """7 significant digits, or the JSON mapping's spelling of a non-finite value. A finite non-zero float's
    answer is remembered (:data:`_NUMBERS`); others are rendered each time."""
    if type(value) is float and value - value == 0.0 and value:
        out = _NUMBERS.get(value)
        if out is None:
            if len(_NUMBERS) >= NUMBERS_MAX:
                _NUMBERS.clear()
            out = _NUMBERS[value] = _render(value)
        return out
    return _render(value)


def _render(value: float) -> Any:
    out = wire_float(value)
    return float(f"{out:.7g}") if isinstance(out, float) else out


_NUMBERS: Dict[float, float] = {}
"""A finite non-zero float -> its :func:`_number` (a float: equal such floats are the same value -- no signed
zero, no NaN -- so the answer is a function of the key). Derived, bounded by NUMBERS_MAX (then started
afresh): an incident is enriched on every finding applied to it, mostly with the same values."""
NUMBERS_MAX = 4096
_NONE: Tuple[Any, ...] = ()


def _facts(run: RunState, rank: Optional[RankState], st: IncidentState, settings: DetectionSettings) -> Facts:
    inc = st.record
    facts = Facts(world_size=run.world_size, lr_high=settings.diagnosis_lr_high,
                  clip_stale_loss_rise=settings.diagnosis_clip_stale_loss_rise)
    facts.rules = tuple(ev.rule for ev in inc.evidence)
    facts.silent_rank = "correlation.silent_peer" in facts.rules
    for ev in inc.evidence:
        if isinstance(ev.value, dict) and isinstance(ev.value.get("facts"), dict):
            for k, v in ev.value["facts"].items():
                facts.facts.setdefault(k, v)
    facts.diverged_at = _diverged_at(run, st)
    if rank is None:
        return facts
    facts.cuda = cuda_in_use(rank)
    last = rank.max_step
    step = inc.first_step if inc.first_step >= 0 else last
    related, trigger = facts.related, facts.trigger
    trigger["step"] = step
    loss, finite, tail = _series_tail(rank, settings.loss_metrics, max(last, step))
    if loss:
        item: Dict[str, Any] = {}
        at = _at(loss, step)
        if at is not None:
            item["at_first_step"] = _number(at)
        low, high = _extremes(loss, finite, tail)
        if low is not None:
            item["min"] = _number(low)
        item["last"] = _number(loss[-1][1])
        related["loss"] = item
        start = loss_start(rank)
        if start is not None and high is not None:
            facts.loss_rise = high / start
    grads, finite, tail = _series_tail(rank, settings.grad_norm_metrics, max(last, step))
    if grads:
        item = {}
        at = _at(grads, step)
        below = bisect_left(grads, (step,))  # grads[:below]: the steps before the incident's
        if finite:
            before = list(map(_VALUE, grads[max(0, below - 32):below]))
        else:
            before = _finite_values(grads[:below], False)[-32:]
        if at is not None:
            item["at_first_step"] = _number(at)
        if before:
            median = robust.median(before)
            item["median_before"] = _number(median)
            if at is not None and median > 0 and at - at == 0.0:
                facts.grad_jump = at / median
        high = _extremes(grads, finite, tail)[1]
        if high is not None:
            item["max"] = _number(high)
        related["grad_norm"] = item
    phase = lr_phase(rank, step)
    if phase:
        related["lr"] = phase["lr"]
        trigger.update(phase)
    clips, finite = _series(rank, ("grad/clip_triggered",), step)
    if clips:
        window = list(map(_VALUE, clips[-32:])) if finite else _finite_values(clips, False)[-32:]
        if window:
            facts.clip_rate = sum(1 for v in window if v > 0) / len(window)
            related["clip_rate"] = round(facts.clip_rate, 4)
    scale, _all_finite = _series(rank, ("amp/scale",), max(last, step))
    if scale:
        facts.has_amp = True
        related["amp_scale"] = _number(scale[-1][1])
    peak = rank.detectors.get(STATE_KEY, {}).get("peak")
    if peak:
        related["peak_memory_bytes"] = {k: int(v) for k, v in sorted(peak.items())}
    step_time = run.step_time()
    if step_time > 0:
        related["step_time_s"] = round(step_time, 6)
    batch = {}
    for name, data in rank.history.items():
        if name.startswith(BATCH_PREFIXES):
            value = data.get(step)
            if value is None:
                earlier = [s for s in data if s <= step]
                value = data[max(earlier)] if earlier else None
            if value is not None:
                batch[name] = _number(value[0])
    if batch:
        trigger["batch"] = dict(sorted(batch.items()))
    return facts


DIVERGED_KINDS = frozenset({"loss/divergence", "gradient/explosion", "loss/non_finite"})
"""Kinds that say the run's updates were too large for it: an LR too high (or a schedule taking it there)."""


def _diverged_at(run: RunState, st: IncidentState) -> Optional[int]:
    """The first step of another incident of ``run`` (open or resolved) of :data:`DIVERGED_KINDS` that
    began no later than ``st``'s latest signal, or None. Every step clipping after the loss diverged is
    the divergence's doing (updates too large for the model), not a threshold too low."""
    inc = st.record
    first: Optional[int] = None
    for other in run.incidents.values():
        rec = other.record
        if other is st or f"{rec.category}/{rec.subtype}" not in DIVERGED_KINDS or rec.first_ns > inc.last_ns:
            continue
        if first is None or rec.first_step < first:
            first = rec.first_step
    return first


# ----------------------------------------------------------------------------------------------------
# hypotheses

# A rule: (kind name, the id of the cause it weighs -- one of the kind's causes or extra causes in the
# catalogue's data --, predicate over the facts, weight factor, reason template).
Rule = Tuple[str, str, Callable[[Facts], bool], float, Callable[[Facts], str]]


def _lr_grew(f: Facts) -> bool:
    return f.lr_growth >= 2.0 or f.lr_phase == "rising"


def _lr_why(f: Facts) -> str:
    if f.lr_growth >= 2.0:
        return f"the LR grew {_times(f.lr_growth)} over the kept history before this step"
    return "the LR was still rising at this step"


def _lr_high(f: Facts) -> bool:
    """A high LR held at its level: no warmup, no schedule bug -- its value is what to look at."""
    return f.lr is not None and f.lr >= f.lr_high and f.lr_phase in ("constant", "decaying")


def _lr_high_why(f: Facts) -> str:
    return f"the LR was {f.lr:.3g} and {f.lr_phase} at this step: high for any optimizer but plain SGD"


def _loss_rose(f: Facts) -> bool:
    """The loss went up to ``clip_stale_loss_rise`` x its start (and no earlier divergence says so
    already: that rule gives the same cause its weight)."""
    return f.diverged_at is None and 0 < f.clip_stale_loss_rise <= f.loss_rise


def _oom_frag(f: Facts) -> bool:
    ru, req = f.facts.get("reserved_unallocated"), f.facts.get("requested")
    return isinstance(ru, int) and isinstance(req, int) and ru >= req > 0


def _big_request(f: Facts) -> bool:
    req, cap, free = f.facts.get("requested"), f.facts.get("capacity"), f.facts.get("free")
    unalloc = f.facts.get("reserved_unallocated", 0)
    if not isinstance(req, int) or req <= 0:
        return False
    if isinstance(cap, int) and req > cap / 4:
        return True
    return isinstance(free, int) and isinstance(unalloc, int) and req > free + unalloc


def _oom_other(f: Facts) -> bool:
    other = f.facts.get("other_processes")
    return isinstance(other, (int, list)) and bool(other)


RULES: Tuple[Rule, ...] = (
    ("gradient/explosion", "learning-rate-too-high", _lr_grew, 4.0, _lr_why),
    ("gradient/explosion", "outlier-sample-z-score", lambda f: f.grad_jump >= 50.0, 3.0,
     lambda f: f"the gradient norm jumped {f.grad_jump:.3g}x its median at once (no gradual climb)"),
    ("gradient/explosion", "gradient-clipping-too-loose", lambda f: f.clip_rate is None, 1.5,
     lambda f: "no clipping reported (grad/clip_triggered absent)"),
    ("gradient/explosion", "gradient-clipping-too-loose",
     lambda f: f.clip_rate is not None and f.clip_rate > 0.3, 2.0,
     lambda f: f"clipping triggered on {f.clip_rate or 0:.0%} of the steps before: it did not hold"),
    ("gradient/explosion", "learning-rate-too-high", _lr_high, 4.0, _lr_high_why),
    ("loss/non_finite", "learning-rate-too-high", _lr_grew, 3.0, _lr_why),
    ("loss/non_finite", "learning-rate-too-high", _lr_high, 3.0, _lr_high_why),
    ("loss/non_finite", "numerical-instability-log-0", lambda f: f.has_amp, 2.0,
     lambda f: "mixed precision is on"),
    ("gradient/nan-source", "bad-sample", lambda f: f.grad_jump == 0.0 or f.grad_jump < 10.0, 1.2,
     lambda f: "no gradient climb before the first non-finite value: one batch, not a trend"),
    ("loss/rise-after-fall", "warmup-peak-learning-rate", lambda f: f.lr_phase == "rising", 2.0,
     lambda f: "the LR was still rising when the loss turned"),
    ("loss/rise-after-fall", "schedule-bug-lr-increasing", lambda f: f.lr_growth >= 10.0, 3.0,
     lambda f: f"the LR grew {_times(f.lr_growth)}: beyond any usual warmup"),
    ("loss/rise-after-fall", "overfitting-noisy-samples",
     lambda f: f.lr_phase in ("constant", "decaying"), 2.0,
     lambda f: f"the LR was {f.lr_phase} when the loss turned"),
    ("loss/divergence", "schedule-bug-lr-increasing", lambda f: f.lr_growth >= 10.0, 3.0,
     lambda f: f"the LR grew {_times(f.lr_growth)} before the loss left its band: beyond any usual warmup"),
    ("loss/divergence", "learning-rate-too-high", lambda f: f.lr_phase in ("constant", "decaying"), 2.0,
     lambda f: f"the LR was {f.lr_phase} when the loss left its band: its level, not its schedule"),
    ("loss/divergence", "learning-rate-too-high", lambda f: f.clip_rate is not None and f.clip_rate > 0.5,
     1.5, lambda f: f"clipping triggered on {f.clip_rate or 0:.0%} of the steps: it bounds each update, "
                    "and the loss diverges anyway"),
    ("loss/divergence", "learning-rate-too-high", _lr_high, 2.0, _lr_high_why),
    ("loss/oscillation", "learning-rate-too-high", _lr_high, 3.0, _lr_high_why),
    ("loss/oscillation", "learning-rate-too-high", lambda f: f.clip_rate is None or f.clip_rate < 0.3, 1.5,
     lambda f: "steps are not clipped, so every update has the LR's full size"),
    ("gradient/clip-stale", "learning-rate-too-high", lambda f: f.diverged_at is not None, 4.0,
     lambda f: f"the loss diverged at step {f.diverged_at} in this run: every step clips because the updates "
               "are too large for the model; a higher threshold would let them through"),
    ("gradient/clip-stale", "learning-rate-too-high", _loss_rose, 4.0,
     lambda f: f"the loss went up to {_times(f.loss_rise)} where it started in this run while the steps "
               "clipped: the updates are too large for the model; a higher threshold would let them through"),
    ("loss/plateau", "optimizer-momentum-mis-set", lambda f: f.lr_phase == "zero", 3.0,
     lambda f: "the LR is 0"),
    ("memory/oom", "activations-too-large-batch", lambda f: _big_request(f), 3.0,
     lambda f: "the failed request alone is over a quarter of the GPU (or more than all it had left)"),
    ("memory/oom", "fragmentation-enough-free-memory", _oom_frag, 5.0,
     lambda f: "reserved-but-unallocated memory was larger than the failed request"),
    ("memory/oom", "another-process-same-gpu", _oom_other, 5.0,
     lambda f: "the OOM message lists memory held by other processes"),
    ("comm/timeout", "one-rank-slower-stuck", lambda f: bool(f.facts.get("lagging_ranks")), 4.0,
     lambda f: f"the desync report names lagging rank(s) {f.facts.get('lagging_ranks')}"),
    ("comm/timeout", "one-rank-slower-stuck", lambda f: "correlation.lagging_rank" in f.rules, 4.0,
     lambda f: "a rank was alive but never reached the collective (heartbeats without progress)"),
    ("comm/rank-lost", "node-failure-preemption", lambda f: f.silent_rank, 3.0,
     lambda f: "the lost rank went silent without an exit event: SIGKILL or a dead node"),
    ("comm/rank-lost", "killed-host-oom-killer", lambda f: f.silent_rank, 2.0,
     lambda f: "a SIGKILLed process sends nothing; check `dmesg` on its node for oom-kill"),
    ("progress/stalled", "collective-waiting-rank-that", lambda f: f.world_size <= 1, 0.1,
     lambda f: "a single-process run has no peers to wait for"),
)

def _check_rules() -> None:
    for rule_kind, cause_id, *_rest in RULES:
        category, _, subtype = rule_kind.partition("/")
        kind(category, subtype).cause_text(cause_id)  # KeyError names the kind and the id


_check_rules()

PRIORS = (3.0, 2.0, 1.5, 1.0)
"""Weights of a kind's causes in catalogue order (the most common first); later ones get the last."""


_KIND_RULES: Dict[int, Tuple[IncidentKind, Tuple[Rule, ...], Tuple[Rule, ...]]] = {}
"""id of a kind -> (that kind, the RULES these were taken from, those of its kind in RULES order)."""
_RANKED: Dict[Tuple[int, Tuple[Tuple[int, str], ...], int],
              Tuple[IncidentKind, Tuple[Rule, ...], Tuple[Tuple[str, float, Tuple[str, ...]], ...]]] = {}
"""(id of a kind, the rules that held -- (index among the kind's rules, its reason) --, most) -> (that
kind, its rules, the ranked ``(cause, confidence, why)``): what :func:`hypotheses` returns is a function
of these alone. Derived, bounded by RANKED_MAX (then started afresh)."""
RANKED_MAX = 4096


def hypotheses(category: str, subtype: str, facts: Facts, most: int = 5) -> List[Dict[str, Any]]:
    """Ranked ``[{"cause", "confidence", "why"}]`` for an incident of this kind with these facts.

    The kind's rules are walked in :data:`RULES` order, each reason rendered when its predicate holds
    (as ever); the ranking of the causes depends on nothing else, so it is remembered per kind and per
    rules that held with their reasons (an incident is enriched on every finding applied to it, mostly
    with the same outcome). Fresh dicts and lists on every call."""
    spec = kind(category, subtype)
    held = _KIND_RULES.get(id(spec))
    if held is None or held[0] is not spec or held[1] is not RULES:
        name = spec.name
        held = _KIND_RULES[id(spec)] = (spec, RULES, tuple(rule for rule in RULES if rule[0] == name))
    fired = tuple((i, reason(facts)) for i, (_k, _c, predicate, _f, reason) in enumerate(held[2])
                  if predicate(facts))
    key = (id(spec), fired, most)
    ranked = _RANKED.get(key)
    if ranked is None or ranked[0] is not spec or ranked[1] is not held[2]:
        if len(_RANKED) >= RANKED_MAX:
            _RANKED.clear()
        ranked = _RANKED[key] = (spec, held[2], _rank(spec, held[2], fired, most))
    return [{"cause": cause, "confidence": confidence, "why": list(why)}
            for cause, confidence, why in ranked[2]]


def _rank(spec: IncidentKind, rules: Sequence[Rule], fired: Sequence[Tuple[int, str]],
          most: int) -> Tuple[Tuple[str, float, Tuple[str, ...]], ...]:
    """The ranking of :func:`hypotheses`: the causes' priors in catalogue order, each rule that held
    (``fired``: its index in ``rules`` and its reason, in order) multiplying its cause's weight (an extra
    cause entering at 1.0), normalised to confidences; ties keep the order the causes came in."""
    weights: Dict[str, float] = {}
    why: Dict[str, List[str]] = {}
    for i, cause in enumerate(spec.causes):
        weights[cause] = PRIORS[min(i, len(PRIORS) - 1)]
        why[cause] = []
    for i, reason in fired:
        _k, cause_id, _p, factor, _r = rules[i]
        cause = spec.cause_text(cause_id)
        if cause not in weights:  # an extra cause: only this rule brings it in
            weights[cause] = 1.0
            why[cause] = []
        weights[cause] *= factor
        why[cause].append(reason)
    total = sum(weights.values()) or 1.0
    ranked = sorted(weights.items(), key=lambda kv: (-kv[1], list(weights).index(kv[0])))
    prior = ("prior: how often this is the cause of this kind",)
    return tuple((cause, round(w / total, 2), tuple(why[cause]) or prior) for cause, w in ranked[:most])


# ----------------------------------------------------------------------------------------------------
# entry point


def enrich(run: RunState, st: IncidentState, settings: DetectionSettings) -> None:
    """Recompute ``st.record``'s duration, related metrics, trigger and hypotheses from ``run``'s state."""
    inc = st.record
    inc.duration_s = round(max(0, inc.last_ns - inc.first_ns) / 1e9, 3)
    rank = run.ranks.get(inc.lead_rank)
    if rank is None and inc.ranks:
        rank = run.ranks.get(inc.ranks[0])
    facts = _facts(run, rank, st, settings)
    same_start = inc.trigger.get("step") == facts.trigger.get("step")
    inc.trigger = _merged(inc.trigger if same_start else {}, facts.trigger)
    inc.related = _merged(inc.related if same_start else {}, facts.related)
    # what the history no longer holds (it keeps the last history_len steps) stays as first computed
    facts.lr_phase = str(inc.trigger.get("lr_phase", ""))
    lr = inc.related.get("lr")
    facts.lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
    growth = inc.trigger.get("lr_growth", 0.0)
    facts.lr_growth = float(growth) if isinstance(growth, (int, float)) else \
        math.inf if growth == "Infinity" else 0.0
    inc.hypotheses = hypotheses(inc.category, inc.subtype, facts)
    inc.checks = _checks_for(inc.category, inc.subtype, facts)


CUDA_MEMORY_METRICS = ("mem/allocated", "mem/reserved", "mem/max_allocated")
"""Memory metrics only the CUDA caching allocator reports (``mem/rss`` is the host's)."""


def cuda_in_use(rank: RankState) -> Optional[bool]:
    """Whether the rank uses CUDA: True when it reported CUDA allocator memory, False when its START
    said a CPU-only torch build (``+cpu``) and no CUDA memory was seen, None when nothing says."""
    held = rank.detectors.get(STATE_KEY)
    peak = held.get("peak", _NONE) if held is not None else _NONE
    history = rank.history
    for name in CUDA_MEMORY_METRICS:
        if name in peak or name in history:  # (any in the peaks, else any in the history: True either way)
            return True
    torch_version = str(held.get("torch", "")) if held is not None else ""
    return False if torch_version.endswith("+cpu") else None


_NOT_HERE: Tuple[Tuple[Callable[[Facts], bool], Tuple[str, ...]], ...] = (
    (lambda f: not f.has_amp, ("AMP", "GradScaler", "mixed precision", "fp16", "loss scale")),
    (lambda f: f.world_size <= 1, ("NCCL", "NVLink", "interconnect", "InfiniBand", "collective")),
    (lambda f: f.cuda is False, ("GPU", "nvidia-smi", "CUDA", "ECC", "Xid")),
    (lambda f: f.diverged_at is not None or _loss_rose(f), ("raise the clip threshold",)),
)
"""What a check is about (words in its text), and when the run says that does not apply here: no
GradScaler reported, a single process, a CPU-only job, a run whose loss diverged or went up to
``diagnosis_clip_stale_loss_rise`` x its start (raising the clip threshold lets the too-large updates
through)."""


def contextual_checks(checks: Sequence[str], facts: Facts) -> List[str]:
    """The kind's checks with those the run rules out moved last (kept, in their order: the run's signals
    can be incomplete): AMP checks on a job that reported no GradScaler, NCCL/interconnect checks on a
    single-process run, GPU checks on a CPU-only job."""
    ruled_out = [words for applies, words in _NOT_HERE if applies(facts)]
    if not ruled_out:
        return list(checks)

    def out(check: str) -> bool:
        return any(word in check for words in ruled_out for word in words)

    return [c for c in checks if not out(c)] + [c for c in checks if out(c)]


_CHECKS: Dict[Tuple[int, Tuple[bool, ...]], Tuple[Any, Tuple[str, ...]]] = {}
"""(id of a kind, which of _NOT_HERE apply) -> (that kind, its contextual checks): at most 8 per kind."""


def _checks_for(category: str, subtype: str, facts: Facts) -> List[str]:
    """:func:`contextual_checks` of the kind's checklist, remembered per kind and per what the facts rule
    out (all they depend on; an incident is enriched on every finding applied to it)."""
    spec = kind(category, subtype)
    key = (id(spec), tuple(applies(facts) for applies, _words in _NOT_HERE))
    held = _CHECKS.get(key)
    if held is None or held[0] is not spec:
        held = _CHECKS[key] = (spec, tuple(contextual_checks(spec.checklist(), facts)))
    return list(held[1])


def _merged(old: Mapping[str, Any], new: Mapping[str, Any]) -> Dict[str, Any]:
    """``new`` over ``old``, one level deep: keys ``new`` lacks keep their earlier value."""
    out = dict(old)
    for key, value in new.items():
        before = out.get(key)
        out[key] = {**before, **value} if isinstance(value, dict) and isinstance(before, dict) else value
    return out
