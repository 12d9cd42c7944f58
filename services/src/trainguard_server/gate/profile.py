"""A baseline's profile: what a set of healthy runs looks like, summarised from data already fetched
(no I/O here; ``gate.fetch`` reads the stores).

Contract of :func:`build_profile`: given the fetched :class:`RunData` of the baseline's runs and a policy,
return a :class:`Profile` holding

- the runs used and those left out with the reason (status not in ``baseline.statuses``, no steps);
- incident counts per kind (``category/subtype``) and their rate per 1,000 steps over all used runs;
- every stack fingerprint seen (incidents' and captured exceptions', handled or not);
- the loss envelope at matched steps: each run's loss transformed (log for a positive loss), smoothed by
  a running median of ``loss.smooth_window`` steps, read at a grid of at most ``loss.grid_points`` steps
  of the runs' common range; per grid step the median across runs (the centre), the between-run scale
  (pairwise differences of the smoothed curves pooled over ``loss.pool_window`` grid steps, see
  ``gate.stats``), the within-run noise (running MAD of each run's residual around its smoothed curve,
  median across runs), and the runs' min/max (for plots);
- step-time and peak-memory distributions: one value per run (the 10th percentile of ``time/step_s``:
  what the code costs when the machine is not busy elsewhere; the maximum of the first memory metric every
  run reports), their median and pairwise scale.

The profile is plain data (``to_dict``/``from_dict``) so it is stored once when a baseline is defined and
compared later, even after the runs' metrics have expired.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import stats
from .policy import Policy

PROFILE_VERSION = 1
Series = List[Tuple[float, float]]  # (step, value); value may be NaN or +-inf


@dataclass
class IncidentBrief:
    """What the gate needs of one incident."""

    kind: str                  # "category/subtype"
    severity: str
    fingerprint: str = ""
    first_step: int = -1
    title: str = ""


@dataclass
class RunData:
    """One run as fetched for the gate (``gate.fetch``): its record, one rank's metric series, incidents
    and the stack fingerprints of its exceptions."""

    run_id: str
    status: str
    last_step: int = -1
    tags: Dict[str, str] = field(default_factory=dict)
    series: Dict[str, Series] = field(default_factory=dict)   # metric -> points of the lowest rank
    peaks: Dict[str, float] = field(default_factory=dict)     # metric -> maximum over the run, all ranks
    incidents: List[IncidentBrief] = field(default_factory=list)
    fingerprints: Dict[str, str] = field(default_factory=dict)  # fingerprint -> "Type: message template"

    @property
    def steps(self) -> int:
        """Steps the run covered (last step + 1; 0 when it logged none)."""
        return max(0, self.last_step + 1)


@dataclass
class Envelope:
    """The baseline's loss envelope in transformed units, one entry per matched (grid) step."""

    metric: str
    transform: str             # "log" | "linear"
    smooth_window: int         # steps
    runs: int
    steps: List[float]
    center: List[float]        # median across runs of the smoothed curves
    between: List[float]       # between-run sigma (pooled pairwise differences)
    within: List[float]        # within-run noise sigma around the smoothed curve (median across runs)
    lower: List[float]         # the runs' smoothed minimum
    upper: List[float]         # ... and maximum


@dataclass
class Distribution:
    """One value per baseline run (step time: its 10th percentile; memory: its peak)."""

    metric: str
    values: Dict[str, float]
    median: float
    sigma: float               # pairwise scale across runs (0 with one run)
    quantile: float = 0.5      # which value of a run (1.0: its peak over all ranks)


@dataclass
class Profile:
    version: int
    runs: List[str]
    excluded: Dict[str, str]                    # run -> why it was left out
    total_steps: int
    kinds: Dict[str, Dict[str, Any]]            # kind -> {count, per_1k_steps, severity, runs}
    fingerprints: Dict[str, str]                # fingerprint -> description
    loss: Optional[Envelope]
    step_time: Optional[Distribution]
    peak_memory: Optional[Distribution]
    notes: List[str] = field(default_factory=list)   # why a part is missing
    settings: Dict[str, Any] = field(default_factory=dict)  # Policy.profile_settings() it was built with

    def to_dict(self) -> Dict[str, Any]:
        return _jsonable(asdict(self))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Profile:
        data = _unjson(data)
        loss = Envelope(**data["loss"]) if data.get("loss") else None
        step_time = Distribution(**data["step_time"]) if data.get("step_time") else None
        memory = Distribution(**data["peak_memory"]) if data.get("peak_memory") else None
        return cls(version=int(data.get("version", PROFILE_VERSION)), runs=list(data["runs"]),
                   excluded=dict(data.get("excluded", {})), total_steps=int(data.get("total_steps", 0)),
                   kinds=dict(data.get("kinds", {})), fingerprints=dict(data.get("fingerprints", {})),
                   loss=loss, step_time=step_time, peak_memory=memory, notes=list(data.get("notes", [])),
                   settings=dict(data.get("settings", {})))

    def summary(self) -> Dict[str, Any]:
        """A short description (for listings and the API's GET)."""
        out: Dict[str, Any] = {"runs": list(self.runs), "excluded": dict(self.excluded),
                               "total_steps": self.total_steps,
                               "incident_kinds": {k: v["count"] for k, v in self.kinds.items()},
                               "fingerprints": len(self.fingerprints), "notes": list(self.notes)}
        if self.loss:
            out["loss"] = {"metric": self.loss.metric, "transform": self.loss.transform,
                           "matched_steps": len(self.loss.steps),
                           "first_step": self.loss.steps[0], "last_step": self.loss.steps[-1]}
        for name in ("step_time", "peak_memory"):
            dist: Optional[Distribution] = getattr(self, name)
            if dist:
                out[name] = {"metric": dist.metric, "quantile": dist.quantile, "median": dist.median,
                             "sigma": dist.sigma, "values": dict(dist.values)}
        return out


