"""Signal recognition: a record's fields, named however a framework named them, → TrainGuard's metric names
and units (the synonym table is data: :mod:`.signals_table`; docs/replay-formats.md documents it).

Contract of :class:`Recognizer` (one per input source: it remembers per field what it decided):

* ``flatten(obj)``: a record's raw fields → flat ``name -> value``; nested objects become ``outer/inner``
  (per-layer norms keyed by parameter name), JSON booleans are 0.0/1.0, numbers and numeric strings
  (``"nan"``, ``"inf"``, ``"3e-4"``) are floats; anything else (text, lists, null) is left out and counted
  by field name as not numeric.
* ``apply(values)`` → (TrainGuard values, how many a ``--map`` rule dropped). For each field, in order:
  1. a user rule (``--map SRC=DST[*FACTOR]``; ``SRC`` ending in ``*`` is a prefix, ``DST``'s ``*`` the
     rest; an empty ``DST`` drops the field; ``*FACTOR`` multiplies the value);
  2. (``auto``) bookkeeping fields (:data:`~.signals_table.IGNORED`, Lightning ``*_epoch`` aggregates) are
     left out with the reason;
  3. (``auto``) the synonym table: the name is normalised (:func:`normalise`) and looked up whole, then
     with a unit suffix split off (``_mib``, ``_ms``, ``(ms)``, ``MB``...; only a unit of the signal's
     class counts); a family prefix (``grad_norm/<layer>``) gives a per-layer series
     (``grad/layer/<layer>``). Values are converted to the signal's base unit (bytes, seconds,
     fractions; flags to 0/1); memory without a suffix by the magnitude of the field's first value
     (:data:`~.signals_table.MEMORY_MAGNITUDE`);
  4. otherwise the field is kept under its own name (the detectors do not read it).
  An automatic target that another field of the same record already carries under that exact name
  leaves the synonym under its own name (the record's own TrainGuard name wins).
* :attr:`Recognizer.report` (:class:`Recognition`) says per signal which field it came from, what was
  left out and why, and what was kept as is; :meth:`Recognition.lines` words it for the summary.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .signals_table import (
    EPOCH_AGGREGATE_SUFFIX,
    IGNORED,
    MEMORY_MAGNITUDE,
    SIGNALS,
    UNIT_SUFFIXES,
    Signal,
)

TRAIN_PREFIXES = ("train/", "train_", "training/", "training_", "trainer/", "train-")
EVAL_NAMESPACES = ("val", "valid", "validation", "eval", "evaluation", "test", "dev", "holdout")
"""Namespaces whose fields are not the training signals (``val/loss`` is no training loss); any other
namespace (``perf/step_time_ms``, ``system/rss_mib``) is looked through when the whole name is unknown."""
LIGHTNING_STEP_SUFFIX = "_step"
MAX_NAMES = 65536
"""Field names whose decision is remembered (a file with more distinct names is still read, just slower)."""
MAX_PLANS = 1024
"""Distinct field sets whose plan is remembered (records with other field sets take the slow path)."""
Plan = Tuple[List[Tuple[Optional[str], float, bool]], int]
MAX_LISTED = 200
"""Field names kept for the summary per list (all are counted)."""

_BY_NAME: Dict[str, Signal] = {}
_FAMILIES: List[Tuple[str, Signal]] = []
for _sig in SIGNALS:
    for _name in _sig.names:
        _BY_NAME.setdefault(_name.replace(" ", "_"), _sig)
    for _prefix in _sig.prefixes:
        _FAMILIES.append((_prefix, _sig))
_FAMILIES.sort(key=lambda p: -len(p[0]))
FAMILY_TOTALS = ("total", "global", "all", "total_norm", "global_norm")
"""A per-layer family's key that is the whole model's norm (``{"grad_norm": {"total": ...}}``)."""
_GLOBAL_NORM = "grad/global_norm"
_FAMILY_TARGET = "grad/layer/"
_GRAD_FAMILY = {p for p, s in _FAMILIES if s.target == "grad/layer/"}
_IGNORED: Dict[str, str] = dict(IGNORED)
_SUFFIXES: Dict[str, Tuple[str, float]] = {s: (u, f) for s, u, f in UNIT_SUFFIXES}
_PAREN_UNIT = re.compile(r"^(?P<base>.*?)[\s_]*\((?P<unit>[^()]+)\)$")
_CAMEL_UNIT = re.compile(r"^(?P<base>.*[a-z0-9])(?P<unit>MB|GB|KB|MiB|GiB|KiB|Bytes|Ms)$")

_NON_FINITE = {
    "nan": math.nan,
    "+nan": math.nan,
    "-nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
}


def to_number(value: Any) -> Optional[float]:
    """A metric value as a float (non-finite ones and booleans as 0/1 included), or None when not numeric."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        text = value.strip().lower()
        special = _NON_FINITE.get(text)
        if special is not None:
            return special
        if text in ("true", "false"):
            return 1.0 if text == "true" else 0.0
        try:
            return float(text)
        except ValueError:
            return None
    return None


