"""The loss/gradient family's shared numerics: the rank's state and history for the family, the run's
numeric slot (one incident for a NaN loss, an exploding gradient or the NaN's source: who may re-classify
it, whether it is final), and the divergence story the non-finite loss and the gradient detectors both tell
-- was the gradient norm climbing before the loss went non-finite (:func:`find_explosion`), where did the
first non-finite value come from (:func:`nan_source`). Pure; used by :mod:`.loss` and :mod:`.gradient`."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from typing import AbstractSet, Any, Dict, Final, List, Optional, Sequence, Tuple

from trainguard.core.events import wire_float

from .. import robust
from ..catalogue import KINDS, DetectionSettings
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState, SeriesTail
from . import fmt_number, window
from .roles import RoleMemo, remember

NUMERIC_KEY: Final = "numeric"
"""The incident slot of the run's divergence story (one per run): non-finite loss, gradient explosion,
NaN source, and the loss rising after a fall, which they re-classify when it turns out to be their start."""
RISE = ("loss", "rise-after-fall")
DIVERGENCE = ("loss", "divergence")
ESCALATING = (RISE, DIVERGENCE)
"""Kinds of the numeric slot that a later explosion or NaN re-classifies (the story is not over)."""
"""The one kind in the numeric slot that a later explosion / NaN re-classifies (escalates)."""
VANISHING_KEY = "gradient:vanishing"
CLIP_STALE_KEY: Final = "gradient:clip-stale"
STATE_KEY: Final = "lg"
"""``RankState.detectors`` key of the loss/gradient family's per-rank state."""
LAYER_PREFIX = "grad/layer/"
MAX_LAYERS_KEPT = 16


LossGradientSettings = DetectionSettings
"""The loss-curve and gradient detectors' thresholds are fields of :class:`DetectionSettings` (section
"loss curve and gradient detectors"), so every one of them can be overridden per project."""


# ----------------------------------------------------------------------------------------------------
# per-rank state (plain JSON inside RankState.detectors)


def rank_state(rank: RankState) -> Dict[str, Any]:
    """The family's state of ``rank`` (created empty): ``loss`` (curve tests, see :mod:`.loss`),
    ``grad`` (last norm step checked), ``clip`` (streak, tau), ``layers`` (vanishing streak and ratios,
    the last report's largest and zero-gradient layers), ``nonfinite`` (the first non-finite gradient
    seen, and whether it still waits for its step's loss)."""
    state: Optional[Dict[str, Any]] = rank.detectors.get(STATE_KEY)  # (no empty dict built per call)
    if state is None:
        state = rank.detectors[STATE_KEY] = {}
    return state


def rank_has_open(run: RunState, rank: RankState, *keys: str) -> bool:
    """Whether an open incident in one of the slots ``keys`` lists ``rank``."""
    for key in keys:
        st = run.incidents.get(key)
        if st is not None and st.is_open and rank.rank in st.rank_first:
            return True
    return False


NUMERIC_STRENGTH = {name: k.numeric_strength for name, k in KINDS.items() if k.numeric_strength}
"""How specific each kind of the numeric slot is (the catalogue's ``numeric_strength``): a finding
re-classifies the incident only upwards."""


def upgrades(run: RunState, category: str, subtype: str) -> bool:
    """Whether a ``category/subtype`` finding re-classifies the run's numeric incident (it is more
    specific than the incident's kind; True when there is none, or it was resolved: a condition that
    cleared is history, and what comes next tells its own story)."""
    st = run.incidents.get(NUMERIC_KEY)
    if st is None or not st.is_open:
        return True
    now = NUMERIC_STRENGTH.get(f"{st.record.category}/{st.record.subtype}", 0)
    return NUMERIC_STRENGTH.get(f"{category}/{subtype}", 0) > now


def numeric_final(run: RunState, rank: RankState) -> bool:
    """Whether ``rank`` is in an open numeric incident that is final (not a rise-after-fall or a
    divergence that could still escalate): its gradients and loss curve have told their story."""
    st = run.incidents.get(NUMERIC_KEY)
    return st is not None and st.is_open and rank.rank in st.rank_first and \
        (st.record.category, st.record.subtype) not in ESCALATING


def divergence_base(initial: float, first: float, settings: DetectionSettings) -> float:
    """The level a divergence is measured from: the initial level (the median of the first
    ``loss_baseline_points`` values) -- or the very first value, the untrained model's loss, when the
    first values already jumped ``divergence_factor`` x above it (a far-too-high LR moves the loss on the
    first update). One noisy first value does not lower the bar."""
    return first if 0 < first and initial >= settings.divergence_factor * first else initial


