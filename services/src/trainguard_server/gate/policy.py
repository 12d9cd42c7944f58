"""The gate's policy: every threshold the comparison uses, with its default and meaning (no I/O).

A policy file (YAML or JSON) overrides any subset, section by section::

    loss:
      k: 5                  # wider band
      max_consecutive: 20
    step_time:
      fail_pct: 50          # step time may fail the gate on dedicated runners
    fingerprints:
      ignore: [3f2a...]     # a known, accepted exception

Contract: :func:`policy_from_dict` returns a fully populated :class:`Policy` or raises ``ValueError`` with
one message naming the offending key (unknown section or key, wrong type, out of range). Keys marked
"profile" are fixed when a baseline is defined (they shape the stored profile); the others apply at gate
time. :func:`defaults_table` prints every key with its default and meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type, TypeVar

T = TypeVar("T")
SEVERITIES = ("info", "warning", "error", "critical")
ACTIONS = ("fail", "warn", "off")
RUN_STATUSES = ("running", "finished", "failed", "stalled", "lost")


def _m(text: str, **extra: Any) -> Dict[str, Any]:
    """A field's metadata: its meaning (``doc``) and validation (``lo``, ``choices``, ``profile``)."""
    return {"doc": text, **extra}


@dataclass
class BaselinePolicy:
    min_runs: int = field(default=2, metadata=_m(
        "fewer usable baseline runs than this: the gate cannot decide (exit 2)", lo=1))
    statuses: List[str] = field(default_factory=lambda: ["finished"], metadata=_m(
        "run statuses a baseline run may have; others are left out (profile)", choices=RUN_STATUSES))


@dataclass
class StatusPolicy:
    fail_on: List[str] = field(default_factory=lambda: ["failed", "stalled", "lost"], metadata=_m(
        "candidate statuses that fail the gate", choices=RUN_STATUSES))


@dataclass
class FingerprintPolicy:
    on_new: str = field(default="fail", metadata=_m(
        "a stack fingerprint no baseline run had: fail | warn | off", choices=ACTIONS))
    ignore: List[str] = field(default_factory=list, metadata=_m(
        "fingerprints never counted as new (known, accepted exceptions)"))


@dataclass
class IncidentPolicy:
    new_kind_fail_severity: str = field(default="critical", metadata=_m(
        "an incident kind (category/subtype) no baseline run had fails at this severity or above",
        choices=SEVERITIES))
    new_kind_warn_severity: str = field(default="warning", metadata=_m(
        "... and warns at this severity or above", choices=SEVERITIES))
    rate_warn_factor: float = field(default=3.0, metadata=_m(
        "a known kind warns when its rate per 1,000 steps exceeds this many times the baseline's", lo=1.0))
    rate_min_count: int = field(default=2, metadata=_m(
        "... and the candidate has at least this many of it", lo=1))


@dataclass
class LossPolicy:
    metric: str = field(default="loss", metadata=_m("the metric compared (profile)", profile=True))
    transform: str = field(default="auto", metadata=_m(
        "auto: log when every baseline value is > 0, else linear | log | linear (profile)",
        choices=("auto", "log", "linear"), profile=True))
    smooth_window: int = field(default=15, metadata=_m(
        "running-median window in steps, for baseline and candidate alike (profile)", lo=1, profile=True))
    grid_points: int = field(default=200, metadata=_m(
        "matched steps: at most this many, spread over the baseline runs' common range (every logged step "
        "of a short run) (profile)", lo=10, profile=True))
    pool_window: int = field(default=61, metadata=_m(
        "grid points whose pairwise run differences are pooled into the between-run scale at each step "
        "(profile)", lo=1, profile=True))
    k: float = field(default=5.0, metadata=_m(
        "a step is outside the envelope when more than k noise-band sigmas from the baseline median", lo=0.5))
    max_consecutive: int = field(default=10, metadata=_m(
        "fail when more than this many consecutive matched steps are outside", lo=0))
    direction: str = field(default="above", metadata=_m(
        "above: only a loss higher than the baseline's counts | both", choices=("above", "both")))
    sigma_floor: float = field(default=0.05, metadata=_m(
        "the noise band's floor in transformed units (log: 0.05 = 5% of the loss; linear: 0.05 x |baseline "
        "median|)", lo=0.0))
    min_matched_steps: int = field(default=20, metadata=_m(
        "fewer matched steps in the candidate (and no failing stretch): the check cannot decide", lo=1))
    skip_steps: int = field(default=0, metadata=_m("ignore steps before this one (warmup)", lo=0))


@dataclass
class RegressionPolicy:
    """Step time or peak memory: a distribution over the baseline runs, one value per run."""

    metrics: List[str] = field(default_factory=list, metadata=_m(
        "the first of these metrics every baseline run reports is used (profile)"))
    quantile: float = field(default=0.5, metadata=_m(
        "one value per run: this quantile of its values; 1 = its peak over all ranks (profile)", lo=0.0,
        hi=1.0))
    warn_pct: Optional[float] = field(default=None, metadata=_m(
        "warn when the candidate is more than this % above the baseline median (null: never)", lo=0.0))
    fail_pct: Optional[float] = field(default=None, metadata=_m(
        "fail when more than this % above (null: never)", lo=0.0))
    noise_k: float = field(default=3.0, metadata=_m(
        "... and more than noise_k noise sigmas above (the baseline runs' pairwise spread), so a noisy "
        "metric does not trip on a small %", lo=0.0))


