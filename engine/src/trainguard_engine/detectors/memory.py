"""Memory detectors: allocator fragmentation, leaks, AMP (GradScaler) overflow collapse and other
processes' CUDA contexts (DESIGN §4). Pure and streaming; per-rank state in ``RankState.detectors["mem"]``
(plain JSON, bounded by the ``*_MAX_*`` constants). The rules are specified in docs/detectors.md (Memory).
"""

from __future__ import annotations

import math
import statistics
from typing import AbstractSet, Any, Dict, Final, List, Mapping, Optional, Sequence, Tuple

from trainguard.core.events import wire_float

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..robust import (
    MannKendall,
    bisect_left_of,
    bisect_right_of,
    kendall_tie_term,
    mann_kendall,
    mann_kendall_of,
    theil_sen,
)
from ..state import RankState, RunState, bounded_append
from . import fmt_duration, fmt_number
from .base import Detector, MetricBatch, MetricRun, RunFindings

STATE_KEY: Final = "mem"
"""``RankState.detectors`` key of this family's per-rank state."""
FRAG_KEY = "memory:fragmentation"
CONTEXT_LEAK_SEVERITY = {"high": "error", "medium": "warning"}
"""DESIGN §4's context-leak levels as incident severities."""
AMP_KEY = "memory:amp-overflow"
LEAK_KEY = "memory:leak"
CONTEXT_KEY = "memory:context-leak"

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
AMP_RESERVED_RATIO = 0.9
"""DESIGN §4: fp16 overflows with reserved above this share of capacity are a memory/amp-overflow."""
AMP_NEAR_CAPACITY_EPISODES = 2
"""Overflow episodes after the initial calibration, each starting with reserved > AMP_RESERVED_RATIO x
capacity, within AMP_OVERFLOW_WINDOW steps, that open memory/amp-overflow."""
FRAG_L2_RATE = 5e9
"""Fragmentation level 2: allocation rate above this, bytes per second of event time (DESIGN §4: 5 GB/s)."""
FRAG_L2_SPLIT_SHARE = 0.5
"""Fragmentation level 2: share of the free cached memory (reserved - active) in split blocks (free pieces
of partly used segments) at or above which 'few large free blocks' holds."""
LEAK_WINDOW = 48
"""Samples in the leak trend window (the last ones of the series)."""
LEAK_MIN_SAMPLES = 12
"""Fewest samples in a leak window."""
LEAK_SKIP_SAMPLES = 2
"""First samples of a series not judged: allocator warm-up, optimizer state created at the first step."""
LEAK_Z = 3.0
"""Mann-Kendall z the window's values must reach (one-sided p ~ 0.001)."""
LEAK_MIN_GROWTH_BYTES = float(64 * 2**20)
"""Least growth over the window (Theil-Sen slope x steps spanned), bytes."""
LEAK_MIN_GROWTH_RATIO = 0.1
"""Least growth over the window relative to the level at its start."""
LEAK_BLOCKS = 4
"""The window is split into this many blocks whose floors (minima) must each rise."""
LEAK_TAIL_Z = 3.0
"""Mann-Kendall z the window's last half must reach by itself (the whole window's bar, LEAK_Z): the growth
goes on to the window's end. A level shift -- host RSS stepping up once, when a rank's work per step grows,
then flat with its noise -- rises over the whole window (its block floors rise by the shift and the noise)
but not within its last half, where 6-10 noisy samples reach z 2.3 at most on the recorded straggler runs."""
LEAK_PEAK_RATIO = 2.0
"""(CUDA) the all-time peak may rise at most this many times as fast as allocated: faster means the
working set grows with the inputs, not a leak."""
LEAK_COARSE_EVERY = 8
"""Samples folded into one point (their median) of the coarse series that catches slow leaks."""
LEAK_MAX_DEVICES = 16
"""Most device series kept per rank."""
CONTEXT_LEAK_MEMORY_RATIO = 0.005
"""DESIGN §4: other processes' memory above this share of capacity is a context leak (medium)."""
CONTEXT_LEAK_ALLOWANCE = float(2**30)
"""Bytes of the device's used memory allowed for this process beyond its allocator's reserved memory
(its own CUDA context and non-allocator buffers) when NVML cannot attribute memory per process."""
CONTEXT_LEAK_SAMPLES = 2
"""Consecutive samples of one device showing other processes before memory/context-leak opens."""

GIB = float(2**30)
MIB = float(2**20)


