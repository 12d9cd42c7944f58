"""An MLflow file-store run folder (``mlruns/<experiment id>/<run id>/``), read as files -- its layout is
MLflow's documented ``FileStore``: ``meta.yaml`` and ``metrics/<key>`` (a key with ``/`` is a sub-path),
each metric file one line per logged value, ``<timestamp ms> <value> <step>``.

Contract: a deleted run (``lifecycle_stage: deleted``, until ``mlflow gc``) is no run. The metric files
are merged by (step, timestamp) with one line of each file in memory
(:func:`heapq.merge`; each file is in logging order); the values of one step form one record, timed at the
earliest timestamp among them. A line that is not ``int float int`` is malformed (counted, with its file).
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from .base import RawRecord, Source

Entry = Tuple[int, int, str, str]  # (step, timestamp ms, key, value text)
STATUS_EXIT = {"3": 0, "FINISHED": 0, "4": 1, "FAILED": 1}
"""MLflow's RunStatus (``meta.yaml`` stores the number) -> exit code; RUNNING/SCHEDULED/KILLED say none."""


def _meta(run: Path) -> Dict[str, str]:
    """The top-level ``key: value`` lines of a run's ``meta.yaml`` (as text; empty when unreadable)."""
    out: Dict[str, str] = {}
    try:
        text = (run / "meta.yaml").read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        if line[:1].isalpha():
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    return out


class MlflowRunSource(Source):
    """One MLflow file-store run (see the module doc)."""

    format = "mlflow"

    def exit_code(self) -> Optional[int]:
        """0 for a FINISHED run, 1 for a FAILED one (``meta.yaml``'s ``status``); None otherwise."""
        return STATUS_EXIT.get(_meta(self.path).get("status", ""))

    @staticmethod
    def detect(path: Path) -> bool:
        """A run folder (``meta.yaml`` + ``metrics/``) that is not deleted (``lifecycle_stage: deleted``)."""
        if not (path.is_dir() and (path / "meta.yaml").is_file() and (path / "metrics").is_dir()):
            return False
        return _meta(path).get("lifecycle_stage") != "deleted"

    def _files(self) -> List[Tuple[str, Path]]:
        root = self.path / "metrics"
        return sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())

    def size(self) -> int:
        return sum(p.stat().st_size for _, p in self._files())

    def _entries(self, key: str, path: Path) -> Iterator[Entry]:
        with open(path, "rb") as fh:
            for number, data in enumerate(fh, 1):
                self._bytes(len(data))
                parts = data.split()
                if not parts:
                    continue
                try:
                    ts, value = int(parts[0]), parts[1].decode()
                    step = int(parts[2]) if len(parts) > 2 else 0
                    float(value)
                except (ValueError, IndexError):
                    self.stats.bad(number, f"metrics/{key}: not '<timestamp> <value> <step>'")
                    continue
                yield step, ts, key, value

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        streams = [self._entries(key, path) for key, path in self._files()]
        position = -1
        group: Dict[str, str] = {}
        step = -1
        first_ts: Optional[int] = None
        for s, ts, key, value in heapq.merge(*streams):
            stats.lines += 1
            if group and s != step:
                position += 1
                yield RawRecord(
                    position + 1,
                    position,
                    group,
                    native=True,
                    step=step,
                    time_ns=None if first_ts is None else first_ts * 1_000_000,
                )
                group, first_ts = {}, None
            step = s
            first_ts = ts if first_ts is None else min(first_ts, ts)
            group[key] = value
        if group:
            position += 1
            yield RawRecord(
                position + 1,
                position,
                group,
                native=True,
                step=step,
                time_ns=None if first_ts is None else first_ts * 1_000_000,
            )
