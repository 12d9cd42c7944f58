"""CSV with a header row, any field names: Lightning's ``CSVLogger`` ``metrics.csv`` (sparse rows: an empty
cell is a metric not logged at that step), W&B's exported panel CSV (``Step``, ``<run> - <metric>`` and its
``__MIN``/``__MAX`` envelope columns) and any logger's ``*.csv``. Streamed row by row with :mod:`csv`.

Contract: the header names the fields (a ``Step`` column counts as ``step``; W&B's ``<run> - `` prefix is
taken off, its ``__MIN``/``__MAX`` columns are left out with that reason). Every row is a dict-shaped record
(step, time and rank fields as :mod:`..metrics_jsonl` says); empty cells are absent; a row with more cells
than the header is malformed (counted).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from ..metrics_jsonl import STEP_FIELDS
from .base import RawRecord, Source

_WANDB_COLUMN = re.compile(r"^.+? - (?P<name>.+)$")
_ENVELOPE = ("__MIN", "__MAX")


def _columns(header: List[str]) -> List[Optional[str]]:
    """The field name of each column (None: left out)."""
    wandb = any(" - " in h for h in header)
    out: List[Optional[str]] = []
    for h in header:
        name = h.strip()
        if wandb:
            m = _WANDB_COLUMN.match(name)
            if m is not None:
                name = m.group("name")
        if name.endswith(_ENVELOPE):
            out.append(None)
            continue
        if name.lower() in STEP_FIELDS:
            name = name.lower()
        out.append(name)
    return out


class CsvSource(Source):
    """One CSV file (see the module doc)."""

    format = "csv"

    @staticmethod
    def detect(path: Path) -> bool:
        if not (path.is_file() and path.suffix.lower() == ".csv"):
            return False
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            head = fh.readline()
        return "," in head and not head.strip()[:1].isdigit()

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        with open(self.path, encoding="utf-8", errors="replace", newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                return
            self._bytes(sum(len(h) + 1 for h in header))
            names = _columns(header)
            for dropped, h in zip(names, header):
                if dropped is None:
                    self.recognizer.note_ignored(h, "W&B export min/max envelope column", 0)
            position = -1
            for row in reader:
                line = reader.line_num
                self._bytes(sum(len(c) + 1 for c in row))
                if not row or not any(c.strip() for c in row):
                    continue
                stats.lines += 1
                position += 1
                if len(row) > len(names):
                    stats.bad(line, f"{len(row)} cells for {len(names)} columns")
                    continue
                fields: Dict[str, str] = {}
                for name, cell in zip(names, row):
                    if name is not None and cell.strip():
                        fields[name] = cell
                yield RawRecord(line, position, fields)