def _cfg(settings: DetectionSettings, name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def rank_state(rank: RankState) -> Dict[str, Any]:
    """The family's state of ``rank``: ``frag`` (samples, streak, reported) and ``amp`` (streak,
    episodes, trajectory, reported)."""
    state: Dict[str, Any] = rank.detectors.setdefault(STATE_KEY, {})
    return state


def _num(value: Any) -> Optional[float]:
    if value is None:  # (what float() raises TypeError on, the commonest absent field: no exception raised)
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


# ----------------------------------------------------------------------------------------------------
# entry points


def on_memory(run: RunState, rank: RankState, payload: Mapping[str, Any], step: int, time_ns: int,
              event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one ``memory`` event (a MemorySnapshot payload) of ``rank``: leak (allocated or RSS
    series), context leak (other processes on the device), fragmentation; and the reserved / capacity
    ratio the AMP near-capacity rule reads."""
    family = rank_state(rank)
    family["events"] = True
    frag_state = family.setdefault("frag", {})
    ooms = int(_num(payload.get("num_ooms")) or 0)
    at_oom = ooms > int(frag_state.get("ooms", 0))
    device = str(payload.get("device") or "cpu")
    cuda = "reserved" in payload
    out: List[Finding] = []
    if cuda:
        reserved = _num(payload.get("reserved"))
        total = _num(payload.get("total_capacity"))
        if reserved is not None and total and total > 0:
            family["cap"] = [step, round(reserved / total, 6)]
        out.extend(_context(run, rank, payload, device, step, time_ns, event_id, settings))
        value = _num(payload.get("allocated"))
        if value is not None and not at_oom:
            out.extend(_leak_sample(rank, device, step, time_ns, event_id, settings, value,
                                    _num(payload.get("max_allocated")) or 0.0, payload, "allocated"))
    else:
        value = _num(payload.get("rss"))
        if value is not None and not at_oom:
            out.extend(_leak_sample(rank, device, step, time_ns, event_id, settings, value, 0.0, payload,
                                    "rss"))
    out.extend(_frag_memory(run, rank, frag_state, payload, step, time_ns, event_id, settings))
    return out


def _frag_memory(run: RunState, rank: RankState, state: Dict[str, Any], payload: Mapping[str, Any],
                 step: int, time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    """The fragmentation part of :func:`on_memory`."""
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
    l2 = _level2(state, payload, time_ns, reserved, active, settings)
    return _sample(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active, peak,
                   "memory", l2)


def on_metrics(run: RunState, rank: RankState, points: Sequence[Tuple[str, int, float]], step: int,
               time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (``points``: ``(name, step, value)``, as the pipeline's
    ``batch_points`` gives them; ``step`` the envelope's): ``amp/scale``/``amp/overflow`` and, for ranks
    that send no ``memory`` events, ``mem/fragmentation`` (with ``mem/reserved``/``mem/allocated`` and,
    when sent, ``mem/max_allocated``: the peak the headroom gate needs) and
    the leak series of ``mem/allocated`` (else ``mem/rss``), and the context-leak check from
    ``mem/device_used`` + ``mem/total_capacity`` (device-level memory, e.g. NVML's "used")."""
    return _judge(run, rank, {name: (s, v) for name, s, v in points}, step, time_ns, event_id, settings)


READS = frozenset(("amp/scale", "amp/overflow", "mem/allocated", "mem/rss", "mem/reserved",
                   "mem/max_allocated", "mem/device_used", "mem/total_capacity", "mem/fragmentation"))
"""Every metric name :func:`_judge` looks up (the others of a batch change nothing it does)."""


def _judge(run: RunState, rank: RankState, by_name: Mapping[str, Tuple[int, float]], step: int,
           time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    """:func:`on_metrics` on a batch as ``name -> (step, value)`` (the last point of each name; only the
    names in :data:`READS` matter)."""
    out: List[Finding] = []
    if "amp/scale" in by_name or "amp/overflow" in by_name:
        out.extend(_amp(run, rank, by_name, step, time_ns, event_id, settings))
    family = rank_state(rank)
    if not family.get("events"):
        for name in ("mem/allocated", "mem/rss"):
            if name in by_name and math.isfinite(by_name[name][1]):
                s, value = by_name[name]
                # no all-time peak among the metrics: reserved (the allocator's cache, sized by the
                # largest working set so far, never shrinking on its own) stands in for it
                reserved = by_name.get("mem/reserved", (s, 0.0))[1] if name == "mem/allocated" else 0.0
                out.extend(_leak_sample(rank, name, s, time_ns, event_id, settings, value,
                                        reserved if math.isfinite(reserved) else 0.0, {}, name))
                break
    if not family.get("events") and "mem/device_used" in by_name and "mem/total_capacity" in by_name:
        # device-level memory as metrics (a metrics file: NVML "used" and the GPU's capacity)
        s, used = by_name["mem/device_used"]
        context_payload = {"total_capacity": by_name["mem/total_capacity"][1],
                           "reserved": by_name.get("mem/reserved", (s, 0.0))[1],
                           "stats": {"device_used": used}}
        out.extend(_context(run, rank, context_payload, "gpu", s, time_ns, event_id, settings))
    frag_state = family.setdefault("frag", {}) if "mem/fragmentation" in by_name else None
    if frag_state is not None and not frag_state.get("events"):
        s, frag = by_name["mem/fragmentation"]
        reserved = by_name.get("mem/reserved", (s, math.nan))[1]
        allocated = by_name.get("mem/allocated", (s, math.nan))[1]
        if math.isfinite(frag) and math.isfinite(reserved) and reserved > 0:
            active = reserved * (1.0 - frag)
            max_allocated = by_name.get("mem/max_allocated", (s, math.nan))[1]
            peak = max(float(frag_state.get("peak", 0.0)), allocated if math.isfinite(allocated) else 0.0,
                       max_allocated if math.isfinite(max_allocated) else 0.0)
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


def _level2(state: Dict[str, Any], payload: Mapping[str, Any], time_ns: int, reserved: float,
            active: float, settings: DetectionSettings) -> Optional[Dict[str, float]]:
    """Level-2 measures of one snapshot (None when not measurable): ``rate`` = delta of the cumulative
    ``allocated_bytes.all.allocated`` / delta of event time since the previous sample (B/s), ``share`` =
    ``inactive_split_bytes.all.current`` / (reserved - active), ``holds`` = both above their thresholds."""
    stats = payload.get("stats")
    if not isinstance(stats, Mapping):
        return None
    cum = _num(stats.get("allocated_bytes.all.allocated"))
    if cum is None:
        return None
    prev = state.get("cum")
    if prev is not None and time_ns <= int(prev[0]):
        return None  # replayed or reordered: the rate needs time to move forward
    state["cum"] = [time_ns, cum]
    if prev is None or cum < float(prev[1]):
        return None  # first sample, or the counters were reset
    rate = (cum - float(prev[1])) / ((time_ns - int(prev[0])) / 1e9)
    split = _num(stats.get("inactive_split_bytes.all.current"))
    free = reserved - active
    share = min(1.0, split / free) if split is not None and free > 0 else 0.0
    holds = (rate > _cfg(settings, "frag_l2_rate", FRAG_L2_RATE)
             and share >= _cfg(settings, "frag_l2_split_share", FRAG_L2_SPLIT_SHARE))
    return {"rate": rate, "share": share, "holds": 1.0 if holds else 0.0}


def _sample(run: RunState, rank: RankState, state: Dict[str, Any], step: int, time_ns: int,
            event_id: str, settings: DetectionSettings, frag: float, reserved: float, active: float,
            peak: float, source: str, l2: Optional[Dict[str, float]] = None) -> List[Finding]:
    severe_t = _cfg(settings, "frag_severe", FRAG_SEVERE)
    sustain = int(_cfg(settings, "frag_sustain_samples", FRAG_SUSTAIN_SAMPLES))
    if l2 is not None and l2["holds"] and frag >= _cfg(settings, "frag_mild", FRAG_MILD):
        if not state.get("l2_streak"):
            state["l2_since"] = [step, time_ns]
        state["l2_streak"] = int(state.get("l2_streak", 0)) + 1
        state["l2_last"] = [round(l2["rate"], 3), round(l2["share"], 6)]
    elif l2 is not None:
        state["l2_streak"] = 0
    level2 = int(state.get("l2_streak", 0)) >= sustain
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
        new_l2 = level2 and not state.get("l2_reported")
        if not new_l2 and frag < float(state.get("reported_frag", 1.0)) + _cfg(
                settings, "frag_update_step", FRAG_UPDATE_STEP):
            return []
        state["reported_frag"] = max(frag, float(state.get("reported_frag", 0.0)))
        state["l2_reported"] = bool(state.get("l2_reported")) or level2
        warn, std, span_s, n = _early_warning(samples, time_ns, frag, settings)
        severe = state["streak"] >= sustain
        return [_frag_finding(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active,
                              headroom, severe, warn, std, span_s, n, source, update=True, level2=level2)]
    gate = headroom >= _cfg(settings, "frag_peak_headroom", FRAG_PEAK_HEADROOM)
    if not gate:
        return []
    severe = state["streak"] >= sustain
    warn, std, span_s, n = _early_warning(samples, time_ns, frag, settings)
    if not (severe or warn or level2):
        return []
    state["reported"], state["reported_frag"], state["l2_reported"] = True, frag, level2
    return [_frag_finding(run, rank, state, step, time_ns, event_id, settings, frag, reserved, active,
                          headroom, severe, warn, std, span_s, n, source, level2=level2)]


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
                  source: str, update: bool = False, level2: bool = False) -> Finding:
    """The finding that opens the incident, or (``update``) refreshes its evidence and title."""
    window_s = float(_cfg(settings, "frag_window_s", FRAG_WINDOW_S))
    severe_t = _cfg(settings, "frag_severe", FRAG_SEVERE)
    since = int(state["since"]) if severe and "since" in state else step
    since_ns = int(state.get("since_ns") or time_ns) if severe else time_ns
    if level2 and not severe:
        since, since_ns = int(state["l2_since"][0]), int(state["l2_since"][1]) or time_ns
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
    if level2:
        rate, share = (float(x) for x in state["l2_last"])
        l2_step, l2_ns = (int(x) for x in state["l2_since"])
        evidence.append(Evidence(
            rule="memory.fragmentation.level2",
            description=(f"allocation rate {rate / 1e9:.2f} GB/s > "
                         f"{_cfg(settings, 'frag_l2_rate', FRAG_L2_RATE) / 1e9:g} GB/s with {share:.0%} of "
                         f"the free cached memory in split blocks (>= "
                         f"{_cfg(settings, 'frag_l2_split_share', FRAG_L2_SPLIT_SHARE):.0%}: few large free "
                         f"blocks) on {state['l2_streak']} samples in a row since step {l2_step}"),
            step=l2_step, time_ns=l2_ns, rank=rank.rank, metric="allocated_bytes.all.allocated",
            threshold=_cfg(settings, "frag_l2_rate", FRAG_L2_RATE), value=round(rate, 3), event_id=event_id))
    if (warn or not severe) and not (level2 and not warn):
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
    lvl = "severe" if severe else "level 2" if level2 else "early warning"
    if level2 and severe:
        lvl = "severe, level 2"
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
    if flag_pt is None and scale_pt is not None and _amp_steady(state, scale_pt):
        return []
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
    if overflow is None:
        if flag_pt is not None or (scale_pt is not None and not state.get("flag")):
            state["streak"] = 0
        if new_low and state.get("reported"):  # the halving that follows an overflow: a new lowest scale
            span = int(_cfg(settings, "amp_overflow_window", AMP_OVERFLOW_WINDOW))
            return [_amp_update(rank, state, s, span, time_ns, event_id)]
        return []
    span = int(_cfg(settings, "amp_overflow_window", AMP_OVERFLOW_WINDOW))
    if state.get("streak") and overflow == int(state.get("prev_of", -2)) + 1:
        state["streak"] = int(state["streak"]) + 1
    else:
        state["streak"] = 1
        cap = rank_state(rank).get("cap")  # [step, reserved / capacity] of the last memory sample
        state.setdefault("episodes", []).append([overflow, time_ns, float(cap[1]) if cap else -1.0])
        del state["episodes"][:-AMP_MAX_EPISODES]
        if "first_ep" not in state:
            state["first_ep"] = overflow  # the fresh scaler's calibration
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
        ratio_t = float(_cfg(settings, "amp_reserved_ratio", AMP_RESERVED_RATIO))
        near = [e for e in episodes
                if len(e) > 2 and e[2] > ratio_t and e[0] != int(state.get("first_ep", -1))]
        need_near = int(_cfg(settings, "amp_near_capacity_episodes", AMP_NEAR_CAPACITY_EPISODES))
        if len(near) < need_near:
            return []
        rule, threshold, value = "memory.amp_overflow.near_capacity", float(need_near), float(len(near))
        start = near[0]
        state["near"] = [[int(e[0]), round(float(e[2]), 6)] for e in near[-AMP_MAX_TRAJECTORY:]]
        state["near_t"] = ratio_t
    state["reported"] = [rule, threshold, value, int(start[0]), int(start[1]) or time_ns]
    return [_amp_finding(rank, state, rule, threshold, value, int(start[0]), int(start[1]) or time_ns,
                         overflow, len(episodes), span, time_ns, event_id)]


def _amp_steady(state: Dict[str, Any], scale_pt: Tuple[int, float]) -> bool:
    """:func:`_amp` on a batch with a scale point and no overflow flag, in short, for the usual point -- the
    scale as before (``state["scale"]``), not under the lowest kept, no flag ever sent, a new step: True
    after doing what :func:`_amp` does with it (no trajectory entry: the same scale; no halving: the kept
    scale is finite and > 0, so the value is over half of itself; no new lowest; the streak reset; nothing
    to report), the same state writes in the same order; False (nothing done) otherwise."""
    s, value = scale_pt
    prev, lowest = state.get("scale"), state.get("lowest")
    if prev is None or value != prev[1] or lowest is None or value < float(lowest) or state.get("flag") or \
            s <= int(state.get("last", -1)):
        return False
    state["last"] = s
    state["scale"] = [s, value]
    state["lowest"] = min(float(lowest), value)
    state["streak"] = 0
    return True


def _steady_column(rank: RankState, batches: Sequence[MetricBatch], first: int, scale_pt: Tuple[int, float]
                   ) -> int:
    """:func:`_judge` on ``batches[first:]`` for as long as each is what :func:`_amp_steady` takes -- its
    only point of :data:`READS` is ``amp/scale`` (``scale_pt``: ``batches[first]``'s), the scale kept, not
    under the lowest, no flag ever sent, a later step than the last -- folded as a column: how many batches
    were taken (0: not even ``first``, nothing written). On each such batch _judge makes only _amp_steady's
    writes (the rest of the rule needs other points) and finds nothing; the scale each compares with is the
    one the batch before kept (the same value: each equals it), the lowest and the flag are not written, so
    the state after them is _amp_steady's writes of the last one alone, made once here in the same order:
    ``last``, ``scale`` (the last batch's step and value), ``lowest`` (``min`` of the kept lowest and that
    value, as written), ``streak``. A state without an AMP part takes the whole rule (which makes one)."""
    family = rank.detectors.get(STATE_KEY)
    state = family.get("amp") if family is not None else None
    if state is None:
        return 0
    s, value = scale_pt
    prev, lowest = state.get("scale"), state.get("lowest")
    if prev is None or value != prev[1] or lowest is None or value < float(lowest) or state.get("flag") or \
            s <= int(state.get("last", -1)):  # (_amp_steady's test, in its order)
        return 0
    kept, low = prev[1], float(lowest)
    reads = READS
    k, n = first + 1, len(batches)
    while k < n:  # the next batch: its last amp/scale point (as _judge's dict keeps it), no other point read
        point: Optional[Tuple[int, float]] = None
        for name, s_k, v_k in batches[k].points:
            if name in reads:
                if name != "amp/scale":
                    break
                point = (s_k, v_k)
        else:
            if point is not None and point[1] == kept and not point[1] < low and point[0] > int(s):
                s, value = point
                k += 1
                continue
        break
    state["last"] = s
    state["scale"] = [s, value]
    state["lowest"] = min(low, value)
    state["streak"] = 0
    return k - first


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
    elif rule.endswith("near_capacity"):
        what = (f"{int(value)} overflow episodes after the scaler's calibration with reserved > "
                f"{float(state.get('near_t', AMP_RESERVED_RATIO)):.0%} of capacity within {span} steps")
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
            value=lowest if math.isfinite(lowest) else None,  # None: no scale reported yet
            window=trajectory, event_id=event_id)]
    if state.get("near"):
        near = state["near"]
        shares = ", ".join(f"step {s} {r:.1%}" for s, r in near[:8])
        evidence.append(Evidence(
            rule="memory.amp_overflow.reserved", description=(
                f"reserved / capacity at the start of each post-calibration overflow episode: {shares} "
                f"(> {float(state.get('near_t', AMP_RESERVED_RATIO)):.0%}): the fp16 overflows happen "
                f"with the device's memory almost full"),
            step=int(near[0][0]), time_ns=first_ns, rank=rank.rank, metric="reserved/total_capacity",
            threshold=float(state.get("near_t", AMP_RESERVED_RATIO)), value=float(near[-1][1]),
            window=[{"step": s, "value": r} for s, r in near], event_id=event_id))
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


