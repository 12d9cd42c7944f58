"""JSON-lines metrics (one object per step, any field names): TrainGuard's own ``--metrics`` format, W&B's
exported ``wandb-history.jsonl`` (``_step``, ``_timestamp``), any logger's ``*.jsonl`` (the conventions:
:mod:`..metrics_jsonl`). Streamed line by line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple

from ..metrics_jsonl import peek_times
from ..signals import Recognizer
from .base import RawRecord, Source, SourceOptions


class JsonlSource(Source):
    """One ``*.jsonl`` file (see the module doc)."""

    format = "jsonl"

    @staticmethod
    def detect(path: Path) -> bool:
        """A ``*.jsonl``/``*.ndjson`` file, or a file whose first line is a JSON object."""
        if not path.is_file():
            return False
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            return True
        with open(path, "rb") as fh:
            first = fh.readline(1 << 16).strip()
        try:
            return first.startswith(b"{") and isinstance(json.loads(first), dict)
        except ValueError:
            return False

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        position = -1
        with open(self.path, "rb") as fh:
            for number, line in enumerate(fh, 1):
                self._bytes(len(line))
                if not line.strip():
                    continue
                stats.lines += 1
                position += 1
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    stats.bad(number, f"not JSON ({exc})")
                    continue
                if not isinstance(obj, dict):
                    stats.bad(number, f"not a JSON object ({type(obj).__name__})")
                    continue
                yield RawRecord(number, position, obj)

    def peek(self) -> Tuple[int, Optional[int], Optional[int]]:
        return peek_times(self.path, time_field=self.time_field)


class MetricsReader(JsonlSource):
    """:class:`JsonlSource` with the keyword arguments of the original reader."""

    def __init__(
        self,
        path: Path,
        field_map: Optional[Recognizer] = None,
        *,
        step_field: Optional[str] = None,
        time_field: Optional[str] = None,
        on_bytes: Optional[Callable[[int], None]] = None,
        key: str = "",
    ) -> None:
        super().__init__(path, field_map, SourceOptions(step_field, time_field, on_bytes), key=key)

    def clone(self) -> Source:
        return JsonlSource(
            self.path, Recognizer(), SourceOptions(self.step_field, self.time_field), key=self.key
        )