def _jsonable(value: Any) -> Any:
    """NaN/inf as the wire's strings, so the profile survives strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _unjson(value: Any) -> Any:
    if isinstance(value, str) and value in _SPECIAL:
        return _SPECIAL[value]
    if isinstance(value, dict):
        return {k: _unjson(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    return value


# --- transforms and smoothing (shared with gate.compare) -------------------------------------------------
def choose_transform(requested: str, series: Sequence[Series]) -> str:
    """``log`` when requested, or ``auto`` and every finite value of every series is > 0; else linear."""
    if requested != "auto":
        return requested
    values = [v for s in series for _, v in s if math.isfinite(v)]
    return "log" if values and all(v > 0 for v in values) else "linear"


def transform_value(value: float, transform: str) -> float:
    """The value in comparison units. NaN and +inf become +inf (never better than anything); under log a
    value <= 0 becomes -inf (better than anything)."""
    if math.isnan(value) or value == math.inf:
        return math.inf
    if transform == "log":
        return math.log(value) if value > 0 else -math.inf
    return value


def untransform(value: float, transform: str) -> float:
    if transform == "log" and math.isfinite(value):
        return math.exp(value)
    return value


def half_width(points: Series, window_steps: int) -> int:
    """Running-median half width in points for a window of ``window_steps`` steps at this series' median
    step spacing."""
    if len(points) < 2 or window_steps <= 1:
        return 0
    spacing = stats.median([b[0] - a[0] for a, b in zip(points, points[1:])]) or 1.0
    return max(0, round((window_steps / spacing - 1) / 2))


@dataclass
class Smoothed:
    steps: List[float]
    values: List[float]        # smoothed, transformed
    noise: List[float]         # running within-run sigma of the residuals
    half_width: int


def smooth(points: Series, transform: str, window_steps: int) -> Smoothed:
    """A series in comparison units, smoothed by a running median of ``window_steps`` steps, with the
    running robust scale of its residuals (NaN where unknown)."""
    ordered = sorted(points)
    steps = [s for s, _ in ordered]
    ys = [transform_value(v, transform) for _, v in ordered]
    hw = half_width(ordered, window_steps)
    smoothed = stats.running_median(ys, hw)
    resid = [y - m if math.isfinite(y) and math.isfinite(m) else math.nan for y, m in zip(ys, smoothed)]
    noise = stats.running_mad_sigma(resid, max(2 * hw, 10))
    return Smoothed(steps, smoothed, noise, hw)


# --- the profile -----------------------------------------------------------------------------------------
def _grid(runs: Sequence[Smoothed], points: int) -> List[float]:
    lo = max(r.steps[0] for r in runs)
    hi = min(r.steps[-1] for r in runs)
    candidates = sorted({s for r in runs for s in r.steps if lo <= s <= hi})
    if len(candidates) <= points:
        return candidates
    picked = [candidates[round(i * (len(candidates) - 1) / (points - 1))] for i in range(points)]
    return sorted(set(picked))


def build_envelope(series: Dict[str, Series], policy: Policy) -> Tuple[Optional[Envelope], str]:
    """The loss envelope of the runs' series (run -> points), or None and why."""
    lp = policy.loss
    usable = {run: pts for run, pts in series.items() if len(pts) >= 2}
    if len(usable) < 2:
        return None, f"fewer than 2 baseline runs report {lp.metric!r} (have {len(usable)})"
    transform = choose_transform(lp.transform, list(usable.values()))
    smoothed = [smooth(pts, transform, lp.smooth_window) for pts in usable.values()]
    grid = _grid(smoothed, lp.grid_points)
    if len(grid) < 2:
        return None, f"the baseline runs share fewer than 2 steps of {lp.metric!r}"
    columns = [[stats.interpolate(r.steps, r.values, g) for r in smoothed] for g in grid]
    within = [stats.median([v for v in (stats.interpolate(r.steps, r.noise, g) for r in smoothed)
                            if math.isfinite(v)]) for g in grid]
    between = stats.pooled_pair_sigma(columns, lp.pool_window // 2)
    return Envelope(metric=lp.metric, transform=transform, smooth_window=lp.smooth_window,
                    runs=len(usable), steps=grid, center=[stats.median(c) for c in columns],
                    between=between, within=[w if math.isfinite(w) else 0.0 for w in within],
                    lower=[min(c) for c in columns], upper=[max(c) for c in columns]), ""


def run_value(run: RunData, metric: str, quantile: float) -> Optional[float]:
    """One number per run: the ``quantile`` of a series' finite values (of its lowest rank), or with
    ``quantile`` 1 its peak over all ranks; None when absent."""
    if quantile >= 1.0:
        peak = run.peaks.get(metric)
        return peak if peak is not None and math.isfinite(peak) else None
    values = [v for _, v in run.series.get(metric, []) if math.isfinite(v)]
    return stats.quantile(values, quantile) if values else None


def build_distribution(runs: Sequence[RunData], metrics: Sequence[str], quantile: float
                       ) -> Tuple[Optional[Distribution], str]:
    """The first of ``metrics`` that every run reports, as a distribution of per-run values."""
    for metric in metrics:
        values = {r.run_id: run_value(r, metric, quantile) for r in runs}
        if runs and all(v is not None for v in values.values()):
            found = {k: float(v) for k, v in values.items() if v is not None}
            return Distribution(metric=metric, values=found, median=stats.median(list(found.values())),
                                sigma=stats.pair_sigma(list(found.values())), quantile=quantile), ""
    return None, f"no metric of {', '.join(metrics)} is reported by every baseline run"


def incident_kinds(runs: Sequence[RunData]) -> Dict[str, Dict[str, Any]]:
    """kind -> {count, per_1k_steps, severity (the worst seen), runs} over ``runs``."""
    total_steps = sum(r.steps for r in runs)
    kinds: Dict[str, Dict[str, Any]] = {}
    order = {"info": 0, "warning": 1, "error": 2, "critical": 3}
    for run in runs:
        for inc in run.incidents:
            entry = kinds.setdefault(inc.kind, {"count": 0, "per_1k_steps": 0.0, "severity": inc.severity,
                                                "runs": []})
            entry["count"] += 1
            if order.get(inc.severity, 0) > order.get(entry["severity"], 0):
                entry["severity"] = inc.severity
            if run.run_id not in entry["runs"]:
                entry["runs"].append(run.run_id)
    for entry in kinds.values():
        entry["per_1k_steps"] = 1000.0 * entry["count"] / total_steps if total_steps else math.inf
    return kinds


def build_profile(runs: Sequence[RunData], policy: Policy) -> Profile:
    """The profile of ``runs`` under ``policy`` (see the module doc). Never raises on odd data: what
    cannot be summarised is None with a note."""
    used: List[RunData] = []
    excluded: Dict[str, str] = {}
    for run in runs:
        if run.status not in policy.baseline.statuses:
            excluded[run.run_id] = f"status {run.status} (baseline.statuses: " \
                                   f"{', '.join(policy.baseline.statuses)})"
        elif run.steps == 0:
            excluded[run.run_id] = "no steps logged"
        else:
            used.append(run)
    notes: List[str] = []
    fingerprints: Dict[str, str] = {}
    for run in used:
        fingerprints.update(run.fingerprints)
        for inc in run.incidents:
            if inc.fingerprint:
                fingerprints.setdefault(inc.fingerprint, inc.title)
    loss, why = build_envelope({r.run_id: r.series.get(policy.loss.metric, []) for r in used}, policy)
    if why:
        notes.append(f"loss: {why}")
    step_time, why = build_distribution(used, policy.step_time.metrics, policy.step_time.quantile)
    if why:
        notes.append(f"step time: {why}")
    memory, why = build_distribution(used, policy.peak_memory.metrics, policy.peak_memory.quantile)
    if why:
        notes.append(f"peak memory: {why}")
    return Profile(version=PROFILE_VERSION, runs=[r.run_id for r in used], excluded=excluded,
                   total_steps=sum(r.steps for r in used), kinds=incident_kinds(used),
                   fingerprints=fingerprints, loss=loss, step_time=step_time, peak_memory=memory,
                   notes=notes, settings=policy.profile_settings())
