"""Metrics JSON-lines files (one object per step) → numeric records, and the field-name mapping.

Contract of :class:`MetricsReader` (iterate it; counts land in :attr:`MetricsReader.stats`):

* One JSON object per line; blank lines are ignored. A line that is not JSON, or not an object, or whose
  step is not a non-negative integer, is **skipped and counted** with its line number
  (:attr:`MetricsStats.malformed`); never fatal. Python's ``json`` reads ``NaN``, ``Infinity`` and
  ``-Infinity`` literals; the strings ``"nan"``, ``"inf"``, ``"-inf"``, ``"infinity"`` (any case) and
  numeric strings (``"3e-4"``) are numbers too.
* **Step**: the first of :data:`STEP_FIELDS` present (``step``, ``global_step``, ``trainer/global_step``,
  ``iteration``, ``iter``, ``_step``), or ``step_field``. When the first readable object has none of them
  the file is numbered by position (0, 1, 2, ... over non-blank lines; :attr:`MetricsStats.numbered`);
  otherwise an object without one is skipped and counted in ``no_step``.
* **Time**: the first of :data:`TIME_FIELDS` present whose value is an absolute time (see
  :mod:`.times`), or ``time_field``; None otherwise (the importer supplies one).
* **Rank**: an integer ``rank`` field routes the object to that rank (else the file's rank).
* **Values**: every other field. Numbers (not booleans) are metrics; nested objects are flattened with
  ``/`` (``{"grad_norm": {"layer1": 0.1}}`` → ``grad_norm/layer1``); anything else (strings, lists, null,
  booleans) is ignored and counted by field name in ``non_numeric``. Then :class:`FieldMap` renames.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from .times import parse_time_value

STEP_FIELDS = ("step", "global_step", "trainer/global_step", "iteration", "iter", "_step")
TIME_FIELDS = ("time", "timestamp", "_timestamp", "wall_time", "walltime", "time_unix_nano")
RANK_FIELD = "rank"
MAX_REPORTED = 20
"""Malformed lines kept with their line number and reason (all are counted)."""

AUTO_MAP: Dict[str, str] = {
    "train/loss": "loss", "train_loss": "loss", "training_loss": "loss",
    "grad_norm": "grad/global_norm", "train/grad_norm": "grad/global_norm", "grad/norm": "grad/global_norm",
    "global_grad_norm": "grad/global_norm", "gradient_norm": "grad/global_norm",
    "total_grad_norm": "grad/global_norm",
    "lr": "opt/lr", "learning_rate": "opt/lr", "train/learning_rate": "opt/lr", "train/lr": "opt/lr",
    "loss_scale": "amp/scale", "grad_scale": "amp/scale", "scaler/scale": "amp/scale",
}
"""Automatic renames of common names to TrainGuard's (applied only when the target name is not itself a
field of the same object; ``--no-auto-map`` turns them off)."""
AUTO_PREFIX_MAP: Dict[str, str] = {"grad_norm/": "grad/layer/", "grad_norms/": "grad/layer/"}
"""Automatic prefix renames: per-layer gradient norms nested under ``grad_norm``."""

_NON_FINITE = {"nan": math.nan, "+nan": math.nan, "-nan": math.nan, "inf": math.inf, "+inf": math.inf,
               "infinity": math.inf, "+infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf}


def to_number(value: Any) -> Optional[float]:
    """A metric value as a float (non-finite ones included), or None when ``value`` is not numeric."""
    if isinstance(value, float):
        return value
    if isinstance(value, bool):
        return None
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
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _to_step(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        step = value
    elif isinstance(value, float) and value.is_integer():
        step = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        step = int(value)
    else:
        return None
    return step if 0 <= step < 2**62 else None


class FieldMap:
    """Source field name → TrainGuard metric name.

    ``rules``: ``(source, target)`` pairs from ``--map``; a source ending in ``*`` is a prefix and the
    target's ``*`` (if any) stands for the rest (``grad_norm/*=grad/layer/*``). An empty target drops the
    field. User rules win over the automatic ones (:data:`AUTO_MAP`, :data:`AUTO_PREFIX_MAP`).
    """

    def __init__(self, rules: Sequence[Tuple[str, str]] = (), auto: bool = True) -> None:
        self.exact: Dict[str, str] = {}
        self.prefixes: List[Tuple[str, str]] = []
        for source, target in rules:
            if source.endswith("*"):
                self.prefixes.append((source[:-1], target))
            else:
                self.exact[source] = target
        self.auto = auto
        self._memo: Dict[str, Tuple[str, bool]] = {}

    def _target(self, name: str) -> Tuple[str, bool]:
        """(new name, whether it is an automatic rename)."""
        known = self._memo.get(name)
        if known is not None:
            return known
        result: Tuple[str, bool] = (name, False)
        if name in self.exact:
            result = (self.exact[name], False)
        else:
            for prefix, target in self.prefixes:
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    result = (target.replace("*", rest) if "*" in target else target, False)
                    break
            else:
                if self.auto:
                    if name in AUTO_MAP:
                        result = (AUTO_MAP[name], True)
                    else:
                        for prefix, target in AUTO_PREFIX_MAP.items():
                            if name.startswith(prefix):
                                result = (target + name[len(prefix):], True)
                                break
        if len(self._memo) < 65536:
            self._memo[name] = result
        return result

    def apply(self, values: Mapping[str, float]) -> Tuple[Dict[str, float], int]:
        """The renamed values (in source order) and how many fields a rule dropped."""
        out: Dict[str, float] = {}
        dropped = 0
        for name, value in values.items():
            target, automatic = self._target(name)
            if not target:
                dropped += 1
                continue
            if automatic and target in values:
                target = name  # "loss" and "train/loss" side by side: keep both as they are
            out[target] = value
        return out, dropped


def parse_map_rule(text: str) -> Tuple[str, str]:
    """``SOURCE=TARGET`` → (source, target); ValueError when there is no ``=`` or no source."""
    source, sep, target = text.partition("=")
    if not sep or not source.strip():
        raise ValueError(f"--map wants SOURCE=TARGET, got {text!r}")
    return source.strip(), target.strip()


@dataclass
class MetricsRecord:
    """One object of a metrics file: its line number, position among the non-blank lines (0-based), step,
    time (None: unknown), rank (None: the file's) and values."""

    line: int
    position: int
    step: int
    time_ns: Optional[int]
    rank: Optional[int]
    values: Dict[str, float]


@dataclass
class MetricsStats:
    """What reading one file found."""

    lines: int = 0                 # non-blank lines
    records: int = 0               # objects turned into records
    points: int = 0                # metric values in them
    malformed: int = 0             # lines skipped: not JSON, not an object, bad step
    malformed_lines: List[Tuple[int, str]] = field(default_factory=list)  # the first MAX_REPORTED
    no_step: int = 0               # objects without a step field (skipped)
    no_values: int = 0             # objects with no numeric field left (no envelope)
    non_numeric: Counter[str] = field(default_factory=Counter)  # ignored fields by name
    dropped_by_map: int = 0
    numbered: bool = False         # no step field in the file: steps are line positions
    step_field: str = ""
    time_field: str = ""

    def bad(self, line: int, reason: str) -> None:
        self.malformed += 1
        if len(self.malformed_lines) < MAX_REPORTED:
            self.malformed_lines.append((line, reason))


def _flatten(obj: Mapping[str, Any], prefix: str, out: Dict[str, float], ignored: Counter[str]) -> None:
    for key, value in obj.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(value, name, out, ignored)
            continue
        number = to_number(value)
        if number is None:
            ignored[name] += 1
        else:
            out[name] = number


class MetricsReader:
    """Iterates the :class:`MetricsRecord` of one file (see the module doc); ``on_bytes(n)`` is called
    with the size of every line read (progress)."""

    def __init__(self, path: Path, field_map: FieldMap, *, step_field: Optional[str] = None,
                 time_field: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None) -> None:
        self.path = path
        self.field_map = field_map
        self.step_field = step_field
        self.time_field = time_field
        self.on_bytes = on_bytes
        self.stats = MetricsStats()

    def __iter__(self) -> Iterator[MetricsRecord]:
        stats = self.stats
        decided = self.step_field is not None
        step_name = self.step_field or ""
        position = -1
        with open(self.path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                if self.on_bytes is not None:
                    self.on_bytes(len(raw))
                if not raw.strip():
                    continue
                stats.lines += 1
                position += 1
                try:
                    obj = json.loads(raw)
                except ValueError as exc:
                    stats.bad(number, f"not JSON ({exc})")
                    continue
                if not isinstance(obj, dict):
                    stats.bad(number, f"not a JSON object ({type(obj).__name__})")
                    continue
                if not decided:
                    step_name = next((f for f in STEP_FIELDS if f in obj), "")
                    stats.numbered = not step_name
                    stats.step_field = step_name
                    decided = True
                record = self._record(obj, number, position, step_name)
                if record is not None:
                    yield record

    def _record(self, obj: Dict[str, Any], number: int, position: int,
                step_name: str) -> Optional[MetricsRecord]:
        stats = self.stats
        if stats.numbered:
            step: Optional[int] = position
        elif step_name in obj:
            step = _to_step(obj.pop(step_name))
            if step is None:
                stats.bad(number, f"{step_name!r} is not a non-negative integer")
                return None
        else:
            stats.no_step += 1
            return None
        for other in STEP_FIELDS:  # a second step-like field is bookkeeping, not a metric
            obj.pop(other, None)
        time_ns: Optional[int] = None
        for name in (self.time_field,) if self.time_field else TIME_FIELDS:
            if name in obj:
                parsed = parse_time_value(obj[name])
                if parsed is not None:
                    time_ns = parsed
                    del obj[name]
                    stats.time_field = stats.time_field or name
                    break
        rank: Optional[int] = None
        if RANK_FIELD in obj:
            value = obj.pop(RANK_FIELD)
            rank = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
        flat: Dict[str, float] = {}
        _flatten(obj, "", flat, stats.non_numeric)
        values, dropped = self.field_map.apply(flat)
        stats.dropped_by_map += dropped
        if not values:
            stats.no_values += 1
            return None
        stats.records += 1
        stats.points += len(values)
        assert step is not None
        return MetricsRecord(number, position, step, time_ns, rank, values)


def peek_times(path: Path, *, time_field: Optional[str] = None, tail_bytes: int = 1 << 16
               ) -> Tuple[int, Optional[int], Optional[int]]:
    """(non-blank lines, time of the first record that has one, time of the last) -- cheaply: counts
    lines, reads objects from the head until one has a time and from the last ``tail_bytes`` backwards."""
    names = (time_field,) if time_field else TIME_FIELDS
    lines = 0
    first: Optional[int] = None
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            lines += 1
            if first is None and lines <= 1000:
                first = _time_of(raw, names)
        size = fh.tell()
        fh.seek(max(0, size - tail_bytes))
        tail = fh.read().splitlines()
    last: Optional[int] = None
    for raw in reversed(tail):
        last = _time_of(raw, names)
        if last is not None:
            break
    return lines, first, last


def _time_of(raw: bytes, names: Sequence[str]) -> Optional[int]:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    for name in names:
        if name in obj:
            parsed = parse_time_value(obj[name])
            if parsed is not None:
                return parsed
    return None
