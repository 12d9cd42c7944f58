"""Memory detectors: allocator fragmentation and AMP (GradScaler) overflow collapse (DESIGN §4).

Pure and streaming. Per-rank state lives in ``RankState.detectors["mem"]`` (plain JSON, bounded by the
``*_MAX_*`` constants below). Thresholds are read with ``getattr(settings, name, DEFAULT)`` so the module
works before the fields exist in :class:`~trainguard.core.catalogue.DetectionSettings`; the defaults are
the module constants documented here.

* **memory/fragmentation** (:func:`on_memory`, and :func:`on_metrics` for ``mem/fragmentation`` when the
  rank sends no ``memory`` events) -- frag = (reserved - active) / reserved, levels of DESIGN §4:
  < ``frag_mild`` (0.2) healthy, up to ``frag_severe`` (0.5) mild, above severe. Opens

  - *severe* when frag > ``frag_severe`` on ``frag_sustain_samples`` consecutive samples **and** the
    reserved memory is not just the cache of the peak: (reserved - peak allocated) / reserved >=
    ``frag_peak_headroom`` (0.5: more than half of what is reserved was never needed, even at the peak).
    Without that gate a job whose working set changes size (e.g. the context length doubling in
    ``gpu_oom``) shows frag ~0.99 between steps only because active memory is tiny next to cached,
    reusable buffers. ``first_step`` is the first sample of the current run of frag > ``frag_severe``.
  - *early warning* when frag > ``frag_warn`` (0.7) and the std of frag over the last
    ``frag_window_s`` (60 s) of samples > ``frag_warn_std`` (0.15), on at least ``frag_min_samples``
    samples, under the same peak gate. When the samples span less than the window, what there is is used
    and the evidence says so.

  A sample taken at an OOM (``num_ooms`` increased) is skipped: memory/oom (error) explains it.
* **memory/amp-overflow** (:func:`on_metrics`) -- the GradScaler's ``amp/scale`` collapsing: an
  overflow step is one with ``amp/overflow`` == 1 (or, when the job does not send that flag, a step
  after which ``amp/scale`` fell to <= 0.5x). Opens on ``amp_overflow_consecutive`` consecutive overflow
  steps, or ``amp_overflow_episodes`` separate overflow episodes (runs of consecutive overflows) within
  the last ``amp_overflow_window`` steps. The initial calibration of a fresh scaler (a few halvings from
  2^16) is one short episode and opens nothing. Evidence: the scale trajectory (the steps where it
  changed), the overflow steps, the lowest scale. Non-finite gradient norms on overflow steps are the
  scaler doing its job (the step is skipped); :mod:`.gradient` must not call them a NaN source.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState, bounded_append
from . import fmt_duration, fmt_number

STATE_KEY = "mem"
"""``RankState.detectors`` key of this family's per-rank state."""
FRAG_KEY = "memory:fragmentation"
AMP_KEY = "memory:amp-overflow"

# --- defaults (overridable by DetectionSettings fields of the same names) -------------------------
FRAG_MILD = 0.2
"""frag below this is healthy; from it up to FRAG_SEVERE mild (DESIGN §4)."""
FRAG_SEVERE = 0.5
"""frag above this is severe (DESIGN §4)."""
FRAG_SUSTAIN_SAMPLES = 3
"""Consecutive samples above FRAG_SEVERE before severe fragmentation opens (one sample is noise)."""
FRAG_PEAK_HEADROOM = 0.5
"""(reserved - peak allocated) / reserved must reach this: reserved memory that was never needed even at
the peak. Tells fragmentation from a cache sized by the working set's peak."""
FRAG_WARN = 0.7
"""Early warning: frag above this ... (DESIGN §4)."""
FRAG_WARN_STD = 0.15
"""... with its std over FRAG_WINDOW_S above this (DESIGN §4)."""
FRAG_WINDOW_S = 60.0
"""Window of the early-warning std, seconds of event time (DESIGN §4)."""
FRAG_MIN_SAMPLES = 5
"""Fewest samples the early-warning std is computed on."""
FRAG_UPDATE_STEP = 0.05
"""Once open, the incident's evidence is refreshed (no new count) each time frag exceeds the value last
reported by this much."""
FRAG_MAX_SAMPLES = 256
"""Most samples kept per rank for the window (bounded state; oldest dropped)."""
AMP_OVERFLOW_CONSECUTIVE = 10
"""Consecutive overflow steps that open memory/amp-overflow (scale down 1024x in a row)."""
AMP_OVERFLOW_EPISODES = 4
"""Separate overflow episodes within AMP_OVERFLOW_WINDOW steps that open memory/amp-overflow."""
AMP_OVERFLOW_WINDOW = 200
"""Steps over which overflow episodes are counted."""
AMP_MAX_TRAJECTORY = 32
"""Most scale changes kept (first and most recent survive)."""
AMP_MAX_EPISODES = 64
"""Most overflow episode starts kept."""