def loss_start(rank: RankState) -> Optional[float]:
    """Where the rank's loss started, as the loss curve saw it: the lower of its first value and the
    median of its first ``loss_baseline_points`` values (a blow-up on the first updates does not become
    the start); None before the curve has its first values or when that level is not positive."""
    init = rank_state(rank).get("loss", {}).get("init")
    if not init:
        return None
    start = min(init[0], robust.median(list(init)))
    return start if start > 0 else None


def loss_diverged(rank: RankState, settings: DetectionSettings) -> bool:
    """Whether the rank's loss level (the loss curve's rolling median) is >= ``divergence_factor`` x its
    :func:`divergence_base`: the loss has left its band, whatever the gradient norm does."""
    return diverged_state(rank_state(rank), settings)


def diverged_state(family: Dict[str, Any], settings: DetectionSettings) -> bool:
    """:func:`loss_diverged` of the rank whose family state (:func:`rank_state`) is ``family``."""
    state = family.get("loss")
    if state is None:
        return False
    if isinstance(state, dict):  # (what this code writes: its reads are dict reads, compiled)
        loss: Dict[str, Any] = state
        level, init = loss.get("level"), loss.get("init")
    else:  # (a foreign part's: read, or raise, as before)
        level, init = state.get("level"), state.get("init")
    if level is None or not init:
        return False
    # the base is the first value or the median, never below the lowest: a level under
    lowest = least(init) if type(init) is list else min(init)
    factor = settings.divergence_factor
    if lowest > 0 and factor > 0 and level < factor * lowest:
        return False    # factor x the lowest is under factor x the base (the usual case, no median taken)
    base = divergence_base(robust.median(list(init)), init[0], settings)
    return base > 0 and level >= factor * base


def least(values: List[float]) -> float:
    """``min(values)`` of a non-empty list: the same value (the first of the least, by the same ``<``
    comparisons); compiled, a native loop instead of a call of the builtin."""
    out = values[0]
    for i in range(1, len(values)):
        v = values[i]
        if v < out:
            out = v
    return out


def point_time(rank: RankState, name: str, step: int, default: int) -> int:
    """The event time of ``name`` at ``step`` in the history (``default`` when unknown)."""
    kept = rank.history.get(name, {}).get(step)
    return kept[1] if kept is not None and kept[1] else default


def finite_series(rank: RankState, name: str, lo: int, hi: int) -> List[Tuple[int, float, int]]:
    """``(step, value, time_ns)`` of ``name`` for lo <= step <= hi, finite values only, by step."""
    data = rank.history.get(name)
    if not data:
        return []
    steps = sorted(s for s in data if lo <= s <= hi)
    out = []
    for s in steps:
        value, t = data[s]
        if value - value == 0.0:
            out.append((s, value, t))
    return out


def recent(rank: RankState, name: str, most: int, upto: Optional[int] = None) -> List[Tuple[int, float, int]]:
    """``(step, value, time_ns)`` of the finite values among the last ``most`` points of ``name`` received
    (at steps <= ``upto`` when given), by step. Cheap (no sort of the whole history): the history keeps
    arrival order, which is step order except for late points, which then count as recent. Usually a
    slice of the series' :class:`~trainguard_engine.state.SeriesTail` (no tuple built per call)."""
    data = rank.history.get(name)
    if not data or most < 1:
        return []
    tail = rank.tails.get(name)
    if tail is None or tail.data is not data or len(tail.points) != len(data):
        tail = rank.tails[name] = SeriesTail(data)
    points = tail.points
    start = max(0, len(points) - most)
    if start >= tail.bad_end and start >= tail.descent and (upto is None or points[-1][0] <= upto):
        return points[-most:]  # the usual case: finite, in step order, none past upto (a copy)
    out = [p for p in points[-most:] if p[1] - p[1] == 0.0 and (upto is None or p[0] <= upto)]
    out.sort()
    return out


DENSITY_POINTS = 16
"""Recent points whose step span measures how densely a series is sampled."""


def grad_metric(rank: RankState, settings: DetectionSettings) -> Optional[str]:
    """The rank's global grad-norm metric: of the ``grad_norm_metrics`` it has a history of, the most
    densely sampled lately (the SDK may read its norm every few steps under its overhead budget while the
    loop logs the norm ``clip_grad_norm_`` returned every step); ties go to the first listed."""
    history = rank.history
    found = None
    for name in settings.grad_norm_metrics:  # the usual case, one of them present: no list built
        if name in history:
            if found is not None:
                break
            found = name
    else:
        return found
    present = [n for n in settings.grad_norm_metrics if n in history]
    best, best_density = present[0], -1.0
    for name in present:
        steps = list(itertools.islice(reversed(rank.history[name]), DENSITY_POINTS))
        density = len(steps) / (steps[0] - steps[-1] + 1) if steps else 0.0
        if density > best_density:
            best, best_density = name, density
    return best