# ----------------------------------------------------------------------------------------------------
# leak


def _fmt_bytes(n: float) -> str:
    """``"1.25 GiB"``, ``"37.4 MiB"``, ``"512 KiB"`` (sign kept)."""
    size = abs(n)
    if size >= GIB:
        text = f"{size / GIB:.2f} GiB"
    elif size >= MIB:
        text = f"{size / MIB:.1f} MiB"
    else:
        text = f"{size / 1024:.0f} KiB"
    return ("-" if n < 0 else "") + text


def _blocks(values: Sequence[float], k: int) -> List[List[float]]:
    """``values`` cut into ``k`` consecutive blocks of (almost) equal size."""
    n = len(values)
    k = max(1, min(k, n))
    return [list(values[i * n // k:(i + 1) * n // k]) for i in range(k)]


def leak_test(points: Sequence[Sequence[float]], settings: DetectionSettings,
              use_peak: bool, trend: Optional[MannKendall] = None) -> Optional[Dict[str, Any]]:
    """The leak rules (module docstring) on ``points`` = ``[step, time_ns, value, peak]`` in step order;
    None unless every rule holds, else the figures: ``z``, ``slope`` (bytes/step), ``growth``, ``need``
    (the growth threshold), ``floors``, ``peak_slope`` (None when not judged) and ``onset`` (index of the
    first point of the growth). ``trend``: the Mann-Kendall test of the points' values when the caller keeps
    it (:class:`_SlidingTrend`): the usual answer -- no rising trend, None whatever the steps say -- is then
    given without reading the points; past it everything is computed from the points, as without."""
    n = len(points)
    if n < int(_cfg(settings, "leak_min_samples", LEAK_MIN_SAMPLES)):
        return None
    if trend is not None and trend.z < _cfg(settings, "leak_z", LEAK_Z):
        return None
    xs = [float(p[0]) for p in points]
    ys = [float(p[2]) for p in points]
    if xs[-1] <= xs[0]:
        return None
    mk = mann_kendall(ys)
    if mk.z < _cfg(settings, "leak_z", LEAK_Z):
        return None
    slope, _intercept = theil_sen(xs, ys)
    growth = slope * (xs[-1] - xs[0])
    floors = [min(b) for b in _blocks(ys, int(_cfg(settings, "leak_blocks", LEAK_BLOCKS)))]
    need = max(float(_cfg(settings, "leak_min_growth_bytes", LEAK_MIN_GROWTH_BYTES)),
               float(_cfg(settings, "leak_min_growth_ratio", LEAK_MIN_GROWTH_RATIO)) * max(0.0, floors[0]))
    if growth < need or any(b <= a for a, b in zip(floors, floors[1:])):
        return None
    tail_z = mann_kendall(ys[n // 2:]).z
    if tail_z < float(_cfg(settings, "leak_tail_z", LEAK_TAIL_Z)):
        return None  # grew once, then stopped: a level shift, not a leak
    peak_slope: Optional[float] = None
    peaks = [float(p[3]) for p in points]
    if use_peak and all(pk > 0 for pk in peaks):
        peak_slope = theil_sen(xs, peaks)[0]
        if peak_slope > float(_cfg(settings, "leak_peak_ratio", LEAK_PEAK_RATIO)) * slope:
            return None  # the working set grows with the inputs: not a leak
    onset = max(i for i, y in enumerate(ys) if y <= floors[0])
    return {"z": mk.z, "slope": slope, "growth": growth, "need": need, "floors": floors,
            "peak_slope": peak_slope, "onset": onset, "tail_z": tail_z}


class _SlidingTrend:
    """The Mann-Kendall S and tie correction of a leak series' ``fine`` window (the values of its points, in
    order), kept as the window slides -- a point appended, the oldest dropped, the newest replaced -- so a
    sample costs a few bisections instead of the whole test (robust.mann_kendall_of: the same integers, so
    the same floats). Derived (:attr:`RankState.derived`), never serialized: valid while ``fine`` is the
    series' list and ``values`` as long as it (only :func:`_leak_sample` changes it, and updates this in
    step); else built again from the points. Finite values only (``_num`` reads nothing else)."""

    def __init__(self, fine: List[List[Any]]) -> None:
        self.fine = fine
        self.values: List[float] = []
        self.ordered: List[float] = []
        self.counts: Dict[float, int] = {}
        self.s = 0
        self.ties = 0
        for p in fine:
            self.append(float(p[2]))

    def append(self, y: float) -> None:
        ordered = self.ordered
        below = bisect_left_of(ordered, y)
        self.s += below - (len(ordered) - bisect_right_of(ordered, y, below))
        ordered.insert(below, y)
        self.values.append(y)
        c = self.counts.get(y, 0)
        self.counts[y] = c + 1
        self.ties += kendall_tie_term(c + 1) - kendall_tie_term(c)

    def _forget(self, y: float) -> None:
        ordered = self.ordered
        del ordered[bisect_left_of(ordered, y)]
        c = self.counts[y]
        if c > 1:
            self.counts[y] = c - 1
        else:
            del self.counts[y]
        self.ties += kendall_tie_term(c - 1) - kendall_tie_term(c)

    def drop_first(self) -> None:
        y = self.values.pop(0)
        self._forget(y)
        ordered = self.ordered  # its pairs with every later value: sign(later - y)
        below = bisect_left_of(ordered, y)
        self.s -= (len(ordered) - bisect_right_of(ordered, y, below)) - below

    def drop_last(self) -> None:
        y = self.values.pop()
        self._forget(y)
        ordered = self.ordered  # its pairs with every earlier value: sign(y - earlier)
        below = bisect_left_of(ordered, y)
        self.s -= below - (len(ordered) - bisect_right_of(ordered, y, below))

    def test(self) -> MannKendall:
        return mann_kendall_of(len(self.values), self.s, self.ties)


_TREND_KEY = "memory.leak.trend"
"""Key of the leak series' :class:`_SlidingTrend` s (per device) in :attr:`RankState.derived`."""


def _kept_trend(rank: RankState, device: str, fine: List[List[Any]]) -> Optional[_SlidingTrend]:
    """The :class:`_SlidingTrend` of ``device``'s ``fine`` window when it is current, else None."""
    kept = rank.derived.get(_TREND_KEY)
    trend = kept.get(device) if kept is not None else None
    if trend is not None and trend.fine is fine and len(trend.values) == len(fine):
        return trend
    return None


def _new_trend(rank: RankState, device: str, fine: List[List[Any]]) -> Optional[_SlidingTrend]:
    """A :class:`_SlidingTrend` of ``fine`` kept for ``device`` (None, none kept: a non-finite value)."""
    kept = rank.derived.get(_TREND_KEY)
    if kept is None:
        kept = rank.derived[_TREND_KEY] = {}
    for p in fine:
        y = float(p[2])
        if y - y != 0.0:
            kept.pop(device, None)
            return None
    trend = kept[device] = _SlidingTrend(fine)
    return trend


def _leak_sample(rank: RankState, device: str, step: int, time_ns: int, event_id: str,
                 settings: DetectionSettings, value: float, peak: float, payload: Mapping[str, Any],
                 source: str) -> List[Finding]:
    """Fold one sample of ``device``'s series (``source``: allocated, rss, mem/allocated, mem/rss)."""
    family = rank_state(rank).setdefault("leak", {})
    series = family.get(device)
    if series is None:
        if len(family) >= LEAK_MAX_DEVICES:
            return []
        series = family[device] = {"n": 0, "fine": [], "acc": [], "coarse": []}
    last = series.get("last")
    if last is not None and (step < int(last[0]) or (step == int(last[0]) and time_ns <= int(last[1]))):
        return []  # replayed or reordered: never judged twice
    series["last"] = [step, time_ns]
    series["n"] = int(series["n"]) + 1
    if series["n"] <= int(_cfg(settings, "leak_skip_samples", LEAK_SKIP_SAMPLES)):
        return []
    window_n = int(_cfg(settings, "leak_window", LEAK_WINDOW))
    point = [step, time_ns, value, peak]
    fine: List[List[Any]] = series["fine"]
    acc: List[List[Any]] = series["acc"]
    trend = _kept_trend(rank, device, fine)  # (kept in step with fine below)
    if trend is not None and value - value != 0.0:
        trend = None
    if fine and int(fine[-1][0]) == step:  # a second sample of one step: the later one stands
        fine[-1] = point
        if trend is not None:
            trend.drop_last()
            trend.append(float(value))
        if acc and int(acc[-1][0]) == step:
            acc[-1] = point
    else:
        fine.append(point)
        del fine[:-window_n]
        if trend is not None:
            trend.append(float(value))
            while len(trend.values) > len(fine):
                trend.drop_first()
        acc.append(point)
        if len(acc) >= int(_cfg(settings, "leak_coarse_every", LEAK_COARSE_EVERY)):
            values = sorted(float(p[2]) for p in acc)
            series["coarse"].append([acc[0][0], acc[0][1], values[len(values) // 2],
                                     max(float(p[3]) for p in acc)])
            del series["coarse"][:-window_n]
            acc.clear()
    if trend is None:
        trend = _new_trend(rank, device, fine)
    use_peak = source in ("allocated", "mem/allocated")
    kept = trend.test() if trend is not None else None
    verdict, points, scale = leak_test(fine, settings, use_peak, kept), fine, "samples"
    if verdict is None:
        verdict, points, scale = leak_test(series["coarse"], settings, use_peak), series["coarse"], "coarse"
    reported = series.get("reported")
    if reported is not None:
        if verdict is None or value - float(reported[2]) < float(
                _cfg(settings, "leak_min_growth_bytes", LEAK_MIN_GROWTH_BYTES)):
            return []
        series["reported"] = [reported[0], reported[1], value]
        return [_leak_finding(rank, device, int(reported[0]), int(reported[1]), step, time_ns, event_id,
                              settings, value, payload, source, verdict, points, scale, update=True)]
    if verdict is None:
        return []
    onset = points[int(verdict["onset"])]
    first, first_ns = int(onset[0]), int(onset[1]) or time_ns
    series["reported"] = [first, first_ns, value]
    return [_leak_finding(rank, device, first, first_ns, step, time_ns, event_id, settings, value, payload,
                          source, verdict, points, scale)]


def _leak_finding(rank: RankState, device: str, first: int, first_ns: int, step: int, time_ns: int,
                  event_id: str, settings: DetectionSettings, value: float, payload: Mapping[str, Any],
                  source: str, verdict: Mapping[str, Any], points: Sequence[Sequence[Any]], scale: str,
                  update: bool = False) -> Finding:
    slope, growth, need = float(verdict["slope"]), float(verdict["growth"]), float(verdict["need"])
    floors = [float(f) for f in verdict["floors"]]
    metric = source if source.startswith("mem/") else f"memory.{source}"
    host = source in ("rss", "mem/rss")
    what = "host RSS" if host else f"allocated device memory ({device})"
    most = int(_cfg(settings, "evidence_window", 20))
    shown = [{"step": int(p[0]), "value": float(p[2])} for p in points]
    if len(shown) > most:
        shown = shown[:most // 2] + shown[-(most - most // 2):]
    span = int(points[-1][0]) - int(points[0][0])
    unit = "samples" if scale == "samples" else f"coarse points (medians of "\
        f"{int(_cfg(settings, 'leak_coarse_every', LEAK_COARSE_EVERY))} samples)"
    min_bytes = float(_cfg(settings, "leak_min_growth_bytes", LEAK_MIN_GROWTH_BYTES))
    min_ratio = float(_cfg(settings, "leak_min_growth_ratio", LEAK_MIN_GROWTH_RATIO))
    evidence = [
        Evidence(rule="memory.leak.trend", description=(
            f"{what} rises over the last {len(points)} {unit} (steps {int(points[0][0])}-"
            f"{int(points[-1][0])}): Mann-Kendall z = {float(verdict['z']):.2f} >= "
            f"{float(_cfg(settings, 'leak_z', LEAK_Z)):g}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric=metric,
            threshold=float(_cfg(settings, "leak_z", LEAK_Z)), value=round(float(verdict["z"]), 4),
            window=shown, event_id=event_id),
        Evidence(rule="memory.leak.growth", description=(
            f"Theil-Sen slope {_fmt_bytes(slope)}/step: {_fmt_bytes(growth)} over {span} steps >= "
            f"{_fmt_bytes(need)} (max of {_fmt_bytes(min_bytes)} and {min_ratio:.0%} of the level at the "
            f"window's start, {_fmt_bytes(floors[0])}); now {_fmt_bytes(value)}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric=metric, threshold=round(need, 3),
            value=round(growth, 3), window=shown, event_id=event_id),
        Evidence(rule="memory.leak.steady", description=(
            f"the floor (minimum) of each of {len(floors)} consecutive blocks of the window rises: "
            f"{' < '.join(_fmt_bytes(f) for f in floors)} -- kept memory never comes back"),
            step=first, time_ns=first_ns, rank=rank.rank, metric=metric,
            value=round(floors[-1] - floors[0], 3),
            window=[{"step": int(points[i * len(points) // len(floors)][0]), "value": f}
                    for i, f in enumerate(floors)], event_id=event_id)]
    if verdict.get("peak_slope") is not None:
        ratio = float(_cfg(settings, "leak_peak_ratio", LEAK_PEAK_RATIO))
        peak_name = "the all-time peak" if source == "allocated" else "reserved (standing in for the peak)"
        evidence.append(Evidence(rule="memory.leak.working_set", description=(
            f"{peak_name} rises {_fmt_bytes(float(verdict['peak_slope']))}/step <= {ratio:g} x the "
            f"allocated slope: what a step needs does not grow faster than what it keeps (not larger "
            f"inputs)"),
            step=step, time_ns=time_ns, rank=rank.rank,
            metric="memory.max_allocated" if source == "allocated" else "mem/reserved", threshold=ratio,
            value=round(float(verdict["peak_slope"]) / slope, 4) if slope > 0 else 0.0, event_id=event_id))
    projection = ""
    steps_left: Optional[float] = None
    capacity = _num(payload.get("total_capacity")) if not host else None
    if capacity and slope > 0:
        room = capacity - value
        free, reserved = _num(payload.get("free")), _num(payload.get("reserved"))
        if free is not None and reserved is not None:
            room = min(room, free + max(0.0, reserved - value))
        steps_left = max(0.0, room) / slope
        projection = f"; at this rate the device's {_fmt_bytes(capacity)} run out in ~{steps_left:,.0f} steps"
        evidence.append(Evidence(rule="memory.leak.projection", description=(
            f"{_fmt_bytes(max(0.0, room))} left on the device (capacity {_fmt_bytes(capacity)}, "
            f"allocated {_fmt_bytes(value)}) / {_fmt_bytes(slope)} per step = ~{steps_left:,.0f} steps "
            f"until an out-of-memory error"),
            step=step, time_ns=time_ns, rank=rank.rank, metric=metric, threshold=round(capacity, 3),
            value=round(steps_left, 1), event_id=event_id))
    rate = f"{_fmt_bytes(slope)}/step"
    values = {"step": first, "rank": rank.rank, "device": device, "rate": rate, "what": what,
              "value": _fmt_bytes(value), "detail": f"{what} +{rate}",
              "steps_left": "" if steps_left is None else f"{steps_left:,.0f}"}
    cause = ("Host memory that grows per step: tensors kept with their graph (a loss or metric summed "
             "without .item()/.detach(), or computed outside torch.no_grad()), growing Python lists or "
             "caches, DataLoader workers' copy-on-write" if host else
             "Tensors kept on the device across steps: outputs or losses appended to a list (with their "
             "graph unless detached), autograd.grad results not detached, a cache that never evicts")
    return Finding(
        "memory", "leak", LEAK_KEY, rank.rank, first, first_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[] if update else [TimelineEntry(
            time_ns=time_ns, step=step, rank=rank.rank,
            what=f"rank {rank.rank}: {what} growing {rate} since step {first} ({_fmt_bytes(value)} now)")],
        values=values, counts=not update, replace_evidence=update, update_values=update,
        summary=(f"On rank {rank.rank}, {what} has grown steadily since step {first}: {rate} "
                 f"({_fmt_bytes(growth)} over {span} steps, now {_fmt_bytes(value)}){projection}. {cause}."))


# ----------------------------------------------------------------------------------------------------
# context leak (other processes' contexts and memory on this rank's GPU)


def _context(run: RunState, rank: RankState, payload: Mapping[str, Any], device: str, step: int,
             time_ns: int, event_id: str, settings: DetectionSettings) -> List[Finding]:
    total = _num(payload.get("total_capacity"))
    if not total or total <= 0:
        return []
    stats = payload.get("stats") if isinstance(payload.get("stats"), Mapping) else {}
    assert isinstance(stats, Mapping)
    used = _num(stats.get("device_used"))
    if used is None:
        free = _num(payload.get("free"))
        used = total - free if free is not None else None
    reserved = _num(payload.get("reserved")) or 0.0
    contexts = int(_num(stats.get("nvml_other_processes")) or 0)
    listed = _num(stats.get("nvml_processes"))
    own_found = (_num(stats.get("nvml_own_found")) or 0.0) >= 0.5
    allowance = float(_cfg(settings, "context_leak_allowance", CONTEXT_LEAK_ALLOWANCE))
    other: Optional[float] = None
    source = ""
    nvml_other = _num(stats.get("nvml_other_bytes"))
    if own_found and nvml_other is not None:
        other, source = nvml_other, "nvml"
    elif used is not None:
        other, source = max(0.0, used - reserved - allowance), "driver"
    if other is None and listed is None:
        return []  # neither the driver's free memory nor NVML: not measurable
    ratio_t = float(_cfg(settings, "context_leak_memory_ratio", CONTEXT_LEAK_MEMORY_RATIO))
    high = contexts > 0
    medium = other is not None and other > ratio_t * total
    family = rank_state(rank).setdefault("ctx", {})
    if device not in family and len(family) >= LEAK_MAX_DEVICES:
        return []
    st = family.setdefault(device, {})
    last = st.get("last")
    if last is not None and (step < int(last[0]) or (step == int(last[0]) and time_ns <= int(last[1]))):
        return []  # replayed or reordered
    st["last"] = [step, time_ns]
    if not (high or medium):
        st["streak"] = 0
        return []
    if not st.get("streak"):
        st["since"] = [step, time_ns]
    st["streak"] = int(st.get("streak", 0)) + 1
    level = "high" if high else "medium"
    reported = st.get("reported")
    if reported:
        if reported == "medium" and level == "high":
            st["reported"] = level
            return [_context_finding(rank, device, st, step, time_ns, event_id, settings, total, used,
                                     reserved, other, source, contexts, listed, own_found, level, True)]
        return []
    if int(st["streak"]) < int(_cfg(settings, "context_leak_samples", CONTEXT_LEAK_SAMPLES)):
        return []
    st["reported"] = level
    return [_context_finding(rank, device, st, step, time_ns, event_id, settings, total, used, reserved,
                             other, source, contexts, listed, own_found, level, False)]


def _context_finding(rank: RankState, device: str, st: Mapping[str, Any], step: int, time_ns: int,
                     event_id: str, settings: DetectionSettings, total: float, used: Optional[float],
                     reserved: float, other: Optional[float], source: str, contexts: int,
                     listed: Optional[float], own_found: bool, level: str, update: bool) -> Finding:
    first, first_ns = int(st["since"][0]), int(st["since"][1]) or time_ns
    ratio_t = float(_cfg(settings, "context_leak_memory_ratio", CONTEXT_LEAK_MEMORY_RATIO))
    allowance = float(_cfg(settings, "context_leak_allowance", CONTEXT_LEAK_ALLOWANCE))
    samples = int(st["streak"])
    evidence: List[Evidence] = []
    if contexts > 0:
        evidence.append(Evidence(
            rule="memory.context_leak.contexts", description=(
                f"NVML lists {int(listed or 0)} compute processes with a context on {device}; "
                f"{contexts} of them not this rank's process"
                + ("" if own_found else " (this process's id is not in the list -- another PID namespace -- "
                                        "so it is taken to be one of them)")
                + f" (> 0: high); on {samples} samples since step {first}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric="nvml_other_processes", threshold=0.0,
            value=float(contexts), event_id=event_id))
    if other is not None:
        share = other / total
        if source == "nvml":
            how = f"NVML attributes {_fmt_bytes(other)} of {device} to other processes"
        else:
            how = (f"{device}: used {_fmt_bytes(used or 0.0)} (total - free, every process) - reserved by "
                   f"this process's allocator {_fmt_bytes(reserved)} - allowance for its own context and "
                   f"non-allocator buffers {_fmt_bytes(allowance)} = {_fmt_bytes(other)} held by other "
                   f"processes")
        evidence.append(Evidence(
            rule="memory.context_leak.memory", description=(
                f"{how}: {share:.2%} of the {_fmt_bytes(total)} capacity "
                f"{'>' if share > ratio_t else '<='} {ratio_t:.1%} (medium); on {samples} samples since "
                f"step {first}"),
            step=first, time_ns=first_ns, rank=rank.rank, metric="device_used", threshold=ratio_t,
            value=wire_float(round(share, 6)), event_id=event_id))  # a capacity of ~0 overflows it
    held = _fmt_bytes(other) if other is not None and other > ratio_t * total else ""
    parts = [p for p in (held, f"{contexts} other CUDA context{'s' if contexts != 1 else ''}"
                         if contexts > 0 else "") if p]
    detail = " and ".join(parts)
    return Finding(
        "memory", "context-leak", CONTEXT_KEY, rank.rank, first, first_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[] if update else [TimelineEntry(
            time_ns=first_ns, step=first, rank=rank.rank,
            what=f"rank {rank.rank}: other processes hold {detail} on {device} ({level})")],
        values={"step": first, "rank": rank.rank, "device": device, "level": level, "detail": detail,
                "value": _fmt_bytes(other) if other is not None else ""},
        counts=not update, replace_evidence=update, update_values=update,
        severity=CONTEXT_LEAK_SEVERITY.get(level, ""),
        summary=(f"When rank {rank.rank} ran on {device}, other processes already held {detail} of it "
                 f"({level}): typically a previous job's leftover process (an orphaned DataLoader "
                 f"worker or spawned child still holding its CUDA context), or other ranks opening a context "
                 f"on this GPU (torch.cuda.set_device missing). `nvidia-smi` lists them; end them, or reset "
                 f"the GPU if none is listed but memory is held."))


class Memory(Detector):
    """Device and host memory: fragmentation, leaks, AMP overflow, other processes' contexts -- from
    ``memory`` events (:func:`on_memory`) and, for ranks that send none, from ``mem/*`` metrics
    (:func:`on_metrics`)."""

    name = "memory"
    kinds: Tuple[str, ...] = ("memory/fragmentation", "memory/leak", "memory/amp-overflow",
                              "memory/context-leak")
    section = "memory"
    names_only = True
    independent = True  # on_metrics reads the batch, rank.rank/host and rank.detectors["mem"] only
    METRICS = frozenset(("amp/scale", "amp/overflow", "mem/allocated", "mem/rss", "mem/device_used",
                         "mem/total_capacity", "mem/fragmentation"))
    """The metric names :func:`on_metrics` reads (every one of its checks starts from one of them)."""

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return not names.isdisjoint(self.METRICS)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch.points, batch.step, batch.time_ns, batch.event_id, settings)

    def on_metric_run(self, run: RunState, rank: RankState, batches: MetricRun,
                      settings: DetectionSettings) -> RunFindings:
        """:meth:`on_metrics` on each batch in turn, reading only the points :func:`_judge` looks up; a
        stretch of batches whose only such point is a steady GradScaler scale (:func:`_amp_steady` would take
        each) is folded as a column (:func:`_steady_column`)."""
        out: List[Sequence[Finding]] = []
        reads = READS
        items = batches.batches
        i, n = 0, len(items)
        try:
            while i < n:
                batch = items[i]
                by_name = {name: (s, v) for name, s, v in batch.points if name in reads}
                if len(by_name) == 1 and "amp/scale" in by_name:
                    taken = _steady_column(rank, items, i, by_name["amp/scale"])
                    if taken:
                        out.extend([] for _ in range(taken))
                        i += taken
                        continue
                out.append(_judge(run, rank, by_name, batch.step, batch.time_ns, batch.event_id, settings))
                i += 1
        except Exception as exc:  # re-raised by the pipeline at that envelope's place
            return RunFindings(out, exc)
        return RunFindings(out, None)

    def on_memory(self, run: RunState, rank: RankState, payload: Mapping[str, Any], batch: MetricBatch,
                  settings: DetectionSettings) -> List[Finding]:
        return on_memory(run, rank, payload, batch.step, batch.time_ns, batch.event_id, settings)