GIB = float(2**30)


def _cfg(settings: DetectionSettings, name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def rank_state(rank: RankState) -> Dict[str, Any]:
    """The family's state of ``rank``: ``frag`` (samples, streak, reported) and ``amp`` (streak,
    episodes, trajectory, reported)."""
    state: Dict[str, Any] = rank.detectors.setdefault(STATE_KEY, {})
    return state


def _num(value: Any) -> Optional[float]:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


# ----------------------------------------------------------------------------------------------------
# entry points


def on_memory(run: RunState, rank: RankState, payload: Mapping[str, Any], step: int, time_ns: int,
              event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one ``memory`` event (a MemorySnapshot payload) of ``rank``."""
    state = rank_state(rank).setdefault("frag", {})
    state["events"] = True
    reserved = _num(payload.get("reserved"))
    if reserved is None or reserved <= 0:
        return []  # CPU-only snapshot (rss only): nothing to say about the allocator
    active = _num(payload.get("active"))
    if active is None:
        active = _num(payload.get("allocated"))
    if active is None:
        return []
    ooms = int(_num(payload.get("num_ooms")) or 0)
    if ooms > int(state.get("ooms", 0)):
        state["ooms"] = ooms
        return []  # the snapshot of an OOM: memory/oom explains it
    peak = max(_num(payload.get("max_allocated")) or 0.0, _num(payload.get("allocated")) or 0.0)
    frag = _num(payload.get("fragmentation"))
    if frag is None:
        frag = max(0.0, (reserved - active) / reserved)
    return _sample(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active, peak,
                   "memory")


def on_metrics(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], step: int,
               time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (``points``: ``(name, step, value)``, as the pipeline's
    ``batch_points`` gives them; ``step`` the envelope's): ``amp/scale``/``amp/overflow`` and, for ranks
    that send no ``memory`` events, ``mem/fragmentation`` (with ``mem/reserved``/``mem/allocated``)."""
    out: List[Finding] = []
    by_name = {name: (s, v) for name, s, v in points}
    if "amp/scale" in by_name or "amp/overflow" in by_name:
        out.extend(_amp(run, rank, by_name, step, time_ns, event_id, settings))
    frag_state = rank_state(rank).setdefault("frag", {}) if "mem/fragmentation" in by_name else None
    if frag_state is not None and not frag_state.get("events"):
        s, frag = by_name["mem/fragmentation"]
        reserved = by_name.get("mem/reserved", (s, math.nan))[1]
        allocated = by_name.get("mem/allocated", (s, math.nan))[1]
        if math.isfinite(frag) and math.isfinite(reserved) and reserved > 0:
            active = reserved * (1.0 - frag)
            peak = max(float(frag_state.get("peak", 0.0)), allocated if math.isfinite(allocated) else 0.0)
            frag_state["peak"] = peak
            out.extend(_sample(run, rank, frag_state, s, time_ns, event_id, settings, frag, reserved,
                               active, peak, "mem/fragmentation"))
    return out


# ----------------------------------------------------------------------------------------------------
# fragmentation


def level(frag: float, settings: DetectionSettings) -> str:
    """``healthy`` / ``mild`` / ``severe`` by DESIGN §4."""
    if frag > _cfg(settings, "frag_severe", FRAG_SEVERE):
        return "severe"
    return "mild" if frag >= _cfg(settings, "frag_mild", FRAG_MILD) else "healthy"


def _sample(run: RunState, rank: RankState, state: Dict[str, Any], step: int, time_ns: int,
            event_id: str, settings: DetectionSettings, frag: float, reserved: float, active: float,
            peak: float, source: str) -> List[Finding]:
    severe_t = _cfg(settings, "frag_severe", FRAG_SEVERE)
    samples: List[List[Any]] = state.setdefault("samples", [])
    samples.append([step, time_ns, round(frag, 6)])
    while len(samples) > int(_cfg(settings, "frag_max_samples", FRAG_MAX_SAMPLES)):
        del samples[0]
    state["peak"] = max(float(state.get("peak", 0.0)), peak)
    if frag > severe_t:
        if not state.get("streak"):
            state["since"], state["since_ns"] = step, time_ns
        state["streak"] = int(state.get("streak", 0)) + 1
    else:
        state["streak"] = 0
        if frag < _cfg(settings, "frag_mild", FRAG_MILD):
            state["reported"] = False  # healthy again: a later episode may open a new finding
    headroom = (reserved - state["peak"]) / reserved if reserved > 0 else 0.0
    if state.get("reported"):
        if frag < float(state.get("reported_frag", 1.0)) + _cfg(settings, "frag_update_step",
                                                                FRAG_UPDATE_STEP):
            return []
        state["reported_frag"] = frag
        warn, std, span_s, n = _early_warning(samples, time_ns, frag, settings)
        severe = state["streak"] >= int(_cfg(settings, "frag_sustain_samples", FRAG_SUSTAIN_SAMPLES))
        return [_frag_finding(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active,
                              headroom, severe, warn, std, span_s, n, source, update=True)]
    gate = headroom >= _cfg(settings, "frag_peak_headroom", FRAG_PEAK_HEADROOM)
    if not gate:
        return []
    severe = state["streak"] >= int(_cfg(settings, "frag_sustain_samples", FRAG_SUSTAIN_SAMPLES))
    warn, std, span_s, n = _early_warning(samples, time_ns, frag, settings)
    if not (severe or warn):
        return []
    state["reported"], state["reported_frag"] = True, frag
    return [_frag_finding(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active,
                          headroom, severe, warn, std, span_s, n, source)]


def _early_warning(samples: List[List[Any]], time_ns: int, frag: float,
                   settings: DetectionSettings) -> Tuple[bool, float, float, int]:
    """(fires, std, span in s, samples) of the early-warning rule over the last ``frag_window_s``."""
    window_ns = float(_cfg(settings, "frag_window_s", FRAG_WINDOW_S)) * 1e9
    recent = [s for s in samples if s[1] and time_ns - s[1] <= window_ns] or samples
    values = [float(s[2]) for s in recent]
    span_s = max(0.0, (recent[-1][1] - recent[0][1]) / 1e9) if recent else 0.0
    if len(values) < int(_cfg(settings, "frag_min_samples", FRAG_MIN_SAMPLES)):
        return False, 0.0, span_s, len(values)
    std = statistics.pstdev(values)
    fires = frag > _cfg(settings, "frag_warn", FRAG_WARN) and std > _cfg(settings, "frag_warn_std",
                                                                         FRAG_WARN_STD)
    return fires, std, span_s, len(values)


def _frag_finding(run: RunState, rank: RankState, state: Dict[str, Any], step: int, time_ns: int,
                  event_id: str, settings: DetectionSettings, frag: float, reserved: float, active: float,
                  headroom: float, severe: bool, warn: bool, std: float, span_s: float, n: int,
                  source: str, update: bool = False) -> Finding:
    """The finding that opens the incident, or (``update``) refreshes its evidence and title."""
    window_s = float(_cfg(settings, "frag_window_s", FRAG_WINDOW_S))
    severe_t = _cfg(settings, "frag_severe", FRAG_SEVERE)
    since = int(state["since"]) if severe and "since" in state else step
    since_ns = int(state.get("since_ns") or time_ns) if severe else time_ns
    shown = [{"step": s, "value": v} for s, _t, v in state["samples"][-int(
        _cfg(settings, "evidence_window", 20)):]]
    coverage = (f"the stream covers only {fmt_duration(span_s)} (< {fmt_duration(window_s)}): the "
                f"window used is what there is ({n} samples)" if span_s < window_s
                else f"over the last {fmt_duration(window_s)} ({n} samples)")
    evidence: List[Evidence] = []
    if severe:
        evidence.append(Evidence(
            rule="memory.fragmentation.severe",
            description=(f"(reserved - active)/reserved = {frag:.3f} > {severe_t:g} (severe) on "
                         f"{state['streak']} consecutive samples since step {since} (first above "
                         f"{severe_t:g}); reserved {reserved / GIB:.2f} GiB, active {active / GIB:.2f} GiB"),
            step=since, time_ns=since_ns, rank=rank.rank, metric=source, threshold=severe_t,
            value=round(frag, 6), window=shown, event_id=event_id))
    if warn or not severe:
        evidence.append(Evidence(
            rule="memory.fragmentation.early_warning",
            description=(f"frag {frag:.3f} > {_cfg(settings, 'frag_warn', FRAG_WARN):g} with std "
                         f"{std:.3f} > {_cfg(settings, 'frag_warn_std', FRAG_WARN_STD):g}; {coverage}"),
            step=step, time_ns=time_ns, rank=rank.rank, metric=source,
            threshold=_cfg(settings, "frag_warn_std", FRAG_WARN_STD), value=round(std, 6), window=shown,
            event_id=event_id))
    evidence.append(Evidence(
        rule="memory.fragmentation.peak_headroom",
        description=(f"(reserved - peak allocated)/reserved = {headroom:.3f} >= "
                     f"{_cfg(settings, 'frag_peak_headroom', FRAG_PEAK_HEADROOM):g}: reserved "
                     f"{reserved / GIB:.2f} GiB vs peak allocated {float(state['peak']) / GIB:.2f} GiB -- "
                     f"memory never needed even at the peak, not a cache of the working set; "
                     f"std window: {coverage}"),
        step=step, time_ns=time_ns, rank=rank.rank, metric=source,
        threshold=_cfg(settings, "frag_peak_headroom", FRAG_PEAK_HEADROOM), value=round(headroom, 6),
        event_id=event_id))
    lvl = "severe" if severe else "early warning"
    detail = f"{lvl} ({frag:.2f})"
    return Finding(
        "memory", "fragmentation", FRAG_KEY, rank.rank, since, since_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: allocator fragmentation {frag:.3f} ({lvl})")],
        counts=not update, replace_evidence=update, update_values=update,
        values={"detail": detail, "step": since, "value": f"{frag:.3f}", "rank": rank.rank, "level": lvl},
        summary=(f"On rank {rank.rank}, {frag:.0%} of the {reserved / GIB:.2f} GiB reserved by the caching "
                 f"allocator is not active ({lvl}, above {severe_t:g} since step {since}), and reserved is "
                 f"{headroom:.0%} above the peak ever allocated: free memory is split into blocks the "
                 f"allocator cannot reuse. Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or pad "
                 f"dynamic shapes to a few bucket sizes."))


# ----------------------------------------------------------------------------------------------------
# AMP overflow


def _amp(run: RunState, rank: RankState, by_name: Mapping[str, Tuple[int, float]], step: int,
         time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    state = rank_state(rank).setdefault("amp", {})
    scale_pt = by_name.get("amp/scale")
    flag_pt = by_name.get("amp/overflow")
    s = (flag_pt or scale_pt or (step, 0.0))[0]
    if s <= int(state.get("last", -1)):
        return []  # replayed or late: never counts twice
    state["last"] = s
    overflow: Optional[int] = None  # the step that overflowed, if any
    if flag_pt is not None:
        state["flag"] = True
        if flag_pt[1] >= 0.5:
            overflow = s
    if scale_pt is not None and math.isfinite(scale_pt[1]) and scale_pt[1] > 0:
        prev = state.get("scale")
        if prev is None or scale_pt[1] != prev[1]:
            bounded_append(state.setdefault("trajectory", []), [s, scale_pt[1]], AMP_MAX_TRAJECTORY)
        if not state.get("flag") and prev is not None and scale_pt[1] <= 0.5 * prev[1]:
            overflow = prev[0]  # no flag sent: the scale halved after the previous step overflowed
        state["scale"] = [s, scale_pt[1]]
        new_low = scale_pt[1] < float(state.get("lowest", math.inf))
        state["lowest"] = min(float(state.get("lowest", scale_pt[1])), scale_pt[1])
    else:
        new_low = False
    span = int(_cfg(settings, "amp_overflow_window", AMP_OVERFLOW_WINDOW))
    if overflow is None:
        if flag_pt is not None or (scale_pt is not None and not state.get("flag")):
            state["streak"] = 0
        if new_low and state.get("reported"):  # the halving that follows an overflow: a new lowest scale
            return [_amp_update(rank, state, s, span, time_ns, event_id)]
        return []
    if state.get("streak") and overflow == int(state.get("prev_of", -2)) + 1:
        state["streak"] = int(state["streak"]) + 1
    else:
        state["streak"] = 1
        state.setdefault("episodes", []).append([overflow, time_ns])
        del state["episodes"][:-AMP_MAX_EPISODES]
    state["prev_of"] = overflow
    state["max_streak"] = max(int(state.get("max_streak", 0)), int(state["streak"]))
    steps: List[int] = state.setdefault("steps", [])
    steps.append(overflow)
    del steps[:-AMP_MAX_EPISODES]
    state["count"] = int(state.get("count", 0)) + 1
    if state.get("reported"):
        return [_amp_update(rank, state, overflow, span, time_ns, event_id)]
    episodes = [e for e in state["episodes"] if e[0] > overflow - span]
    consecutive = int(_cfg(settings, "amp_overflow_consecutive", AMP_OVERFLOW_CONSECUTIVE))
    need = int(_cfg(settings, "amp_overflow_episodes", AMP_OVERFLOW_EPISODES))
    if state["streak"] >= consecutive:
        rule, threshold, value = ("memory.amp_overflow.consecutive", float(consecutive),
                                  float(state["streak"]))
        start = state["episodes"][-1]
    elif len(episodes) >= need:
        rule, threshold, value = "memory.amp_overflow.episodes", float(need), float(len(episodes))
        start = episodes[0]
    else:
        return []
    state["reported"] = [rule, threshold, value, int(start[0]), int(start[1]) or time_ns]
    return [_amp_finding(rank, state, rule, threshold, value, int(start[0]), int(start[1]) or time_ns,
                         overflow, len(episodes), span, time_ns, event_id)]


def _amp_update(rank: RankState, state: Dict[str, Any], step: int, span: int, time_ns: int,
                event_id: str) -> Finding:
    """Refresh the open incident's evidence (scale trajectory, overflow steps) and title; no new count."""
    rule, threshold, value, first, first_ns = state["reported"]
    if rule.endswith("consecutive"):
        value = float(state["max_streak"])
    episodes = [e for e in state.get("episodes", []) if e[0] > step - span]
    return _amp_finding(rank, state, rule, threshold, value, first, first_ns, step, len(episodes), span,
                        time_ns, event_id, update=True)


def _amp_finding(rank: RankState, state: Dict[str, Any], rule: str, threshold: float, value: float,
                 first: int, first_ns: int, step: int, n_episodes: int, span: int, time_ns: int,
                 event_id: str, update: bool = False) -> Finding:
    """The finding that opens the incident, or (``update``) refreshes its evidence and title without
    counting a new signal (each later overflow: the scale trajectory keeps falling)."""
    trajectory = [{"step": s, "value": v} for s, v in state.get("trajectory", [])]
    lowest = float(state.get("lowest", math.nan))
    path = " -> ".join(fmt_number(v) for _s, v in state.get("trajectory", [])[:12])
    if rule.endswith("consecutive"):
        what = f"{int(value)} consecutive overflow steps (from step {first})"
    else:
        what = f"{n_episodes} separate overflow episodes within {span} steps"
    below_one = "; the scale is below 1: the gradients overflow fp16 even unscaled" if lowest < 1 else ""
    evidence = [
        Evidence(rule=rule, description=(f"{what}, each skipped by the GradScaler (threshold "
                                         f"{threshold:g}); {state.get('count', 0)} overflow steps so far"),
                 step=first, time_ns=first_ns, rank=rank.rank, metric="amp/overflow", threshold=threshold,
                 value=value, window=[{"step": s, "value": 1.0} for s in state.get("steps", [])[-32:]],
                 event_id=event_id),
        Evidence(rule="memory.amp_overflow.scale", description=(
            f"amp/scale trajectory (steps where it changed): {path}; lowest {fmt_number(lowest)}"
            f"{below_one}"), step=step, time_ns=time_ns, rank=rank.rank, metric="amp/scale",
            value=lowest, window=trajectory, event_id=event_id)]
    detail = f"scale down to {fmt_number(lowest)}, {what}"
    return Finding(
        "memory", "amp-overflow", AMP_KEY, rank.rank, first, first_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[] if update else [TimelineEntry(
            time_ns=time_ns, step=step, rank=rank.rank,
            what=f"rank {rank.rank}: GradScaler scale {fmt_number(lowest)} after {what}")],
        values={"detail": detail, "step": first, "value": fmt_number(lowest), "rank": rank.rank},
        counts=not update, replace_evidence=update, update_values=update,
        summary=(f"On rank {rank.rank}, the fp16 gradients overflow again and again ({what}); the GradScaler "
                 f"skips each such step and halves its scale, now {fmt_number(lowest)}. The NaN/Inf "
                 f"gradient norms on those steps are this, not a NaN source. Use bf16, or rescale the loss / "
                 f"targets (a loss in the 1e10 range overflows fp16 at any scale)."))