def flatten(
    obj: Mapping[str, Any], ignored: Counter[str], prefix: str = "", out: Optional[Dict[str, float]] = None
) -> Dict[str, float]:
    """``obj``'s fields as flat ``name -> float`` (see the module doc); non-numeric ones counted in
    ``ignored`` by name."""
    if out is None:
        out = {}
    for key, value in obj.items():
        name = f"{prefix}/{key}" if prefix else key
        kind = type(value)
        if kind is float:  # the common case first
            out[name] = value
            continue
        if kind is dict:
            flatten(value, ignored, name, out)
            continue
        number = to_number(value)
        if number is None:
            ignored[name] += 1
        else:
            out[name] = number
    return out


def strip_training_prefix(name: str) -> str:
    """``train/loss`` → ``loss`` (the prefixes of :data:`TRAIN_PREFIXES`, any case); else ``name``."""
    low = name[:12].lower()
    for prefix in TRAIN_PREFIXES:
        if low.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix) :]
    return name


def normalise(name: str) -> str:
    """Lower case, spaces/dashes/dots as ``_`` (length kept: a family's rest is cut from the original)."""
    return name.lower().replace(" ", "_").replace("-", "_").replace(".", "_")


def split_unit(name: str) -> Optional[Tuple[str, str, float]]:
    """(the name without its unit suffix, unit class, factor) -- ``step_time_ms``, ``time (ms)``,
    ``rssMB`` -- or None."""
    m = _PAREN_UNIT.match(name)
    if m is not None:
        unit = _SUFFIXES.get(m.group("unit").strip().lower())
        if unit is not None:
            return normalise(m.group("base").strip()), unit[0], unit[1]
    m = _CAMEL_UNIT.match(name)
    if m is not None:
        unit = _SUFFIXES.get(m.group("unit").lower())
        if unit is not None:
            return normalise(m.group("base")), unit[0], unit[1]
    norm = normalise(name)
    head, sep, tail = norm.rpartition("_")
    if sep and head:
        unit = _SUFFIXES.get(tail)
        if unit is not None:
            return head, unit[0], unit[1]
    if norm.endswith("%"):
        return norm[:-1].rstrip("_"), "fraction", 0.01
    return None


def parse_map_rule(text: str) -> Tuple[str, str]:
    """``SOURCE=TARGET[*FACTOR]`` → (source, target with its factor); ValueError when there is no ``=``, no
    source, or a factor that is not a number."""
    source, sep, target = text.partition("=")
    if not sep or not source.strip():
        raise ValueError(f"--map wants SOURCE=TARGET[*FACTOR], got {text!r}")
    target = target.strip()
    _split_factor(target, text)
    return source.strip(), target


def _split_factor(target: str, text: str = "") -> Tuple[str, float]:
    """``mem/rss*1048576`` → (``mem/rss``, 1048576.0); ``grad/layer/*`` keeps its ``*``."""
    head, star, tail = target.rpartition("*")
    if star and tail.strip():
        try:
            factor = float(tail)
        except ValueError:
            raise ValueError(f"--map: the factor after '*' is not a number in {text or target!r}") from None
        if not math.isfinite(factor):
            raise ValueError(f"--map: the factor must be finite in {text or target!r}")
        return head, factor
    return target, 1.0