def lr_span(rank: RankState, lo: int, hi: int) -> str:
    """``"; the LR went from 0.05 to 0.82"`` over [lo, hi] when an LR metric is in the history."""
    for name in ("opt/lr", "lr"):
        series = finite_series(rank, name, lo, hi)
        if len(series) >= 2:
            first, last = series[0][1], series[-1][1]
            if first != last:
                return (f"; the LR went from {fmt_number(first)} to {fmt_number(last)} "
                        f"(steps {series[0][0]}-{series[-1][0]})")
            return f"; the LR stayed at {fmt_number(first)}"
    return ""


Point = Tuple[str, int, float]


@lru_cache(maxsize=32)
def name_set(names: Tuple[str, ...]) -> AbstractSet[str]:
    """A settings tuple of metric names as a set (one hash lookup per point instead of a scan of the
    tuple); remembered per tuple, so per settings object."""
    return frozenset(names)


_NAMES_MEMO: List[Any] = [None, None]
"""[settings, (grad, loss, clip) name sets] of the settings object last asked for (:func:`family_names`)."""


def family_names(settings: DetectionSettings) -> Tuple[AbstractSet[str], AbstractSet[str], AbstractSet[str]]:
    """The family's metric-name sets of ``settings`` (:func:`name_set` of ``grad_norm_metrics``,
    ``loss_metrics``, ``clip_threshold_metrics``): for the settings object asked for last, one identity
    test instead of three tuple hashes (settings are immutable; the pipeline asks with one object)."""
    memo = _NAMES_MEMO
    if memo[0] is not settings:
        memo[1] = (name_set(settings.grad_norm_metrics), name_set(settings.loss_metrics),
                   name_set(settings.clip_threshold_metrics))
        memo[0] = settings
    names: Tuple[AbstractSet[str], AbstractSet[str], AbstractSet[str]] = memo[1]
    return names


_OTHER: Final = 0
_GRAD: Final = 1
_LAYER: Final = 2
_LOSS: Final = 3
_AMP: Final = 4
_AMP_CLIP: Final = 5
_CLIP: Final = 6
"""The role of a point name in :func:`read_batch` (``_AMP_CLIP``: ``amp/overflow`` when it is a clip
threshold name too: a value other than 1 is then read as a threshold)."""
_ROLES = RoleMemo()
"""The roles :func:`read_batch` decided (:func:`_role`), per settings object and name."""


def _role(name: str, settings: DetectionSettings) -> int:
    """What :func:`read_batch` reads a point of ``name`` as (the first that applies, its tests' order)."""
    grad_names, loss_names, clip_names = family_names(settings)
    if name in grad_names:
        return _GRAD
    if name.startswith(LAYER_PREFIX):
        return _LAYER
    if name in loss_names:
        return _LOSS
    if name == "amp/overflow":
        return _AMP_CLIP if name in clip_names else _AMP
    return _CLIP if name in clip_names else _OTHER


def read_batch(rank: RankState, state: Dict[str, Any], points: Sequence[Point], settings: DetectionSettings
               ) -> Tuple[Optional[Point], List[Point], Optional[Point], bool]:
    """(global grad norm point, per-layer points, loss point, a GradScaler overflow step) of one batch;
    remembers a clip threshold it carries. A point's role is decided by its name alone (:func:`_role`,
    remembered per name): most points of a batch are none of these, one lookup each."""
    # the points handed back are the batch's own tuples (compiled: none rebuilt from its unboxed fields)
    layers: List[Any] = []
    grad_point: Any = None
    loss_point: Any = None
    overflow = False
    last = _ROLES.last  # (RoleMemo.of, inline for the settings asked for last)
    roles = last[1] if last[0] is settings else _ROLES.of(settings)
    batch: Sequence[Any] = points
    for point in batch:
        name = point[0]
        role = roles.get(name)
        if role is None:
            role = remember(roles, name, _role(name, settings))
        if not role:
            continue
        if len(point) != 3:  # (as the unpacking of a point into name, step, value: not a point)
            raise ValueError(f"a metric point of {len(point)} fields")
        value = point[2]
        if role == _GRAD:
            grad_point = point
        elif role == _LAYER:
            layers.append(point)
        elif role == _LOSS:
            loss_point = loss_point or point
        elif role != _CLIP and value == 1.0:  # amp/overflow
            overflow = True
        elif role != _AMP and math.isfinite(value) and value > 0:  # a clip threshold
            state.setdefault("clip", {})["tau"] = value
    overflow_history = rank.history.get("amp/overflow") if not overflow else None
    if overflow_history:  # an SDK alert batch of per-layer NaNs has no amp/overflow; the history may
        steps = {p[1] for p in layers} | ({grad_point[1]} if grad_point is not None else set())
        overflow = any(overflow_history.get(s, (0.0, 0))[0] >= 0.5 for s in steps)
    return grad_point, layers, loss_point, overflow


