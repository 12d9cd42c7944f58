"""The :class:`Source` interface: one metrics input of a run (a file or a run folder), read as a stream of
:class:`~..metrics_jsonl.MetricsRecord` with TrainGuard's names and units.

Contract: a reader implements :meth:`Source.raw`, which yields :class:`RawRecord` -- one per step-record of
the input, in file order, holding bounded memory (one record, or one step's group, at a time) -- and counts
what it read and skipped in :attr:`Source.stats` (``lines``; :meth:`~..metrics_jsonl.MetricsStats.bad` for
malformed input, with its line or record number). A reader whose format carries the step (and time) natively
sets ``native``; a dict-shaped one (JSONL, CSV, ``log_history``) leaves them to the base class, which finds
the step field (:data:`~..metrics_jsonl.STEP_FIELDS` or ``step_field``; numbering by position when the first
record has none), the time field and the ``rank`` field as :mod:`..metrics_jsonl` documents. Then every
record's fields are flattened and recognised (:class:`~..signals.Recognizer`). Nothing in the input is fatal.

A reader that needs an optional library imports it inside :meth:`Source.raw` and raises
:class:`MissingLibrary` (a clear message naming the pip package) when it is absent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, Optional, Tuple

from ..metrics_jsonl import (
    RANK_FIELD,
    STEP_FIELDS,
    TIME_FIELDS,
    MetricsRecord,
    MetricsStats,
    to_step,
)
from ..signals import Recognizer, flatten
from ..times import parse_time_value


class MissingLibrary(RuntimeError):
    """A reader's optional library is not installed (the message says which pip package to install)."""

    def __init__(self, fmt: str, package: str) -> None:
        super().__init__(f"reading {fmt} needs the '{package}' package: pip install {package}")
        self.package = package


@dataclass
class RawRecord:
    """One step-record as the reader found it: its line (or record number, for event ids), position among
    the input's records (0-based), fields (nested objects allowed), and -- ``native`` -- its step, time and
    rank as the format says them."""

    line: int
    position: int
    fields: Dict[str, Any]
    native: bool = False
    step: int = -1
    time_ns: Optional[int] = None
    rank: Optional[int] = None


@dataclass
class SourceOptions:
    """How to read an input (the ``trainguard replay`` flags that concern its fields)."""

    step_field: Optional[str] = None
    time_field: Optional[str] = None
    on_bytes: Optional[Callable[[int], None]] = None
    extra: Dict[str, Any] = field(default_factory=dict)


class Source(ABC):
    """One metrics input (see the module doc). ``path``: the file or run folder; ``key``: the name its
    events' ids derive from (default: the file or folder name)."""

    format: ClassVar[str] = ""

    def __init__(
        self,
        path: Path,
        recognizer: Optional[Recognizer] = None,
        options: Optional[SourceOptions] = None,
        *,
        key: str = "",
    ) -> None:
        self.path = Path(path)
        self.recognizer = recognizer if recognizer is not None else Recognizer()
        self.options = options or SourceOptions()
        self.key = key or self.path.name
        self.stats = MetricsStats()

    @staticmethod
    def detect(path: Path) -> bool:
        """Whether ``path`` (a file or folder) looks like this reader's input (cheap: at most 64 KiB read)."""
        return False

    @property
    def step_field(self) -> Optional[str]:
        return self.options.step_field

    @property
    def time_field(self) -> Optional[str]:
        return self.options.time_field

    def _bytes(self, n: int) -> None:
        if self.options.on_bytes is not None:
            self.options.on_bytes(n)

    def size(self) -> int:
        """Bytes of input (for the progress display)."""
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return self.path.stat().st_size

    def clone(self) -> Source:
        """A fresh reader of the same input (its own stats and recognizer; no progress)."""
        return type(self)(
            self.path,
            Recognizer(),
            SourceOptions(self.step_field, self.time_field, extra=self.options.extra),
            key=self.key,
        )

    def exit_code(self) -> Optional[int]:
        """How the run ended, as the format recorded it (None: it does not say; known once read)."""
        return None

    @abstractmethod
    def raw(self) -> Iterator[RawRecord]:
        """The input's step-records (see the module doc)."""

    def peek(self) -> Tuple[int, Optional[int], Optional[int]]:
        """(records, time of the first record that has one, time of the last) -- a pass over a fresh
        reader (readers with a cheaper way override it)."""
        count = 0
        first: Optional[int] = None
        last: Optional[int] = None
        names = (self.time_field,) if self.time_field else TIME_FIELDS
        for raw in self.clone().raw():
            count = max(count, raw.position + 1)
            t = raw.time_ns if raw.native else _time_in(raw.fields, names)
            if t is not None:
                first = t if first is None else first
                last = t
        return count, first, last

    def __iter__(self) -> Iterator[MetricsRecord]:
        stats = self.stats
        decided = self.step_field is not None
        step_name = self.step_field or ""
        for raw in self.raw():
            obj = raw.fields
            if raw.native:
                step: Optional[int] = raw.step
                time_ns, rank = raw.time_ns, raw.rank
            else:
                if not decided:
                    step_name = next((f for f in STEP_FIELDS if f in obj), "")
                    stats.numbered = not step_name
                    stats.step_field = step_name
                    decided = True
                if stats.numbered:
                    step = raw.position
                elif step_name in obj:
                    step = to_step(obj.pop(step_name))
                    if step is None:
                        stats.bad(raw.line, f"{step_name!r} is not a non-negative integer")
                        continue
                else:
                    stats.no_step += 1
                    continue
                for other in STEP_FIELDS:  # a second step-like field is bookkeeping, not a metric
                    obj.pop(other, None)
                time_ns = None
                for name in (self.time_field,) if self.time_field else TIME_FIELDS:
                    if name in obj:
                        parsed = parse_time_value(obj[name])
                        if parsed is not None:
                            time_ns = parsed
                            del obj[name]
                            stats.time_field = stats.time_field or name
                            break
                rank = None
                if RANK_FIELD in obj:
                    value = obj.pop(RANK_FIELD)
                    rank = (
                        value
                        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
                        else None
                    )
            flat = flatten(obj, stats.non_numeric)
            values, dropped = self.recognizer.apply(flat)
            stats.dropped_by_map += dropped
            if not values:
                stats.no_values += 1
                continue
            stats.records += 1
            stats.points += len(values)
            assert step is not None
            yield MetricsRecord(raw.line, raw.position, step, time_ns, rank, values)


def _time_in(obj: Dict[str, Any], names: Tuple[str, ...]) -> Optional[int]:
    for name in names:
        if name in obj:
            parsed = parse_time_value(obj[name])
            if parsed is not None:
                return parsed
    return None
