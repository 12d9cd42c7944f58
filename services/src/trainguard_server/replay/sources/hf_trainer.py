"""HF Trainer's ``trainer_state.json``: its ``log_history`` (one dict per ``logging_steps``: ``loss``,
``grad_norm``, ``learning_rate``, ``epoch``, ``step``; eval entries with ``eval_*``; a last summary entry).

Contract: every ``log_history`` entry is a dict-shaped record (its ``step`` field). The end-of-training
summary entry (the one with ``train_runtime``: its ``train_loss`` is the mean over the whole run, not a
step's) is left out with that reason. The Trainer writes the file whole, so it is read whole (it holds one
small dict per logged step); no times (the importer spaces them, or uses a step-time field).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .base import RawRecord, Source

NAME = "trainer_state.json"
SUMMARY_FIELD = "train_runtime"


class TrainerStateSource(Source):
    """One ``trainer_state.json`` (see the module doc)."""

    format = "hf-trainer"

    @staticmethod
    def detect(path: Path) -> bool:
        if path.is_dir():
            return (path / NAME).is_file()
        if not path.is_file() or path.suffix != ".json":
            return False
        if path.name == NAME:
            return True
        with open(path, "rb") as fh:
            return b'"log_history"' in fh.read(1 << 16)

    def size(self) -> int:
        return self._file().stat().st_size

    def _file(self) -> Path:
        return self.path / NAME if self.path.is_dir() else self.path

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        path = self._file()
        text = path.read_bytes()
        self._bytes(len(text))
        try:
            doc = json.loads(text)
        except ValueError as exc:
            stats.bad(1, f"not JSON ({exc})")
            return
        history = doc.get("log_history") if isinstance(doc, dict) else None
        if not isinstance(history, list):
            stats.bad(1, "no log_history list")
            return
        for index, entry in enumerate(history):
            stats.lines += 1
            if not isinstance(entry, dict):
                stats.bad(index + 1, f"log_history[{index}] is not an object")
                continue
            if SUMMARY_FIELD in entry:
                for name in entry:
                    if name != "step":
                        self.recognizer.note_ignored(name, "end-of-training summary (HF log_history)")
                continue
            yield RawRecord(index + 1, index, dict(entry))