def note_nonfinite_batch(run: RunState, rank: RankState, points: Sequence[Point], time_ns: int,
                         settings: DetectionSettings) -> None:
    """Register a non-finite gradient of this batch before a non-finite loss of the same batch is judged:
    a metrics file (``trainguard replay``) logs a step's loss and gradient norms on one line, where the
    SDK sends the norms first. Idempotent with :func:`on_metrics`'s own registration."""
    state = rank_state(rank)
    grad_point, layers, _loss, overflow = read_batch(rank, state, points, settings)
    if not overflow and not numeric_final(run, rank):
        note_nonfinite(state, grad_point, layers, time_ns)


# ----------------------------------------------------------------------------------------------------
# explosion, judged when the loss goes non-finite (DESIGN §4 "Correlation")


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
    onset_step: Optional[int] = None  # where the climb began (the norm first far above its median)


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
        if climb is None:
            continue  # a non-finite gradient without a climb is a NaN source, not an explosion
        found = Explosion(metric=name, detail="")
        win = window(rank, name, loss_step, settings.evidence_window)
        parts: List[str] = []
        short: List[str] = []
        times: List[int] = []
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
            threshold=settings.explosion_jump_factor, value=wire_float(ratio), window=win))  # may overflow
        found.timeline.append(TimelineEntry(
            time_ns=onset[2] or time_ns, step=onset[0], rank=rank.rank,
            what=(f"rank {rank.rank}: {name} {fmt_number(onset[1])} at step {onset[0]}, "
                  f"{onset[1] / baseline:.3g}x its median")))
        times.append(onset[2])
        found.onset_step = onset[0]
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


# ----------------------------------------------------------------------------------------------------
# explosion before the NaN


def diverged_before(run: RunState, rank: RankState, step: int, time_ns: int,
                    settings: DetectionSettings) -> Optional[Explosion]:
    """The explosion evidence of a non-finite value at ``step`` that ended an open ``loss/divergence`` of
    ``rank`` (the run's numeric incident, the rank in it, begun before ``step``) when the norm shows no
    climb of its own in the window before it (:func:`find_explosion` found none: a norm already far up
    for longer than the window, or read too seldom): the loss's departure from its band was the warning, so
    what blew up is the divergence -- an explosion, not a NaN from nowhere (a NaN source comes with no
    warning). None when no such divergence is open, or when the rank reports no global gradient norm (then
    nothing says the gradients blew up: the non-finite loss stays ``loss/non_finite``)."""
    if grad_metric(rank, settings) is None:
        return None
    st = run.incidents.get(NUMERIC_KEY)
    if st is None or not st.is_open or (st.record.category, st.record.subtype) != DIVERGENCE or \
            rank.rank not in st.rank_first:
        return None
    began = st.rank_first[rank.rank][1]
    if not 0 <= began < step:
        return None
    began_ns = st.rank_first[rank.rank][0] or time_ns
    detail = (f"the loss had left its band since step {began} (the open loss/divergence: "
              f"{st.values.get('detail', 'far above its start')})")
    found = Explosion(metric="loss", detail=detail, short=f"loss diverged since step {began}",
                      earliest_ns=min(began_ns, time_ns), onset_step=began)
    found.evidence.append(Evidence(
        rule="loss.diverged_before_nan",
        description=(f"the loss had diverged since step {began} before the first non-finite value at step "
                     f"{step}: the divergence ended in it"),
        step=began, time_ns=began_ns, rank=rank.rank, metric="loss"))
    found.timeline.append(TimelineEntry(time_ns=began_ns, step=began, rank=rank.rank,
                                        what=f"rank {rank.rank}: the loss left its band (a divergence)"))
    return found