@dataclass
class _Decision:
    target: str  # "" = left out
    factor: float  # NaN: memory by magnitude, not decided yet
    how: str  # "map" | "signal" | "family" | "kept" | "ignored" | "dropped"
    reason: str = ""
    flag: bool = False


@dataclass
class Recognition:
    """What recognition found in one source."""

    signals: Dict[str, Counter[str]] = field(default_factory=dict)  # target -> source fields (counted)
    families: Dict[str, Counter[str]] = field(default_factory=dict)  # family target -> source prefix
    layers: Dict[str, int] = field(default_factory=dict)  # family target -> distinct layers
    units: Dict[str, str] = field(default_factory=dict)  # source field -> unit said
    ignored: Dict[str, str] = field(default_factory=dict)  # field -> reason (first MAX_LISTED)
    ignored_count: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)  # unrecognised, kept as is
    dropped: Counter[str] = field(default_factory=Counter)  # by a --map rule

    def found(self, target: str) -> bool:
        return target in self.signals or target in self.families

    def lines(self, non_numeric: Optional[Counter[str]] = None) -> List[str]:
        """The summary's words: per signal its field (or that none was found, and what therefore cannot
        be judged), then what was left out with the reason, then what was kept under its own name."""
        out: List[str] = []
        for sig in SIGNALS:
            if sig.target in self.families:
                srcs = ", ".join(f"{p}*" for p in self.families[sig.target])
                out.append(f"{sig.target}* <- {srcs} ({self.layers.get(sig.target, 0)} layers)")
            elif sig.target in self.signals:
                srcs = ", ".join(self._said(s) for s in self.signals[sig.target])
                out.append(f"{sig.target} <- {srcs}")
            elif sig.required:
                out.append(f"no {sig.target}{'*' if sig.target.endswith('/') else ''}: {sig.without}")
        for name, reason in self.ignored.items():
            out.append(f"ignored {name!r}: {reason} ({self.ignored_count[name]} values)")
        for name, n in (non_numeric or Counter()).most_common(MAX_LISTED):
            out.append(f"ignored {name!r}: not a number ({n} values)")
        if self.dropped:
            out.append("dropped by --map: " + ", ".join(f"{k} ({n})" for k, n in self.dropped.items()))
        if self.kept:
            names = [k for k, _ in self.kept.most_common(12)]
            more = len(self.kept) - len(names)
            out.append(
                "kept under their own names (no detector reads them): "
                + ", ".join(names)
                + (f" and {more} more" if more > 0 else "")
            )
        return out

    def _said(self, source: str) -> str:
        unit = self.units.get(source)
        return f"{source!r}" + (f" ({unit})" if unit else "")


