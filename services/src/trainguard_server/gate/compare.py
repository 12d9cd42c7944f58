"""Compare a candidate run with a baseline profile under a policy: the verdict (no I/O).

Contract of :func:`evaluate`: ``(profile, candidate RunData, policy)`` -> :class:`Verdict` with one
:class:`Check` per aspect, each ``pass | warn | fail | undecided | skip`` with a one-line summary, details
and figures. The verdict is

- ``fail`` (exit 1) when any check fails -- a failure is decisive even when another check could not decide
  (a canary that crashed at step 5 fails on its new fingerprint although its loss curve is too short);
- else ``undecided`` (exit 2) when a check could not decide, or a precondition does not hold (fewer than
  ``baseline.min_runs`` usable baseline runs, the candidate still running or part of the baseline) --
  the reason says which;
- else ``warn`` (exit 0) when a check warns, else ``pass`` (exit 0).

The checks:

- ``status``: the candidate's run status is one of ``status.fail_on`` (failed, stalled, lost) -> fail.
- ``fingerprints``: a stack fingerprint no baseline run had (incidents' and captured exceptions') ->
  ``fingerprints.on_new``, unless listed in ``fingerprints.ignore``.
- ``incidents``: an incident kind no baseline run had fails at ``new_kind_fail_severity`` or above, warns at
  ``new_kind_warn_severity`` or above; a known kind warns when its rate per 1,000 steps exceeds
  ``rate_warn_factor`` x the baseline's (and it occurred ``rate_min_count`` times or more).
- ``loss``: the candidate's loss, transformed and smoothed like the baseline's, at each matched grid step i
  is ``z_i = (c_i - centre_i) / sigma_i`` with
  ``sigma_i = max(floor_i, inflation(n) * sqrt(between_i^2 + (1.2533 * within_i / sqrt(w))^2))``:
  the between-run scale, plus the within-run noise left after a running median of w points (a floor in
  disguise: it keeps sigma from collapsing when 2 baseline runs happen to agree), widened for a centre
  estimated from n runs (``stats.prediction_inflation``) and floored by ``loss.sigma_floor``. A step is
  outside when ``z_i > k`` (``direction: above``; ``|z_i| > k`` with ``both``); more than
  ``loss.max_consecutive`` consecutive outside steps fail. Fewer than ``loss.min_matched_steps`` matched
  steps (and no failing stretch) cannot decide.
- ``step_time`` and ``peak_memory``: the candidate's value (its 10th-percentile step time; its peak memory:
  ``quantile``) against the baseline runs' median; it warns / fails
  when it is more than ``warn_pct`` / ``fail_pct`` % above **and** more than ``noise_k`` pairwise sigmas
  (inflated as above) above, so a noisy metric does not trip on a small percentage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from . import stats
from .policy import Policy
from .profile import Distribution, Profile, RunData, run_value, smooth, untransform

PASS, WARN, FAIL, UNDECIDED, SKIP = "pass", "warn", "fail", "undecided", "skip"
EXIT_CODES = {PASS: 0, WARN: 0, FAIL: 1, UNDECIDED: 2}
SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2, "critical": 3}


@dataclass
class Check:
    name: str
    status: str
    summary: str
    details: List[str] = field(default_factory=list)
    figures: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    verdict: str               # pass | warn | fail | undecided
    exit_code: int
    reason: str                # one sentence: why this verdict
    baseline: str
    candidate: str
    checks: List[Check] = field(default_factory=list)
    plot: Dict[str, Any] = field(default_factory=dict)  # loss envelope and candidate, original units
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return _jsonable(asdict(self))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Verdict:
        checks = [Check(**c) for c in data.get("checks", [])]
        return cls(verdict=data["verdict"], exit_code=int(data["exit_code"]), reason=data.get("reason", ""),
                   baseline=data.get("baseline", ""), candidate=data.get("candidate", ""), checks=checks,
                   plot=dict(data.get("plot", {})), notes=list(data.get("notes", [])))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def undecided(baseline: str, candidate: str, reason: str, notes: Optional[List[str]] = None) -> Verdict:
    """The verdict when the gate cannot even compare (unknown baseline or run, still running, ...)."""
    return Verdict(UNDECIDED, EXIT_CODES[UNDECIDED], reason, baseline, candidate, notes=list(notes or []))


# --- checks ----------------------------------------------------------------------------------------------
def check_status(candidate: RunData, policy: Policy) -> Check:
    if candidate.status in policy.status.fail_on:
        return Check("status", FAIL, f"the candidate run {candidate.status}",
                     figures={"status": candidate.status})
    return Check("status", PASS, f"the candidate run {candidate.status}",
                 figures={"status": candidate.status})


def check_fingerprints(profile: Profile, candidate: RunData, policy: Policy) -> Check:
    fp = policy.fingerprints
    seen: Dict[str, str] = dict(candidate.fingerprints)
    for inc in candidate.incidents:
        if inc.fingerprint:
            seen.setdefault(inc.fingerprint, inc.title)
    new = {k: v for k, v in seen.items() if k not in profile.fingerprints and k not in fp.ignore}
    figures = {"candidate": len(seen), "baseline": len(profile.fingerprints), "new": sorted(new)}
    if not new:
        return Check("fingerprints", PASS, f"no new stack fingerprint ({len(seen)} seen, all known)",
                     figures=figures)
    details = [f"{k}: {v}" for k, v in sorted(new.items())]
    status = {"fail": FAIL, "warn": WARN, "off": PASS}[fp.on_new]
    word = "new stack fingerprint" + ("s" if len(new) > 1 else "")
    return Check("fingerprints", status, f"{len(new)} {word}: {details[0]}"
                 + (f" (+{len(new) - 1} more)" if len(new) > 1 else "")
                 + (" (fingerprints.on_new: off)" if fp.on_new == "off" else ""), details, figures)


def check_incidents(profile: Profile, candidate: RunData, policy: Policy) -> Check:
    ip = policy.incidents
    counts: Dict[str, Dict[str, Any]] = {}
    for inc in candidate.incidents:
        entry = counts.setdefault(inc.kind, {"count": 0, "severity": inc.severity, "title": inc.title,
                                             "first_step": inc.first_step})
        entry["count"] += 1
        if SEVERITY_ORDER.get(inc.severity, 0) > SEVERITY_ORDER.get(entry["severity"], 0):
            entry["severity"] = inc.severity
    worst, details = PASS, []
    fail_at, warn_at = SEVERITY_ORDER[ip.new_kind_fail_severity], SEVERITY_ORDER[ip.new_kind_warn_severity]
    steps = max(candidate.steps, 1)
    figures: Dict[str, Any] = {"candidate": {}, "baseline": {k: v["per_1k_steps"] for k, v in
                                                             profile.kinds.items()}}
    for kind, entry in sorted(counts.items()):
        rate = 1000.0 * entry["count"] / steps
        figures["candidate"][kind] = rate
        sev = SEVERITY_ORDER.get(entry["severity"], 0)
        where = f"{kind} ({entry['severity']}, from step {entry['first_step']}): {entry['title']}"
        known = profile.kinds.get(kind)
        if known is None:
            if sev >= fail_at:
                worst = FAIL
                details.append(f"new kind {where}")
            elif sev >= warn_at:
                worst = worst if worst == FAIL else WARN
                details.append(f"new kind {where}")
            else:
                details.append(f"new kind below the warning severity: {where}")
        elif entry["count"] >= ip.rate_min_count and rate > ip.rate_warn_factor * known["per_1k_steps"]:
            worst = worst if worst == FAIL else WARN
            details.append(f"{kind}: {rate:.2f} per 1,000 steps vs {known['per_1k_steps']:.2f} in the "
                           f"baseline (> {ip.rate_warn_factor:g}x)")
    n = sum(e["count"] for e in counts.values())
    if worst == PASS:
        summary = "no incident" if not n else f"{n} incident(s), none new or more frequent than the baseline"
    else:
        summary = details[0] if len(details) == 1 else f"{details[0]} (+{len(details) - 1} more)"
    return Check("incidents", worst, summary, details, figures)


def _sigma(profile: Profile, i: int, window_points: int, policy: Policy) -> float:
    env = profile.loss
    assert env is not None
    spread = math.hypot(env.between[i], stats.RUNNING_MEDIAN_EFFICIENCY * env.within[i]
                        / math.sqrt(max(window_points, 1)))
    floor = policy.loss.sigma_floor * (1.0 if env.transform == "log" else max(abs(env.center[i]), 1e-12))
    return max(floor, stats.prediction_inflation(env.runs) * spread, 1e-12)


def check_loss(profile: Profile, candidate: RunData, policy: Policy) -> tuple[Check, Dict[str, Any]]:
    """The loss envelope check and the plot data (original units)."""
    lp, env = policy.loss, profile.loss
    if env is None:
        return Check("loss", SKIP, "the baseline has no loss envelope", []), {}
    points = candidate.series.get(env.metric, [])
    if len(points) < 2:
        return Check("loss", UNDECIDED, f"the candidate reports no {env.metric!r} series "
                     f"({len(points)} points)"), {}
    cand = smooth(points, env.transform, env.smooth_window)
    window_points = 2 * cand.half_width + 1
    first, last = cand.steps[0], cand.steps[-1]
    idx = [i for i, g in enumerate(env.steps) if first <= g <= last and g >= lp.skip_steps]
    values, zs, outside = [], [], []
    for i in idx:
        c = stats.interpolate(cand.steps, cand.values, env.steps[i])
        z = (c - env.center[i]) / _sigma(profile, i, window_points, policy)
        values.append(c)
        zs.append(z)
        outside.append(z > lp.k if lp.direction == "above" else abs(z) > lp.k)
    start, length = stats.longest_run(outside)
    figures: Dict[str, Any] = {
        "matched_steps": len(idx), "grid_steps": len(env.steps), "baseline_runs": env.runs,
        "transform": env.transform, "k": lp.k, "max_consecutive": lp.max_consecutive,
        "outside_steps": sum(outside), "longest_outside": length,
        "candidate_last_step": last, "baseline_last_step": env.steps[-1]}
    if length:
        figures["longest_outside_from"] = env.steps[idx[start]]
        figures["longest_outside_to"] = env.steps[idx[start + length - 1]]
    if zs:
        j = max(range(len(zs)), key=lambda t: zs[t] if lp.direction == "above" else abs(zs[t]))
        figures["max_z"], figures["max_z_step"] = zs[j], env.steps[idx[j]]
    plot = _plot(profile, policy, window_points, dict(zip(idx, values)), dict(zip(idx, zs)))
    where = f"{env.metric} ({env.transform})"
    if length > lp.max_consecutive:
        return Check("loss", FAIL, f"{where} outside the baseline envelope (> {lp.k:g} sigma) for {length} "
                     f"consecutive matched steps ({figures['longest_outside_from']:g}-"
                     f"{figures['longest_outside_to']:g}; > {lp.max_consecutive} fails), max "
                     f"{_z(figures['max_z'])} sigma at step {figures['max_z_step']:g}", [], figures), plot
    if len(idx) < lp.min_matched_steps:
        return Check("loss", UNDECIDED, f"only {len(idx)} matched steps of {where} (needs "
                     f"{lp.min_matched_steps}): the candidate covers steps {first:g}-{last:g}, the baseline "
                     f"{env.steps[0]:g}-{env.steps[-1]:g}", [], figures), plot
    summary = (f"{where} within the baseline envelope at {len(idx)} matched steps "
               f"(max {_z(figures['max_z'])} sigma at step {figures['max_z_step']:g}; "
               f"{sum(outside)} outside, longest stretch {length} <= {lp.max_consecutive})")
    return Check("loss", PASS, summary, [], figures), plot


def _z(z: float) -> str:
    return "inf" if math.isinf(z) else f"{z:.1f}"


def _plot(profile: Profile, policy: Policy, window_points: int, cand: Dict[int, float],
          zs: Dict[int, float]) -> Dict[str, Any]:
    env = profile.loss
    assert env is not None
    k = policy.loss.k
    sig = [_sigma(profile, i, window_points, policy) for i in range(len(env.steps))]
    return {"metric": env.metric, "transform": env.transform, "k": k, "steps": list(env.steps),
            "center": [untransform(c, env.transform) for c in env.center],
            "band_low": [untransform(c - k * s, env.transform) for c, s in zip(env.center, sig)],
            "band_high": [untransform(c + k * s, env.transform) for c, s in zip(env.center, sig)],
            "candidate": [untransform(cand[i], env.transform) if i in cand else math.nan
                          for i in range(len(env.steps))],
            "z": [zs.get(i, math.nan) for i in range(len(env.steps))]}


def check_regression(name: str, dist: Optional[Distribution], candidate: RunData, policy: Policy) -> Check:
    rp = getattr(policy, name)
    label = name.replace("_", " ")
    if dist is None:
        return Check(name, SKIP, f"the baseline has no {label} metric")
    value = run_value(candidate, dist.metric, dist.quantile)
    if value is None:
        return Check(name, SKIP, f"the candidate reports no {dist.metric!r}")
    base = dist.median
    pct = 100.0 * (value - base) / base if base > 0 else (math.inf if value > base else 0.0)
    noise = stats.prediction_inflation(len(dist.values)) * dist.sigma
    sigmas = (value - base) / noise if noise > 0 else (math.inf if value > base else 0.0)
    figures = {"metric": dist.metric, "quantile": dist.quantile, "candidate": value, "baseline_median": base,
               "baseline_sigma": dist.sigma, "change_pct": pct, "noise_sigmas": sigmas,
               "warn_pct": rp.warn_pct, "fail_pct": rp.fail_pct, "noise_k": rp.noise_k,
               "baseline_values": dict(dist.values)}
    beyond_noise = sigmas > rp.noise_k
    q = dist.quantile
    what = "peak" if q >= 1.0 else "median" if q == 0.5 else f"p{q * 100:g}"
    text = f"{dist.metric} {what} {_fmt(value, dist.metric)} vs baseline median {_fmt(base, dist.metric)} " \
           f"({pct:+.1f}%, {_z(sigmas)} noise sigma)"
    if rp.fail_pct is not None and pct > rp.fail_pct and beyond_noise:
        return Check(name, FAIL, f"{label} regression: {text} > {rp.fail_pct:g}%", [], figures)
    if rp.warn_pct is not None and pct > rp.warn_pct and beyond_noise:
        return Check(name, WARN, f"{label} regression: {text} > {rp.warn_pct:g}%", [], figures)
    return Check(name, PASS, text, [], figures)


def _fmt(value: float, metric: str) -> str:
    if metric.startswith("mem/"):
        return f"{value / 2**20:.1f} MiB"
    if metric.startswith("time/") or metric.endswith("_s"):
        return f"{value * 1e3:.3g} ms"
    return f"{value:.4g}"


# --- the verdict -----------------------------------------------------------------------------------------
def evaluate(profile: Profile, candidate: RunData, policy: Policy, baseline: str = "") -> Verdict:
    """The verdict for ``candidate`` against ``profile`` (see the module doc)."""
    notes = list(profile.notes)
    if profile.settings and profile.settings != policy.profile_settings():
        changed = sorted(k for k, v in policy.profile_settings().items() if profile.settings.get(k) != v)
        notes.append(f"the baseline was profiled with other settings for {', '.join(changed)}: the stored "
                     f"profile's apply (define the baseline again to change them)")
    if candidate.status == "running":
        return undecided(baseline, candidate.run_id, f"the candidate run {candidate.run_id} is still running "
                         f"(last step {candidate.last_step}): gate it once it has ended", notes)
    if candidate.run_id in profile.runs:
        return undecided(baseline, candidate.run_id,
                         f"the candidate run {candidate.run_id} is one of the baseline's runs", notes)
    if len(profile.runs) < policy.baseline.min_runs:
        left_out = "; ".join(f"{k}: {v}" for k, v in profile.excluded.items())
        return undecided(baseline, candidate.run_id,
                         f"the baseline has {len(profile.runs)} usable run(s), the policy needs "
                         f"{policy.baseline.min_runs}" + (f" (left out: {left_out})" if left_out else ""),
                         notes)
    loss, plot = check_loss(profile, candidate, policy)
    checks = [check_status(candidate, policy), check_fingerprints(profile, candidate, policy),
              check_incidents(profile, candidate, policy), loss,
              check_regression("step_time", profile.step_time, candidate, policy),
              check_regression("peak_memory", profile.peak_memory, candidate, policy)]
    by_status = {s: [c for c in checks if c.status == s] for s in (FAIL, UNDECIDED, WARN)}
    if by_status[FAIL]:
        verdict = FAIL
        reason = "; ".join(f"{c.name}: {c.summary}" for c in by_status[FAIL])
    elif by_status[UNDECIDED]:
        verdict = UNDECIDED
        reason = "could not decide: " + "; ".join(f"{c.name}: {c.summary}" for c in by_status[UNDECIDED])
    elif by_status[WARN]:
        verdict = WARN
        reason = "passed with warnings: " + "; ".join(f"{c.name}: {c.summary}" for c in by_status[WARN])
    else:
        verdict = PASS
        reason = f"no check failed against {len(profile.runs)} baseline runs"
    return Verdict(verdict, EXIT_CODES[verdict], reason, baseline, candidate.run_id, checks, plot, notes)