def _step_time() -> RegressionPolicy:
    return RegressionPolicy(metrics=["time/step_s"], quantile=0.1, warn_pct=25.0, fail_pct=None)


def _memory() -> RegressionPolicy:
    return RegressionPolicy(metrics=["mem/max_allocated", "mem/reserved", "mem/allocated", "mem/rss"],
                            quantile=1.0, warn_pct=10.0, fail_pct=25.0)


@dataclass
class Policy:
    baseline: BaselinePolicy = field(default_factory=BaselinePolicy)
    status: StatusPolicy = field(default_factory=StatusPolicy)
    fingerprints: FingerprintPolicy = field(default_factory=FingerprintPolicy)
    incidents: IncidentPolicy = field(default_factory=IncidentPolicy)
    loss: LossPolicy = field(default_factory=LossPolicy)
    step_time: RegressionPolicy = field(default_factory=_step_time)
    peak_memory: RegressionPolicy = field(default_factory=_memory)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        return {f.name: {g.name: _copy(getattr(getattr(self, f.name), g.name))
                         for g in fields(getattr(self, f.name))} for f in fields(self)}

    def profile_settings(self) -> Dict[str, Any]:
        """The keys that shape a stored profile (see the module doc)."""
        return {"baseline.statuses": list(self.baseline.statuses), "loss.metric": self.loss.metric,
                "loss.transform": self.loss.transform, "loss.smooth_window": self.loss.smooth_window,
                "loss.grid_points": self.loss.grid_points, "loss.pool_window": self.loss.pool_window,
                "step_time.metrics": list(self.step_time.metrics),
                "step_time.quantile": self.step_time.quantile,
                "peak_memory.metrics": list(self.peak_memory.metrics),
                "peak_memory.quantile": self.peak_memory.quantile}


# step_time and peak_memory share a class but not their defaults or docs
_SECTION_DOCS = {
    "step_time": "step time (per run: the 10th percentile of the SDK's time/step_s, what the code costs when "
                 "the machine is not busy elsewhere; the median also measures contention): default warn > "
                 "25%, never fails (CI runners are noisy; set fail_pct on dedicated ones)",
    "peak_memory": "peak memory (per-run maximum; GPU: mem/max_allocated, CPU: the process RSS): default "
                   "warn > 10%, fail > 25%",
}


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _convert(section: str, name: str, meta: Mapping[str, Any], annotation: str, value: Any) -> Any:
    where = f"{section}.{name}"
    if annotation.startswith("Optional") and value is None:
        return None
    if annotation.startswith("List"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"policy: {where} must be a list of strings, got {value!r}")
        choices = meta.get("choices")
        for v in value:
            if choices and v not in choices:
                raise ValueError(f"policy: {where}: {v!r} is not one of {', '.join(choices)}")
        return list(value)
    if "float" in annotation:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"policy: {where} must be a number, got {value!r}")
        value = float(value)
    elif "int" in annotation:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"policy: {where} must be an integer, got {value!r}")
    elif "str" in annotation:
        if not isinstance(value, str):
            raise ValueError(f"policy: {where} must be a string, got {value!r}")
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ValueError(f"policy: {where} must be one of {', '.join(choices)}, got {value!r}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and value < lo:
        raise ValueError(f"policy: {where} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"policy: {where} must be <= {hi}, got {value!r}")
    return value


def _section(cls: Type[T], base: T, name: str, data: Any) -> T:
    if not isinstance(data, Mapping):
        raise ValueError(f"policy: section {name!r} must be a mapping, got {data!r}")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values = {k: _copy(getattr(base, k)) for k in known}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"policy: unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        values[key] = _convert(name, key, known[key].metadata, str(known[key].type), value)
    return cls(**values)


def policy_from_dict(data: Optional[Mapping[str, Any]]) -> Policy:
    """The default policy overridden by ``data`` ({section: {key: value}}); ValueError naming the key."""
    policy = Policy()
    if not data:
        return policy
    if not isinstance(data, Mapping):
        raise ValueError(f"policy must be a mapping of sections, got {type(data).__name__}")
    sections = {f.name: f for f in fields(Policy)}
    for name, section in data.items():
        if name not in sections:
            raise ValueError(f"policy: unknown section {name!r} (known: {', '.join(sections)})")
        current = getattr(policy, name)
        setattr(policy, name, _section(type(current), current, name, section))
    return policy


def defaults_table() -> List[Tuple[str, Any, str]]:
    """(``section.key``, default, meaning) for every key of the default policy."""
    policy = Policy()
    rows = []
    for section in fields(Policy):
        obj = getattr(policy, section.name)
        for f in fields(obj):
            doc = f.metadata.get("doc", "")
            if section.name in _SECTION_DOCS and f.name == "metrics":
                doc = f"{_SECTION_DOCS[section.name]}; {doc}"
            rows.append((f"{section.name}.{f.name}", _copy(getattr(obj, f.name)), doc))
    return rows