def climb_baseline(values: Sequence[float]) -> float:
    """The running median a climb is measured against: the median of the earlier half of ``values``."""
    return robust.median(values[: max(1, len(values) // 2)])


# ----------------------------------------------------------------------------------------------------
# NaN source


def note_nonfinite(state: Dict[str, Any], grad_point: Optional[Tuple[str, int, float]],
                    layers: Sequence[Tuple[str, int, float]], time_ns: int) -> None:
    """Remember the first non-finite gradient (global norm or layers) of the rank and its layers."""
    if not layers and (grad_point is None or grad_point[2] - grad_point[2] == 0.0):
        return  # the usual batch: nothing non-finite, no layer report to attach
    bad_layers = [n[len(LAYER_PREFIX):] for n, _s, v in layers if not math.isfinite(v)]
    pending = state.get("nonfinite")
    if grad_point is not None and not math.isfinite(grad_point[2]) and pending is None:
        pending = state["nonfinite"] = {"step": grad_point[1], "metric": grad_point[0],
                                        "value": wire_float(grad_point[2]), "time_ns": time_ns,
                                        "waiting": True, "layers": [], "layer_count": 0}
    if bad_layers and pending is None:
        first_bad = next(v for _n, _s, v in layers if not math.isfinite(v))
        pending = state["nonfinite"] = {"step": layers[0][1], "metric": LAYER_PREFIX + bad_layers[0],
                                        "value": wire_float(first_bad), "time_ns": time_ns, "waiting": True,
                                        "layers": [], "layer_count": 0}
    if pending is not None and layers and layers[0][1] == pending["step"] and not pending["layers"]:
        names = [n[len(LAYER_PREFIX):] for n, _s, _v in layers]
        pending["layer_count"] = len(names)
        pending["layers"] = [n for n in names if n in set(bad_layers)][:MAX_LAYERS_KEPT]
        pending["deepest"] = max((i for i, n in enumerate(names) if n in set(bad_layers)), default=-1)
        pending["prefix"] = all(n in set(bad_layers) for n in names[: pending["deepest"] + 1])
        pending["last_layer"] = names[pending["deepest"]] if pending["deepest"] >= 0 else ""


@dataclass
class NanSource:
    """Where the first non-finite gradient of a rank appeared (see :func:`nan_source`)."""

    step: int
    metric: str
    value: str
    time_ns: int
    detail: str                  # for the title: "every layer at once (3 of 3)", "layer 2 (and ...)", ...
    description: str
    layers: List[str]


def nan_source(rank: RankState) -> Optional[NanSource]:
    """The rank's first non-finite gradient as the NaN-source story, if one was seen."""
    pending = rank_state(rank).get("nonfinite")
    if pending is None:
        return None
    layers: List[str] = list(pending.get("layers", []))
    count = int(pending.get("layer_count", 0))
    step = int(pending["step"])
    if layers and count and len(layers) >= count:
        detail = f"every layer at once ({count} of {count})"
        where = (f"all {count} layers' gradients were non-finite at step {step}: the NaN/Inf came from the "
                 f"forward pass or the loss (a bad sample, log(0), a division by zero), not from one layer")
    elif layers and pending.get("prefix") and pending.get("last_layer"):
        detail = f"layer {pending['last_layer']} (and the {len(layers) - 1} before it)"
        where = (f"the gradients of layers {', '.join(layers)} were non-finite at step {step} and the layers "
                 f"after {pending['last_layer']} stayed finite: the NaN/Inf arose in the backward of "
                 f"{pending['last_layer']}")
    elif layers:
        detail = f"layers {', '.join(layers[:4])}{'...' if len(layers) > 4 else ''}"
        where = f"the gradients of layers {', '.join(layers)} were non-finite at step {step}"
    else:
        detail = str(pending["metric"])
        where = (f"{pending['metric']} was {pending['value']} at step {step} (no per-layer norms at that "
                 f"step: report them more often with watch(every=...) to name the layer)")
    return NanSource(step=step, metric=str(pending["metric"]), value=str(pending["value"]),
                     time_ns=int(pending.get("time_ns", 0)), detail=detail, description=where, layers=layers)


def nan_source_evidence(rank: RankState, source: NanSource, time_ns: int, settings: DetectionSettings
                        ) -> Evidence:
    """The ``gradient.non_finite`` evidence of a NaN source (window: the grad norms before it)."""
    name = grad_metric(rank, settings) or source.metric
    return Evidence(rule="gradient.non_finite", description=source.description, step=source.step,
                    time_ns=source.time_ns or time_ns, rank=rank.rank, metric=source.metric,
                    value=source.value, window=window(rank, name, source.step, settings.evidence_window))