class Recognizer:
    """Field names and units → TrainGuard's (see the module doc). ``rules``: ``(source, target[*factor])``
    pairs of ``--map``; ``auto``: use the synonym table."""

    def __init__(self, rules: Sequence[Tuple[str, str]] = (), auto: bool = True) -> None:
        self.exact: Dict[str, Tuple[str, float]] = {}
        self.prefixes: List[Tuple[str, str, float]] = []
        for source, target in rules:
            name, factor = _split_factor(target)
            if source.endswith("*"):
                self.prefixes.append((source[:-1], name, factor))
            else:
                self.exact[source] = (name, factor)
        self.auto = auto
        self._memo: Dict[str, _Decision] = {}
        self._counts: Dict[str, int] = {}
        self._collided: set[str] = set()
        self._notes: Dict[str, str] = {}
        self._note_counts: Counter[str] = Counter()
        self._plans: Dict[Tuple[str, ...], Plan] = {}
        self._plan_counts: Dict[Tuple[str, ...], int] = {}

    # -- decisions ----------------------------------------------------------------------------------------
    def _decide(self, name: str) -> _Decision:
        if name in self.exact:
            target, factor = self.exact[name]
            return _Decision(target, factor, "map" if target else "dropped")
        for prefix, target, factor in self.prefixes:
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                new = target.replace("*", rest) if "*" in target else target
                return _Decision(new, factor, "map" if new else "dropped")
        if not self.auto:
            return _Decision(name, 1.0, "kept")
        core = strip_training_prefix(name)
        norm = normalise(core)
        if norm in _IGNORED:
            return _Decision("", 1.0, "ignored", _IGNORED[norm])
        if norm.endswith(EPOCH_AGGREGATE_SUFFIX) and len(norm) > len(EPOCH_AGGREGATE_SUFFIX):
            return _Decision("", 1.0, "ignored", "an epoch aggregate (the per-step series is the signal)")
        for prefix, sig in _FAMILIES:
            if norm.startswith(prefix) and len(norm) > len(prefix):
                if norm[len(prefix) :] in FAMILY_TOTALS and prefix in _GRAD_FAMILY:
                    return _Decision(_GLOBAL_NORM, 1.0, "signal")
                return _Decision(sig.target + core[len(prefix) :], 1.0, "family", reason=prefix)
        if norm.endswith(LIGHTNING_STEP_SUFFIX) and norm[: -len(LIGHTNING_STEP_SUFFIX)] in _BY_NAME:
            norm = norm[: -len(LIGHTNING_STEP_SUFFIX)]
            core = core[: -len(LIGHTNING_STEP_SUFFIX)]
        named = _BY_NAME.get(norm)
        if named is not None:
            factor = math.nan if named.unit == "bytes" and norm != named.target else 1.0
            return _Decision(named.target, factor, "signal", flag=named.unit == "flag")
        split = split_unit(core)
        if split is not None:
            base, unit, factor = split
            unit_sig = _BY_NAME.get(base)
            if unit_sig is not None and unit_sig.unit == unit:
                return _Decision(unit_sig.target, factor, "signal", reason=_unit_word(unit, factor))
        head, sep, rest = core.partition("/")
        if sep and rest and head.lower() not in EVAL_NAMESPACES:  # "perf/step_time_ms" -> "step_time_ms"
            inner = self._decide(rest)
            if inner.how in ("signal", "family", "ignored"):
                return inner
        return _Decision(name, 1.0, "kept")

    def _decision(self, name: str) -> _Decision:
        found = self._memo.get(name)
        if found is None:
            found = self._decide(name)
            if len(self._memo) < MAX_NAMES:
                self._memo[name] = found
        return found

    def target_of(self, name: str) -> str:
        """The TrainGuard name ``name`` would get ("" when left out)."""
        return self._decision(name).target

    # -- values -------------------------------------------------------------------------------------------
    def apply(self, values: Mapping[str, float]) -> Tuple[Dict[str, float], int]:
        """The recognised values (in source order) and how many fields a ``--map`` rule dropped. Hot path:
        a record with the same fields as an earlier one reuses that record's plan (one lookup and one count
        per record); :attr:`report` is worked out from the counts on demand."""
        key = tuple(values)
        plan = self._plans.get(key)
        if plan is None:
            out, dropped = self._apply_slowly(values)
            if len(self._plans) < MAX_PLANS:
                made = self._plan_of(key, values)
                if made is not None:
                    self._plans[key] = made
            return out, dropped
        self._plan_counts[key] = self._plan_counts.get(key, 0) + 1
        steps, dropped = plan
        out = {}
        for (target, factor, flag), value in zip(steps, values.values()):
            if target is None:
                continue
            if flag:
                value = 0.0 if value == 0.0 else (value if value != value else 1.0)
            elif factor != 1.0:
                value = value * factor
            out[target] = value
        return out, dropped

    def _plan_of(self, key: Tuple[str, ...], values: Mapping[str, float]) -> Optional[Plan]:
        """What :meth:`_apply_slowly` decided for a record with these fields, as steps to repeat (a memory
        field whose unit is still to be told by its magnitude stays on the slow path)."""
        steps: List[Tuple[Optional[str], float, bool]] = []
        dropped = 0
        for name in key:
            d = self._memo.get(name)
            if d is None or d.factor != d.factor:
                return None
            if d.how == "dropped":
                dropped += 1
                steps.append((None, 1.0, False))
            elif d.how == "ignored":
                steps.append((None, 1.0, False))
            elif d.how == "kept" or (d.target != name and d.target in values and d.how != "map"):
                steps.append((name, 1.0, False))
            else:
                steps.append((d.target, d.factor, d.flag))
        return steps, dropped

    def _apply_slowly(self, values: Mapping[str, float]) -> Tuple[Dict[str, float], int]:
        """:meth:`apply` field by field (decides what it has not decided yet; counts per field)."""
        out: Dict[str, float] = {}
        dropped = 0
        memo = self._memo
        counts = self._counts
        for name, value in values.items():
            d = memo.get(name)
            if d is None:
                d = self._decision(name)
            n = counts.get(name)
            if n is not None:
                counts[name] = n + 1
            elif len(counts) < MAX_NAMES:
                counts[name] = 1
            how = d.how
            if how == "kept":
                out[name] = value
                continue
            if how == "dropped":
                dropped += 1
                continue
            if how == "ignored":
                continue
            target = d.target
            if target != name and target in values and how != "map":
                if len(self._collided) < MAX_LISTED:
                    self._collided.add(name)
                out[name] = value  # the record's own TrainGuard name wins; the synonym stays as it is
                continue
            factor = d.factor
            if factor != factor:  # memory without a unit: by the magnitude of its first value
                if value == 0.0 or value != value or value in (math.inf, -math.inf):
                    factor = 1.0
                else:
                    factor = next(f for lo, f in MEMORY_MAGNITUDE if abs(value) >= lo)
                    d.factor = factor
                    d.reason = _unit_word("bytes", factor) + " by magnitude"
            if d.flag:
                value = 0.0 if value == 0.0 else (value if value != value else 1.0)
            elif factor != 1.0:
                value = value * factor
            out[target] = value
        return out, dropped

    def note_ignored(self, name: str, reason: str, count: int = 1) -> None:
        """A field a reader left out itself (e.g. a summary entry), for the report."""
        if name in self._notes or len(self._notes) < MAX_LISTED:
            self._notes[name] = reason
        self._note_counts[name] += count

    @property
    def report(self) -> Recognition:
        """What recognition found so far (see :class:`Recognition`)."""
        rep = Recognition()
        layers: Dict[str, int] = {}
        counts = dict(self._counts)
        for key, times in self._plan_counts.items():
            for name in key:
                counts[name] = counts.get(name, 0) + times
        for name, n in counts.items():
            d = self._memo.get(name)
            if d is None:
                continue
            how = d.how
            if how == "kept" or name in self._collided:
                if len(rep.kept) < MAX_LISTED:
                    rep.kept[name] += n
            elif how == "dropped":
                rep.dropped[name] += n
            elif how == "ignored":
                if len(rep.ignored) < MAX_LISTED:
                    rep.ignored[name] = d.reason
                rep.ignored_count[name] += n
            elif how == "family":
                fam = _FAMILY_TARGET
                rep.families.setdefault(fam, Counter())[d.reason or name] += n
                layers[fam] = layers.get(fam, 0) + 1
            else:
                rep.signals.setdefault(d.target, Counter())[name] += n
                if d.reason and how == "signal":
                    rep.units[name] = d.reason
        rep.layers.update(layers)
        for name, reason in self._notes.items():
            rep.ignored[name] = reason
            rep.ignored_count[name] += self._note_counts[name]
        return rep


def _unit_word(unit: str, factor: float) -> str:
    if unit == "bytes":
        return {
            1.0: "bytes",
            1e3: "kB",
            2.0**10: "KiB",
            1e6: "MB",
            2.0**20: "MiB",
            1e9: "GB",
            2.0**30: "GiB",
        }.get(factor, f"x{factor:g} bytes")
    if unit == "seconds":
        return {1.0: "s", 1e-3: "ms", 1e-6: "µs", 60.0: "min"}.get(factor, f"x{factor:g} s")
    if unit == "fraction":
        return "percent" if factor == 0.01 else "fraction"
    return unit
